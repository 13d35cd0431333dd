"""The loader plan: kept systems, batch sizes, batches per rank, probabilities, CDF and seed.

Computed once from the systems' atom and frame counts, the ``batch_size`` rule, the probability
style (or ``sys_probs``) and the job seed. ``DpLoaderSet``, the samplers, ``mdloader check`` and
the elastic resume read it instead of recomputing it, so they cannot disagree.

The sampling keys of the data section come in whole, as one
:class:`~mdloader.sampling.spec.SamplingSpec`. The plan is frozen and pure (numpy only: no I/O,
no process group; the seed agreed by the ranks comes in as a value). A loaded state that brings
another seed gives a *new* plan (:meth:`LoaderPlan.adopt_seed`, the one path by which the seed
changes after the start; it refuses before anything changes): whoever holds a plan (a loader
set, a sampler) replaces its own, nobody else's.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.balance import batch_costs, check_window
from mdloader.sampling.batching import batches_per_rank, resolve_batch_sizes
from mdloader.sampling.order import (
    SEED_MOD,
    Continuation,
    FrameOrder,
    statistics_frame_counts,
    statistics_frames,
    weights_to_cdf,
)
from mdloader.sampling.probability import (
    ProbabilityRule,
    StyleRule,
    as_rule,
    select_prob_source,
)
from mdloader.sampling.spec import SamplingSpec
from mdloader.state import check_same


def _frozen(values: Any, dtype: type = np.int64) -> np.ndarray:
    """A read-only 1-D copy of ``values`` (an already frozen array of that dtype is shared)."""
    if isinstance(values, np.ndarray) and values.dtype == dtype and not values.flags.writeable \
            and values.ndim == 1:
        return values
    out = np.array(values, dtype=dtype).reshape(-1)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class LoaderPlan:
    """What a loader set and its samplers draw from, computed once.

    Build it with :meth:`build` (atom counts and a data section's :class:`SamplingSpec`) or
    :meth:`of_sizes` (batch sizes already known); :meth:`with_spec_probabilities`,
    :meth:`with_probabilities` or :meth:`with_rule` add the system probabilities. Arrays are
    read-only.

    Attributes
    ----------
    nframes, batch_sizes
        Frames and batch size of every kept system.
    seed
        The job seed (the same on every rank); None only for a plan that draws nothing
        (``mdloader check``'s table).
    seed_given
        The user chose the seed: a saved state with another one is refused. False when it was
        drawn at random: a saved state's seed is then adopted, so a run without a seed resumes.
    world_size
        Number of ranks the batch counts and probabilities are for.
    kept, nsys_original
        Original indices of the kept systems (``filter:N`` drops some) and the original count;
        probability inputs are written against the original list.
    natoms
        Atoms per frame of every kept system (None when built from batch sizes).
    spec
        The data section's sampling keys (shuffling, one system stream for all ranks, balanced
        steps, the JSON path named in errors), read through the properties of the same names.
    rule
        The probability rule (None until probabilities are added).
    neighbours
        The mean neighbours within rcut of every kept system (balanced steps under the
        ``neighbours`` cost model only, :mod:`mdloader.sampling.balance`).
    nbatches, total_batches
        Batches of every system on each rank, ``ceil(ceil(F / W) / B)``, and their sum
        (DeePMD-kit's ``index`` and ``total_batch``).
    """

    nframes: np.ndarray
    batch_sizes: np.ndarray
    seed: int | None
    seed_given: bool = True
    world_size: int = 1
    kept: np.ndarray | None = None
    nsys_original: int | None = None
    natoms: np.ndarray | None = None
    spec: SamplingSpec = field(default_factory=SamplingSpec)
    rule: ProbabilityRule | None = None
    neighbours: np.ndarray | None = None
    nbatches: np.ndarray = field(init=False, repr=False)
    total_batches: int = field(init=False)
    _probabilities: np.ndarray | None = field(init=False, repr=False)
    _cdf: np.ndarray | None = field(init=False, repr=False)
    _costs: np.ndarray | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        nframes, sizes = _frozen(self.nframes), _frozen(self.batch_sizes)
        if len(nframes) != len(sizes):
            raise ConfigError(f"{len(sizes)} batch sizes for {len(nframes)} systems")
        world = self.world_size
        if isinstance(world, bool) or not isinstance(world, numbers.Integral) or world < 1:
            raise ConfigError(f"world_size must be an integer >= 1, got {world!r}")
        kept = np.arange(len(nframes)) if self.kept is None else self.kept
        put(self, "nframes", nframes)
        put(self, "batch_sizes", sizes)
        put(self, "world_size", int(world))
        put(self, "kept", _frozen(kept))
        if len(self.kept) != len(nframes):
            raise ConfigError(f"{len(self.kept)} kept indices for {len(nframes)} systems")
        put(self, "nsys_original", len(nframes) if self.nsys_original is None
            else int(self.nsys_original))
        if self.natoms is not None:
            put(self, "natoms", _frozen(self.natoms))
        if self.seed is not None:
            put(self, "seed", int(self.seed))
        put(self, "seed_given", bool(self.seed_given))
        nbatches = _frozen(batches_per_rank(nframes, sizes, self.world_size))
        put(self, "nbatches", nbatches)
        put(self, "total_batches", int(nbatches.sum()))
        probs = cdf = None
        if self.rule is not None:
            probs = _frozen(self.rule(nbatches), np.float64)
            if len(probs) != len(nframes):
                raise ConfigError(f"{len(probs)} probabilities for {len(nframes)} systems")
            cdf = _frozen(weights_to_cdf(probs), np.float64)
        put(self, "_probabilities", probs)
        put(self, "_cdf", cdf)
        put(self, "_costs", self._balance_costs())

    def _balance_costs(self) -> np.ndarray | None:
        """Checks the balance settings; the cost of one batch of every system when balanced."""
        window = self.balance_window
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
            raise ConfigError(f"the balance window must be 0 (off) or a positive number of "
                              f"steps, got {window!r}", path=self._key("balance_window"))
        if self.neighbours is not None:
            object.__setattr__(self, "neighbours", _frozen(self.neighbours, np.float64))
        if not window:
            return None
        try:
            check_window(window, self.world_size, self.same_system_across_ranks)
            if self.natoms is None:
                raise ConfigError("balanced steps need the atom count of every system")
            return _frozen(batch_costs(self.balance_cost, self.natoms, self.batch_sizes,
                                       self.neighbours), np.float64)
        except ConfigError as exc:
            if self.json_path and exc.path and not exc.path.startswith(self.json_path):
                raise ConfigError(exc.message, path=self._key(exc.path.rsplit(".", 1)[-1])) \
                    from None
            raise

    def _key(self, name: str) -> str:
        return f"{self.json_path}.{name}" if self.json_path else f"training.training_data.{name}"

    # -- the data section's sampling keys, as the spec gives them --------------------------------
    @property
    def shuffle(self) -> bool:
        """Frames are shuffled within each pass."""
        return bool(self.spec.shuffle)

    @property
    def same_system_across_ranks(self) -> bool:
        """Every rank draws the same system at each step."""
        return bool(self.spec.same_system_across_ranks)

    @property
    def json_path(self) -> str | None:
        """Where the data section sits in ``input.json``."""
        return self.spec.json_path

    @property
    def balance_window(self) -> int:
        """Steps per balanced window (0: off)."""
        return int(self.spec.balance_window)

    @property
    def balance_cost(self) -> str:
        """The cost model a balanced window evens out."""
        return self.spec.balance_cost

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, natoms: Sequence[int] | np.ndarray, nframes: Sequence[int] | np.ndarray,
              spec: SamplingSpec, *, seed: int | None, seed_given: bool = True,
              world_size: int = 1,
              neighbours: Sequence[float] | np.ndarray | None = None) -> LoaderPlan:
        """The plan of systems with ``natoms`` atoms and ``nframes`` frames (original list),
        sampled as the data section's ``spec`` says.

        ``spec.batch_size`` is DeePMD-kit's value (``int``, list, ``"auto[:N]"``, ``"max:N"``,
        ``"filter:N"``: :mod:`mdloader.sampling.batching`); the probabilities are added by
        :meth:`with_spec_probabilities` (or a sampler's own). Errors name the keys under
        ``spec.json_path``.
        """
        atoms = np.asarray(natoms, dtype=np.int64).reshape(-1)
        frames = np.asarray(nframes, dtype=np.int64).reshape(-1)
        key = spec.key("batch_size")
        if len(atoms) != len(frames):
            raise ConfigError(f"{len(atoms)} atom counts for {len(frames)} systems", path=key)
        sizes = resolve_batch_sizes(spec.batch_size_value(), atoms, key)
        if neighbours is not None:
            neighbours = np.asarray(neighbours, dtype=np.float64).reshape(-1)
            if len(neighbours) != len(atoms):
                raise ConfigError(f"{len(neighbours)} neighbour means for {len(atoms)} systems",
                                  path=f"{spec.json_path or 'training.training_data'}"
                                  ".balance_cost")
            neighbours = neighbours[sizes.kept]
        return cls(frames[sizes.kept], sizes.batch_sizes, seed, seed_given, world_size,
                   kept=sizes.kept, nsys_original=len(atoms), natoms=atoms[sizes.kept],
                   spec=spec, neighbours=neighbours)

    @classmethod
    def of_sizes(cls, nframes: Sequence[int] | np.ndarray,
                 batch_sizes: Sequence[int] | np.ndarray, *, seed: int | None,
                 seed_given: bool = True, world_size: int = 1,
                 spec: SamplingSpec | None = None,
                 probabilities: Sequence[float] | np.ndarray | ProbabilityRule | None = None,
                 natoms: Sequence[int] | np.ndarray | None = None,
                 neighbours: Sequence[float] | np.ndarray | None = None) -> LoaderPlan:
        """The plan of systems whose batch sizes are known (every system kept; the batch size
        of ``spec`` is not read); balanced steps need ``natoms`` (and ``neighbours`` for that
        cost model)."""
        rule = None if probabilities is None else as_rule(probabilities)
        return cls(nframes, batch_sizes, seed, seed_given, world_size,
                   spec=spec or SamplingSpec(), rule=rule, natoms=natoms,
                   neighbours=neighbours)

    def rule_of(self, prob_style: str | Sequence[float], sys_prob: bool = False,
                key: str | None = None) -> StyleRule:
        """The rule of an ``auto_prob`` style or a ``sys_probs`` list (``sys_prob=True``),
        written against the original system list and remapped onto the kept systems."""
        return StyleRule.of(prob_style, sys_prob, kept=self.kept,
                            nsys_original=self.nsys_original, key=key)

    def with_probabilities(self, prob_style: str | Sequence[float], sys_prob: bool = False,
                           key: str | None = None) -> LoaderPlan:
        """A copy of the plan with the probabilities of a style or ``sys_probs`` (checked now)."""
        return replace(self, rule=self.rule_of(prob_style, sys_prob, key))

    def with_spec_probabilities(self) -> LoaderPlan:
        """A copy of the plan with the probabilities its spec names (``sys_probs`` if set, else
        ``auto_prob``)."""
        value, is_sys_probs, key = self.spec.probability_source()
        return self.with_probabilities(value, is_sys_probs, key)

    def with_params(self, params: Mapping[str, Any]) -> LoaderPlan:
        """A copy of the plan with a data section's probabilities: ``sys_probs`` if set, else
        ``auto_prob``, else ``prob_sys_size`` (DeePMD-kit's precedence)."""
        value, is_sys_probs, name = select_prob_source(params)
        key = f"{self.json_path}.{name}" if self.json_path else None
        return self.with_probabilities(value, is_sys_probs, key)

    def with_rule(self, probs: Sequence[float] | np.ndarray | ProbabilityRule) -> LoaderPlan:
        """A copy of the plan with a rule, or fixed probabilities (one per kept system)."""
        return replace(self, rule=as_rule(probs))

    def on_world(self, world_size: int) -> LoaderPlan:
        """The same plan on ``world_size`` ranks (batch counts and probabilities depend on it)."""
        return self if world_size == self.world_size else replace(self, world_size=world_size)

    # -- what the samplers read --------------------------------------------------------------
    @property
    def nsys(self) -> int:
        """Number of kept systems."""
        return len(self.nframes)

    @property
    def probabilities(self) -> np.ndarray:
        """Probability of drawing each system at a step, on :attr:`world_size` ranks."""
        if self._probabilities is None:
            raise ConfigError("this loader plan has no probabilities yet: give it a "
                              "probability style, sys_probs or a rule first")
        return self._probabilities

    @property
    def cdf(self) -> np.ndarray:
        """The cumulative probabilities the system stream draws from (inverse CDF)."""
        self.probabilities  # noqa: B018 - raises the same error without a rule
        return self._cdf  # type: ignore[return-value]

    @property
    def balance_costs(self) -> np.ndarray | None:
        """The cost of one batch of every system under :attr:`balance_cost` (None: balancing
        off): what a balanced window sorts by."""
        return self._costs

    def cdf_on(self, world_size: int) -> np.ndarray:
        """The stream's cumulative probabilities on ``world_size`` ranks (an elastic replay)."""
        return self.on_world(world_size).cdf

    def frame_order(self, rank: int, continuation: Continuation | None = None) -> FrameOrder:
        """Which frames each batch of each system holds on ``rank``, under this plan's seed
        (after an elastic resume: ``continuation``'s leftover, then its generation's passes)."""
        if self.seed is None:
            raise ConfigError("this loader plan has no seed: it gives batch counts and "
                              "probabilities, not frames")
        return FrameOrder(self.nframes, self.batch_sizes, seed=self.seed, rank=rank,
                          world_size=self.world_size, shuffle=self.shuffle,
                          continuation=continuation)

    def statistics_frame_counts(self, nbatch: int) -> np.ndarray:
        """How many frames each kept system gives the statistics (the lengths of
        :meth:`statistics_frames`, counted without drawing a permutation)."""
        return statistics_frame_counts(self.nframes, self.batch_sizes, nbatch)

    def statistics_frames(self, sid: int, nbatch: int) -> np.ndarray:
        """The frames system ``sid`` gives the statistics before training under this plan's seed
        (:func:`~mdloader.sampling.order.statistics_frames`: the same at every world size)."""
        if self.seed is None:
            raise ConfigError("this loader plan has no seed: it gives batch counts and "
                              "probabilities, not frames")
        return statistics_frames(self.seed, sid, int(self.nframes[sid]),
                                 int(self.batch_sizes[sid]), nbatch, self.shuffle)

    # -- resume --------------------------------------------------------------------------------
    def adopt_seed(self, saved: Any, kind: str = "loader") -> LoaderPlan:
        """The plan under a loaded state's seed: the one way the seed changes after the start.

        A seed the user gave stays, and another saved seed is refused (``StateDictError``
        quoting both); a seed drawn at random gives way to the saved one. Pure: on a refusal,
        this plan and whoever holds it are as they were. ``kind`` names the loader in errors.
        """
        if isinstance(saved, bool) or not isinstance(saved, numbers.Integral) \
                or not 0 <= saved < SEED_MOD:
            raise StateDictError(f"cannot resume the {kind}: the saved seed must be an integer "
                                 f"in [0, 2**64), got {saved!r}")
        if int(saved) == self.seed:
            return self
        if self.seed_given:
            check_same(kind, "seed", int(saved), self.seed)
        return replace(self, seed=int(saved))


__all__ = ["LoaderPlan"]
