"""The weighted system sampler: which frames of which system make each batch of this rank.

The sampler yields :class:`BatchKey` ``(sid, fids, step)``. ``DataLoader(loader_set,
sampler=sampler, batch_size=None, num_workers=K, ...)`` hands each key to a worker that only
*reads* those frames, so the union of what the workers yield is exactly this rank's stream: no
batch twice, no frame skipped (DeePMD-kit's workers each advance a forked copy of per-system
iterators and repeat batches).

Resume state is a few integers; the per-system cursors are recomputed by replaying the system
stream (:func:`mdloader.sampling.order.stream_counts`). The state of every rank merged
(:func:`mdloader.sampling.elastic.merge_rank_states`) also resumes on another number of ranks
(:mod:`mdloader.sampling.elastic`). Workers prefetch, so the sampler's own
position runs ahead of what was consumed: save ``sampler.state_dict(consumed=k)``, or the state
of a :class:`~mdloader.loading.stateful_loader.StatefulLoader`, or let torchdata's
``StatefulDataLoader`` save the state of the epoch iterator (:class:`EpochIterator`).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Sampler

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.balance import (
    Slots,
    arrange,
    chunk_draws,
    label,
    next_start_counts,
    rank_slots,
    window_draws,
    window_start_counts,
)
from mdloader.sampling.elastic import (
    BALANCE_IDENTITY,
    IDENTITY,
    JOB_KEYS,
    RANK_KEYS,
    Generation,
    JobSampling,
    full_continuation,
    generation_rows,
    parse_generations,
    resume_point,
    share_of,
)
from mdloader.sampling.order import (
    STREAM_CHUNK,
    Continuation,
    FrameOrder,
    sizes_digest,
    stream_chunk,
    stream_counts,
)
from mdloader.sampling.plan import LoaderPlan, PlanOwner
from mdloader.sampling.probability import ProbabilityRule, as_rule
from mdloader.state import check_keys, check_same

log = logging.getLogger(__name__)

STATE_VERSION = 2


def type_map_digest(type_map: Sequence[str] | None) -> int:
    """A 32-bit CRC of the type map (0 without one): a state of another type map is refused."""
    return 0 if not type_map else zlib.crc32("\0".join(type_map).encode())


class BatchKey(NamedTuple):
    """One batch: frames ``fids`` of system ``sid``; ``step`` is its index in the rank's stream;
    ``drawer`` is the rank whose system stream drew it (another rank's in balanced steps; -1:
    no stream, a validation key)."""

    sid: int
    fids: tuple[int, ...]
    step: int
    drawer: int = -1


class WeightedSystemSampler(Sampler[BatchKey]):
    """Draw a system by probability, then the next batch of that system's frames on this rank.

    Parameters
    ----------
    nframes, batch_sizes
        Frames and batch size of every system (after any ``filter:N``).
    probs
        System probabilities (:func:`mdloader.sampling.probability.system_probabilities`), or a
        :class:`~mdloader.sampling.probability.ProbabilityRule` that computes them from the
        batch counts of any world size (what an elastic resume needs when they depend on it).
    seed
        The job seed, identical on every rank (frame permutations must agree across ranks).
    rank, world_size
        This rank among how many; values, not a process group, so tests can play any rank.
    num_samples
        Keys per epoch, i.e. per ``iter()`` (DeePMD-kit: ``total_batch * max(NUM_WORKERS, 1)``).
        Each ``iter()`` continues the stream where the previous one stopped: it never restarts.
    same_system_across_ranks
        All ranks draw the same system at each step (equal atom counts per step, no stragglers),
        still reading disjoint frames; after an elastic resume, not until the leftover is served
        (``docs/sampling.md``, the limits of elastic resume).
    adopt_seed
        The seed was not chosen by the user (``seed=None``): :meth:`load_state_dict` then takes
        the saved seed instead of rejecting it, so a run started without a seed can resume.
    type_map
        The model's type map, part of the job's identity: a state saved with another one is
        refused.
    balance_window, balance_cost, natoms, neighbours
        Balanced steps (``docs/sampling.md``): windows of ``balance_window`` steps (0: off) whose
        batches are dealt so each step's ranks cost about the same under the cost model
        ``balance_cost`` (``"atoms"``: ``natoms`` per frame times the batch size;
        ``"neighbours"``: that times ``neighbours``, the mean neighbours within rcut).
    """

    def __init__(self, nframes: Sequence[int] | np.ndarray, batch_sizes: Sequence[int] | np.ndarray,
                 probs: Sequence[float] | np.ndarray | ProbabilityRule, *, seed: int,
                 rank: int = 0, world_size: int = 1, num_samples: int | None = None,
                 shuffle: bool = True, same_system_across_ranks: bool = False,
                 adopt_seed: bool = False, type_map: Sequence[str] | None = None,
                 balance_window: int = 0, balance_cost: str = "atoms",
                 natoms: Sequence[int] | np.ndarray | None = None,
                 neighbours: Sequence[float] | np.ndarray | None = None) -> None:
        plan = LoaderPlan.of_sizes(nframes, batch_sizes, seed=seed, seed_given=not adopt_seed,
                                   world_size=world_size, shuffle=shuffle,
                                   same_system_across_ranks=same_system_across_ranks,
                                   natoms=natoms, balance_window=balance_window,
                                   balance_cost=balance_cost, neighbours=neighbours)
        self._start(PlanOwner(plan), as_rule(probs), rank, num_samples, type_map)

    @classmethod
    def of_plan(cls, owner: PlanOwner, probs: Sequence[float] | np.ndarray | ProbabilityRule,
                *, rank: int = 0, num_samples: int | None = None,
                type_map: Sequence[str] | None = None) -> WeightedSystemSampler:
        """A sampler that reads the plan ``owner`` holds (a loader set's): sizes, flags and the
        seed come from it, so a seed adopted by either of them is the other's too."""
        sampler = cls.__new__(cls)
        sampler._start(owner, as_rule(probs), rank, num_samples, type_map)
        return sampler

    def _start(self, owner: PlanOwner, rule: ProbabilityRule, rank: int,
               num_samples: int | None, type_map: Sequence[str] | None) -> None:
        self._owner, self.rule, self.rank = owner, rule, int(rank)
        self._base = owner.plan
        self.plan = self._base.with_rule(rule)
        """The plan this sampler draws from: the owner's, with this sampler's probabilities."""
        self.order = self.plan.frame_order(self.rank)
        self.weights = torch.tensor(self.plan.probabilities, dtype=torch.double, device="cpu")
        self.num_samples = self.plan.total_batches if num_samples is None else int(num_samples)
        if self.num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {self.num_samples}")
        self._job = {
            "nsys": self.plan.nsys,
            "sizes_digest": sizes_digest(self.plan.nframes, self.plan.batch_sizes),
            "probs_digest": self.rule.digest, "type_map_digest": type_map_digest(type_map),
            "shuffle": int(self.plan.shuffle),
            "same_system_across_ranks": int(self.plan.same_system_across_ranks)}
        self._type_map = list(type_map) if type_map else None
        self._history: tuple[Generation, ...] = ()
        self._step = 0
        self._counts = np.zeros(self.plan.nsys, dtype=np.int64)
        self._chunk_id = -1
        self._chunk = np.empty(0, dtype=np.int64)
        self._full: Continuation | None = None
        self._reset_balance()

    # -- balanced steps ------------------------------------------------------------------
    @property
    def balance_window(self) -> int:
        """Steps per balanced window (0: every rank trains its own draws)."""
        return self.plan.balance_window

    @property
    def _balance_identity(self) -> dict[str, int]:
        """The balance keys of this job's state: none when balancing is off."""
        if not self.plan.balance_window:
            return {}
        return {"balance_window": self.plan.balance_window,
                "balance_cost_digest": sizes_digest(self.plan.balance_costs)}

    def _reset_balance(self) -> None:
        """Forget the current window (a new seed, generation or position)."""
        self._window = -1
        self._window_start: np.ndarray | None = None
        self._window_draws = np.empty((0, 0), dtype=np.int64)
        self._slots: Slots | None = None
        self._drawer_orders: dict[int, FrameOrder] = {}
        self._chunks: dict[int, np.ndarray] = {}

    def _drawer_order(self, drawer: int) -> FrameOrder:
        """The frame order of rank ``drawer``'s stream (its share of any leftover)."""
        if drawer == self.rank:
            return self.order
        order = self._drawer_orders.get(drawer)
        if order is None:
            share = None if self._full is None else share_of(self._full, drawer,
                                                             self.plan.world_size)
            order = self._drawer_orders[drawer] = self.plan.frame_order(drawer, share)
        return order

    def _enter_window(self, window: int) -> None:
        """Make window ``window``'s plan: the counters at its start, its draws, this rank's
        slots. The next window advances the counters by the draws; any other replays them."""
        seed, k, world = self.plan.seed, self.plan.balance_window, self.plan.world_size
        cdf, generation = self.plan.cdf, self.generation
        if self._window_start is not None and window == self._window + 1:
            next_start_counts(self._window_start, self._window_draws, out=self._window_start)
        else:
            self._window_start = window_start_counts(seed, window, k, world, cdf, generation)
        first, last = window * k // STREAM_CHUNK, ((window + 1) * k - 1) // STREAM_CHUNK
        self._chunks = {c: d for c, d in self._chunks.items() if c >= first}
        for c in range(first, last + 1):
            if c not in self._chunks:
                self._chunks[c] = chunk_draws(seed, c, world, cdf, generation)
        draws = window_draws(seed, window, k, world, cdf, generation, self._chunks)
        src = arrange(draws, self.plan.balance_costs, seed, window, generation)
        self._slots = rank_slots(label(draws, src, self._window_start), self.rank)
        self._window, self._window_draws = window, draws

    def _balanced_key(self, step: int) -> BatchKey:
        window, position = divmod(step, self.plan.balance_window)
        if window != self._window:
            self._enter_window(window)
        slots = self._slots
        drawer, sid = int(slots.drawer[position]), int(slots.sid[position])
        occ = int(slots.occurrence[position])
        return BatchKey(sid, self._drawer_order(drawer).fids(sid, occ), step, drawer)

    @property
    def same_system_across_ranks(self) -> bool:
        return self.plan.same_system_across_ranks

    @property
    def adopt_seed(self) -> bool:
        """The seed was not chosen by the user: a loaded state's seed is adopted."""
        return not self.plan.seed_given

    @property
    def _identity(self) -> dict[str, int]:
        """What a state must share with this sampler to belong to the same job."""
        self._follow()
        return {"seed": self.plan.seed, **self._job}

    def _follow(self) -> None:
        """Read the owner's plan again if a loaded state changed its seed (into the loader set
        or into this sampler): the stream then starts again under that seed."""
        base = self._owner.plan
        if base is self._base:
            return
        reseeded = base.seed != self._base.seed
        self._base, self.plan = base, base.with_rule(self.rule)
        if reseeded:
            self.order = self.plan.frame_order(self.rank)
            self._history, self._full = (), None
            self._step, self._chunk_id = 0, -1
            self._counts[:] = 0
            self._reset_balance()

    # -- the stream ----------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Keys handed out so far in this generation (the step of the next key)."""
        self._follow()
        return self._step

    @property
    def generation(self) -> int:
        """How many times the job changed its number of ranks (0: never)."""
        return len(self._history)

    def _stream_args(self) -> tuple[int, int]:
        return self.order.seed, self.order.rank

    def _draw(self, step: int) -> int:
        c = step // STREAM_CHUNK
        if c != self._chunk_id:
            self._chunk = stream_chunk(*self._stream_args(), c, self.plan.cdf,
                                       self.same_system_across_ranks, self.generation)
            self._chunk_id = c
        return int(self._chunk[step - c * STREAM_CHUNK])

    def next_key(self) -> BatchKey:
        """Hand out the next key and advance the stream."""
        if self._owner.plan is not self._base:
            self._follow()
        step = self._step
        if self.plan.balance_window:
            self._step = step + 1
            return self._balanced_key(step)
        sid = self._draw(step)
        occ = int(self._counts[sid])
        self._counts[sid] = occ + 1
        self._step = step + 1
        return BatchKey(sid, self.order.fids(sid, occ), step, self.rank)

    def __iter__(self) -> EpochIterator:
        """The rest of the current epoch: steps up to the next multiple of ``num_samples``.

        From a fresh or epoch-aligned position that is ``num_samples`` keys; after a resume in
        the middle of an epoch it is the rest of that epoch, as torchdata's loaders do.
        """
        return EpochIterator(self)

    def epoch_end(self) -> int:
        """The step at which the current epoch (one ``iter()``) ends."""
        self._follow()
        return (self._step // self.num_samples + 1) * self.num_samples

    def __len__(self) -> int:
        return self.num_samples

    def seek(self, step: int) -> None:
        """Move the stream to ``step`` (forward or back) by replaying only the difference."""
        step = int(step)
        if step < 0:
            raise StateDictError(f"cannot seek to a negative step ({step})")
        self._follow()
        if self.plan.balance_window:   # the window's counters are replayed when it is entered
            if step // self.plan.balance_window != self._window:
                self._window, self._window_start = -1, None
            self._step = step
            return
        lo, hi = sorted((self._step, step))
        delta = stream_counts(*self._stream_args(), lo, hi, self.plan.cdf,
                              self.same_system_across_ranks, self.generation)
        self._counts += delta if step >= self._step else -delta
        self._step = step

    # -- state -----------------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """This rank's state (:mod:`mdloader.sampling.elastic`); ``consumed`` overrides the
        position (see the module doc)."""
        self._follow()
        steps = self._step if consumed is None else int(consumed)
        if steps < 0:
            raise StateDictError(f"consumed must be >= 0, got {steps}")
        return {"version": STATE_VERSION, **self._identity, **self._balance_identity,
                "history": generation_rows(self._history), "rank": self.order.rank,
                "world_size": self.order.world_size, "steps": steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from this rank's state, or from the job state of every rank merged
        (:func:`~mdloader.sampling.elastic.merge_rank_states`), saved on any number of
        ranks; another job's state is rejected quoting both values."""
        merged = isinstance(state, Mapping) and "generations" in state
        balanced = isinstance(state, Mapping) and "balance_window" in state
        check_keys(state, kind="sampler", version=STATE_VERSION,
                   keys=(*(JOB_KEYS if merged else RANK_KEYS),
                         *(BALANCE_IDENTITY if balanced else ())))
        # Checks come first: the plan under the saved seed is only looked at here (a refused
        # seed raises), and put in force once every other check passed.
        seed = self._owner.plan.adopt_seed(state["seed"], "sampler").seed
        for key, words in IDENTITY.items():
            mine = seed if key == "seed" else self._identity[key]
            check_same("sampler", words, int(state[key]), mine, self._hint(key))
        mine_balance = self._balance_identity
        for key, words in BALANCE_IDENTITY.items():
            check_same("sampler", words, state.get(key, 0), mine_balance.get(key, 0),
                       " (training_data.balance_window, balance_cost)")
        rank, world = self.order.rank, self.order.world_size
        if merged:
            history, steps = resume_point(parse_generations(state["generations"]), rank, world)
        else:
            check_same("sampler", "world size", int(state["world_size"]), world,
                       "; to resume on another number of ranks, load the state of every rank "
                       "merged with mdloader.merge_rank_states")
            check_same("sampler", "rank", int(state["rank"]), rank)
            history, steps = parse_generations(state["history"]), int(state["steps"])
        if balanced:
            uneven = [g.steps for g in history if len(set(g.steps)) > 1]
            if uneven:
                raise StateDictError(f"cannot resume the sampler on {world} rank(s): a balanced "
                                     f"job changes its number of ranks only from a state where "
                                     f"every rank took the same number of steps, got steps "
                                     f"{list(uneven[0])}")
        self._owner.adopt_seed(state["seed"], "sampler")  # the loader set's seed too
        self._follow()
        self._set_history(history)
        self.seek(steps)

    def _hint(self, key: str) -> str:
        """What stands behind a digest that differs, in words."""
        if key == "type_map_digest":
            return f" (this loader's type_map is {self._type_map})"
        if key == "probs_digest":
            return f" (this loader's probabilities: {self.rule.describe()})"
        return ""

    def _set_history(self, history: tuple[Generation, ...]) -> None:
        """Enter the generation after ``history``: recompute where every system continues."""
        if history == self._history:
            return
        started = time.perf_counter()
        world = self.plan.world_size
        full = full_continuation(JobSampling(self.plan), history)
        cont = None if full is None else share_of(full, self.rank, world)
        # only balanced steps read other ranks' shares; otherwise keep this rank's 1/W alone
        self._full = full if self.plan.balance_window else None
        self.order = self.plan.frame_order(self.rank, continuation=cont)
        self._history = history
        self._step, self._chunk_id = 0, -1
        self._counts[:] = 0
        self._reset_balance()
        if cont is not None:
            log.info("sampler: generation %d on %d rank(s) after %s; this rank first serves %d "
                     "leftover frame(s) (computed in %.2f s)", len(history), world,
                     " -> ".join(f"{g.world_size} rank(s)" for g in history), len(cont.frames),
                     time.perf_counter() - started)


class EpochIterator(Iterator[BatchKey]):
    """The keys of one epoch of a :class:`WeightedSystemSampler`, with a state of its own.

    Its state is the sampler's position when it is asked, plus where the epoch ends, so
    ``torchdata.stateful_dataloader.StatefulDataLoader`` (which saves the iterator's state at
    each delivered batch) resumes exactly, whatever its number of workers.
    """

    def __init__(self, sampler: WeightedSystemSampler) -> None:
        self.sampler = sampler
        self.stop = sampler.epoch_end()

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> BatchKey:
        if self.sampler.position >= self.stop:
            raise StopIteration
        return self.sampler.next_key()

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "sampler": self.sampler.state_dict(), "stop": self.stop}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_keys(state, kind="sampler iterator", version=STATE_VERSION,
                   keys=("sampler", "stop"))
        self.sampler.load_state_dict(state["sampler"])
        self.stop = int(state["stop"])
