"""The key source of a ``mix:N`` stream: the batches of DeePMD-kit 3.2's LMDB sampler, pass
after pass, as one endless stream of keys a feed's pool reads (``next_key``), with mdloader's
resume on top.

A key is the tuple of the database indices of one batch (:mod:`mdloader.sampling.lmdb_batches`
cuts them). Pass ``e`` is drawn from ``seed + e`` (a new order every pass, the same on every
rank); a rank reads its padded strided share of it (:func:`~mdloader.sampling.lmdb_batches.
rank_batches`, DeePMD-kit's split), one batch a step, then the next pass. Every rank takes the
same number of steps, so the position of a job in a pass is one integer, the global batches
read (:func:`rest_of_pass` splits the rest): a state (:meth:`MixedBatchSampler.state_dict`)
holds the pass and that integer, and a job restored on any number of ranks reads exactly the
rest of the pass, then the next passes as an uninterrupted job would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling import lmdb_batches as lb
from mdloader.state import check_keys, check_same

STATE_VERSION = 1
KIND = "lmdb-mix"
IDENTITY = ("seed", "rule", "nframes", "ragged", "shuffle")
RANK_KEYS = ("kind", *IDENTITY, "epoch", "consumed", "rank", "world_size", "steps")
JOB_KEYS = ("kind", *IDENTITY, "epoch", "consumed")


class MixedBatchSampler:
    """Rank ``rank``'s keys of a ``mix:N`` stream over frames of atom counts ``nlocs``.

    Parameters
    ----------
    nlocs
        Atoms of every frame of the database (dataset indices).
    rule
        The parsed ``batch_size`` (``mix:N``; any LMDB rule is cut the same way).
    seed
        The stream's seed: pass ``e`` is drawn from ``default_rng(seed + e)``.
    rank, world_size
        This rank and the number of ranks.
    ragged
        Concatenated frames (the atom axis is the sum of the atoms) instead of padded ones.
    shuffle
        Shuffle each pass (DeePMD-kit's trainer always does).
    groups
        The frames a batch may be drawn from together (default: every frame the rule keeps;
        DeePMD-kit's reader also splits them by which optional labels they hold).

    Examples
    --------
    >>> import numpy as np
    >>> from mdloader.sampling.lmdb_batches import parse_lmdb_rule
    >>> sampler = MixedBatchSampler(np.array([3, 3, 5, 2]), parse_lmdb_rule("mix:6"), seed=1,
    ...                             rank=0, world_size=1)
    >>> first = [sampler.next_key() for _ in range(sampler.steps_in_pass(0))]
    >>> sorted(i for key in first for i in key)          # one pass: every frame once
    [0, 1, 2, 3]
    """

    def __init__(self, nlocs: Sequence[int] | np.ndarray, rule: lb.LmdbRule, *, seed: int,
                 rank: int, world_size: int, ragged: bool = False, shuffle: bool = True,
                 groups: Sequence[np.ndarray] | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
        self.nlocs = np.asarray(nlocs, dtype=np.int64)
        self.rule, self.seed = rule, int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.ragged, self.shuffle = bool(ragged), bool(shuffle)
        self._kept = lb.kept_frames(rule, self.nlocs)
        self._groups = (lb.batch_groups(rule, self.nlocs, self._kept) if groups is None
                        else [np.asarray(g, dtype=np.int64) for g in groups])
        self._passes: dict[int, list[list[int]]] = {}
        self._lengths: dict[int, int] = {}
        self._epoch0, self._start0 = 0, 0  # where this generation began
        self._step = 0  # keys handed out in this generation
        self._cursor = (0, 0, 0)  # a pass, its start, and the generation step it starts at
        self._share: tuple[int, int, list[list[int]]] = (-1, -1, [])  # this rank's of a pass
        self.weights: Any = None
        """What a trainer's summary prints per system; the draw does not read it."""

    def with_seed(self, seed: int) -> MixedBatchSampler:
        """The same stream of this rank under another seed, from its start."""
        return MixedBatchSampler(self.nlocs, self.rule, seed=seed, rank=self.rank,
                                 world_size=self.world_size, ragged=self.ragged,
                                 shuffle=self.shuffle, groups=self._groups)

    # -- passes ---------------------------------------------------------------------------
    def pass_batches(self, epoch: int) -> list[list[int]]:
        """The global batches of pass ``epoch`` (the two latest are kept)."""
        batches = self._passes.get(epoch)
        if batches is None:
            batches = lb.pass_batches(self.rule, self.nlocs, self._groups, seed=self.seed,
                                      epoch=epoch, shuffle=self.shuffle, ragged=self.ragged)
            if not batches:
                raise ConfigError(f"batch_size {self.rule}: no frame to read")
            for old in [e for e in self._passes if e < epoch - 1]:
                del self._passes[old]
            self._passes[epoch] = batches
            self._lengths[epoch] = len(batches)
        return batches

    def _length(self, epoch: int) -> int:
        if epoch not in self._lengths:
            self.pass_batches(epoch)
        return self._lengths[epoch]

    def steps_in_pass(self, epoch: int, start: int = 0) -> int:
        """Steps every rank takes to read pass ``epoch`` from global batch ``start``."""
        return -(-(self._length(epoch) - start) // self.world_size)

    def _locate(self, step: int) -> tuple[int, int, int]:
        """(pass, global batches read of it before this rank's segment of it, steps into that
        segment) of the ``step``-th key of this generation."""
        epoch, start, first = self._cursor
        if step < first:
            epoch, start, first = self._epoch0, self._start0, 0
        while True:
            steps = self.steps_in_pass(epoch, start)
            if step < first + steps:
                self._cursor = (epoch, start, first)
                return epoch, start, step - first
            first += steps
            epoch, start = epoch + 1, 0

    # -- the stream -----------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Keys handed out so far in this generation (the step of the next key)."""
        return self._step

    def next_key(self) -> tuple[int, ...]:
        """The next batch of this rank: the database indices of its frames."""
        epoch, start, step = self._locate(self._step)
        if self._share[:2] != (epoch, start):
            self._share = (epoch, start, rest_of_pass(self.pass_batches(epoch), start,
                                                      self.rank, self.world_size))
        share = self._share[2]
        self._step += 1
        return tuple(int(i) for i in share[step])

    def seek(self, step: int) -> None:
        """Hand out the ``step``-th key of this generation next."""
        if int(step) < 0:
            raise StateDictError(f"cannot seek to a negative step ({step})")
        self._step = int(step)

    # -- state ----------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {"seed": self.seed, "rule": str(self.rule), "nframes": int(len(self.nlocs)),
                "ragged": self.ragged, "shuffle": self.shuffle}

    def job_position(self, consumed: int) -> tuple[int, int]:
        """(pass, global batches read of it) once every rank took ``consumed`` steps of this
        generation; a pass read to its end is the next pass at 0."""
        epoch, start, step = self._locate(int(consumed))
        return epoch, min(start + step * self.world_size, self._length(epoch))

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The state of this rank after ``consumed`` keys of this generation (default: the keys
        handed out; a feed passes the batches its trainer took, since workers read ahead)."""
        steps = self._step if consumed is None else int(consumed)
        if steps < 0:
            raise StateDictError(f"consumed must be >= 0, got {steps}")
        epoch, read = self.job_position(steps)
        return {"version": STATE_VERSION, "kind": KIND, **self._identity(), "epoch": epoch,
                "consumed": read, "rank": self.rank, "world_size": self.world_size,
                "steps": steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from this rank's state, or the job's (:func:`merge_mixed_states`) saved on
        any number of ranks; another stream's state is refused quoting both values."""
        merged = isinstance(state, Mapping) and "rank" not in state
        check_keys(state, kind="mix:N sampler", version=STATE_VERSION,
                   keys=JOB_KEYS if merged else RANK_KEYS)
        check_same("mix:N sampler", "kind", state["kind"], KIND)
        for key, mine in self._identity().items():
            check_same("mix:N sampler", key, state[key], mine)
        if not merged:
            check_same("mix:N sampler", "world size", int(state["world_size"]), self.world_size,
                       "; to resume on another number of ranks, load the state of every rank "
                       "merged (mdloader.merge_rank_states)")
            check_same("mix:N sampler", "rank", int(state["rank"]), self.rank)
        epoch, read = int(state["epoch"]), int(state["consumed"])
        if epoch < 0 or not 0 <= read <= len(self.pass_batches(epoch)):
            raise StateDictError(f"the saved mix:N position (pass {epoch}, {read} batches) is "
                                 f"outside the pass of {len(self.pass_batches(epoch))} batches")
        if read == len(self.pass_batches(epoch)):
            epoch, read = epoch + 1, 0
        self._epoch0, self._start0, self._step = epoch, read, 0
        self._cursor = (epoch, read, 0)


def rest_of_pass(batches: Sequence[list[int]], start: int, rank: int,
                 world_size: int) -> list[list[int]]:
    """Rank ``rank``'s share of a pass whose first ``start`` global batches were read: the rest,
    padded to a multiple of ``world_size`` with the pass's first batches, strided. From
    ``start`` = 0 it is DeePMD-kit's split (:func:`~mdloader.sampling.lmdb_batches.rank_batches`);
    padding from the pass's start (not the rest's) makes a restart on the same ranks train the
    padded tail an uninterrupted run trains."""
    rest = list(batches[start:])
    pad = -len(rest) % world_size
    padded = rest + [batches[i % len(batches)] for i in range(pad)]
    return padded[rank::world_size]


def is_mixed_rule(batch_size: Any) -> bool:
    """Whether a data section's ``batch_size`` is DeePMD-kit 3.2's ``mix:N``."""
    return isinstance(batch_size, str) and batch_size.strip().partition(":")[0].strip() == "mix"


def check_mixed_rule(batch_size: str, key: str) -> lb.LmdbRule:
    """``mix:N`` parsed, or refused in one line naming ``key`` (its JSON path)."""
    try:
        return lb.parse_lmdb_rule(batch_size.strip())
    except ValueError as exc:
        raise ConfigError(str(exc), path=key) from None


def is_mixed_state(state: Any) -> bool:
    """Whether ``state`` is a state of a :class:`MixedBatchSampler`."""
    return isinstance(state, Mapping) and state.get("kind") == KIND


def merge_mixed_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The job state of a ``mix:N`` stream from every rank's state: they must agree on the
    stream and its position (every rank takes one key a step)."""
    if not states:
        raise StateDictError("no rank state to merge")
    first = states[0]
    world = int(first["world_size"])
    ranks = sorted(int(s["rank"]) for s in states)
    if ranks != list(range(world)):
        raise StateDictError(f"the mix:N states hold ranks {ranks} of a world of {world}: "
                             "merge the state of every rank")
    for s in states:
        for key in ("version", "kind", *IDENTITY, "epoch", "consumed", "world_size"):
            if s[key] != first[key]:
                raise StateDictError(f"these mix:N states are not from one step of one job: "
                                     f"rank {s['rank']} has {key} {s[key]} but rank "
                                     f"{first['rank']} has {first[key]}")
    return {k: first[k] for k in ("version", *JOB_KEYS)}


__all__ = ["KIND", "MixedBatchSampler", "STATE_VERSION", "check_mixed_rule", "is_mixed_rule",
           "is_mixed_state", "merge_mixed_states", "rest_of_pass"]
