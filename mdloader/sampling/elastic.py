"""Elastic resume (pure): where each system continues when a job resumes on another number of ranks.

A job's sampling is a list of *generations*: generation ``g`` ran on ``W_g`` ranks and rank ``r``
took ``k_{g,r}`` batches from its system stream (keys that hold ``g``:
:func:`mdloader.sampling.order.stream_key`). Nothing else is saved: replaying the streams gives how
many batches every rank took from every system, hence where each rank stood in its passes.

A *unit* is what one rank serves in one go for one system: its shard of one pass, or its share of
the generation's leftover. When generation ``g + 1`` starts on ``W'`` ranks, every system continues
with

1. its *leftover*: the frames generation ``g`` left unserved in its interrupted units -- first
   what remains of generation ``g``'s own leftover, then the rest of every old rank's current pass
   shard (by pass, then rank) without the shard's wrap-around padding -- shared by the new ranks
   strided (rank ``r'`` takes items ``r', r' + W', ...``, no padding); then
2. fresh passes numbered from one past the highest pass any old rank started, sharded over ``W'``
   exactly as a job that always ran on ``W'`` ranks shards them.

So within an interrupted unit no frame that was served is served again and none that was not is
lost. A pass that a lagging old rank had not started is not carried over: the fresh passes take
its place. Generation 0 has no leftover and starts at pass 0, which is the job as it runs before
any elastic resume.

The sampler's saved state is one rank's or the whole job's. A **rank state**
(``WeightedSystemSampler.state_dict()``) holds what identifies the job (seed, system sizes,
probability rule, type map, flags), the finished generations of the job (``history``: one row
``[W, k_0, ..., k_{W-1}]`` per generation) and this rank's place in the current one (``rank``,
``world_size``, ``steps``). A **job state** (:func:`merge_rank_states`) holds the same identity
and ``generations``: the history plus the current generation's row. Either grows by ``W + 1``
integers per elastic resume, never with the number of steps or of systems.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from mdloader.errors import StateDictError
from mdloader.sampling.balance import Strata, strata_counts
from mdloader.sampling.batching import batches_per_rank
from mdloader.sampling.order import Continuation, frame_permutation, stream_counts
from mdloader.sampling.plan import LoaderPlan

SYSTEM_BLOCK = 4096
"""Systems processed together, so temporaries stay a few MB whatever the number of systems."""


@dataclass(frozen=True)
class Generation:
    """A stretch of the job on ``world_size`` ranks; ``steps[r]``: batches rank ``r`` took."""

    world_size: int
    steps: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return not any(self.steps)


def job_seed(plan: LoaderPlan) -> int:
    """The job seed every replay of ``plan`` draws from (an elastic resume needs one)."""
    if plan.seed is None:
        raise StateDictError("an elastic resume needs the job seed; this plan has none")
    return plan.seed


def empty_continuation(nsys: int) -> Continuation:
    """No leftover, every system at pass 0: where a job starts."""
    return Continuation(np.zeros(nsys + 1, dtype=np.int64), np.empty(0, dtype=np.int64),
                        np.zeros(nsys, dtype=np.int64))


def _segments(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a concatenation of segments of ``lengths``: each item's segment and index in it."""
    segment = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(lengths) else lengths
    return segment, np.arange(int(lengths.sum())) - np.repeat(starts, lengths)


def share_of(full: Continuation, rank: int, world_size: int) -> Continuation:
    """Rank ``rank``'s share of every leftover list: items ``rank, rank + W, ...`` (no padding)."""
    segment, index = _segments(np.diff(full.offsets))
    keep = index % world_size == rank
    lengths = np.bincount(segment[keep], minlength=len(full.base_pass))
    return Continuation(np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
                        full.frames[keep], full.base_pass)


def replay_counts(plan: LoaderPlan, index: int, gen: Generation) -> np.ndarray:
    """Batches each rank of generation ``index`` took from each system: ``[nsys, W]``."""
    cdf = plan.cdf_on(gen.world_size)
    dtype = np.int32 if max(gen.steps, default=0) < 2**31 else np.int64
    counts = np.empty((len(cdf), gen.world_size), dtype=dtype)
    done: dict[int, np.ndarray] = {}   # shared stream: ranks with equal steps share a replay
    for rank, steps in enumerate(gen.steps):
        if plan.same_system_across_ranks and steps in done:
            counts[:, rank] = done[steps]
            continue
        column = stream_counts(job_seed(plan), rank, 0, steps, cdf, plan.same_system_across_ranks,
                               generation=index)
        counts[:, rank] = column
        done[steps] = column
    return counts


def generation_counts(plan: LoaderPlan, index: int, gen: Generation) -> np.ndarray:
    """Batches each rank of generation ``index`` took from each system: ``[nsys, W]``.

    Each rank's own draws, from its unbalanced (:func:`replay_counts`) or balanced
    (:func:`mdloader.sampling.balance.strata_counts`) stream: either way a rank reads its own
    frames.
    """
    if not plan.balance_window:
        return replay_counts(plan, index, gen)
    strata = Strata.of(plan.cdf_on(gen.world_size), plan.balance_costs)
    return np.stack([strata_counts(job_seed(plan), rank, 0, steps, strata, plan.balance_window,
                                   generation=index)
                     for rank, steps in enumerate(gen.steps)], axis=1)


def advance(plan: LoaderPlan, full: Continuation, gen: Generation,
            counts: np.ndarray) -> Continuation:
    """The whole job's continuation after generation ``gen`` took ``counts`` batches."""
    nsys = plan.nsys
    lengths, frames, base = [], [], []
    for lo in range(0, nsys, SYSTEM_BLOCK):
        hi = min(nsys, lo + SYSTEM_BLOCK)
        n, f, b = _advance_block(plan, full, gen.world_size, counts[lo:hi].astype(np.int64), lo)
        lengths.append(n)
        frames.append(f)
        base.append(b)
    offsets = np.concatenate(([0], np.cumsum(np.concatenate(lengths)))).astype(np.int64)
    return Continuation(offsets, np.concatenate(frames).astype(np.int64), np.concatenate(base))


class _Positions(NamedTuple):
    """Where every old rank stood in each system of a block (arrays ``[systems, W]``)."""

    served_share: np.ndarray   # items of its leftover share it served
    pass_: np.ndarray          # its current fresh pass
    into: np.ndarray           # batches it served of that pass
    base: np.ndarray           # ``[systems]``: the next generation's first fresh pass


def _positions(plan: LoaderPlan, full: Continuation, world: int, counts: np.ndarray,
               lo: int) -> _Positions:
    """Split each old rank's batches of each system into leftover batches and passes."""
    hi = lo + len(counts)
    size = plan.batch_sizes[lo:hi, None]
    lens = np.diff(full.offsets[lo:hi + 1])
    share_len = np.maximum(0, -(-(lens[:, None] - np.arange(world)) // world))
    from_share = np.minimum(counts, -(-share_len // size))
    fresh = counts - from_share
    nb = batches_per_rank(plan.nframes[lo:hi], plan.batch_sizes[lo:hi], world)[:, None]
    pass_ = full.base_pass[lo:hi, None] + fresh // nb
    into = fresh % nb
    started = np.where(fresh > 0, pass_ - (into == 0), -1).max(axis=1)
    return _Positions(np.minimum(from_share * size, share_len), pass_, into,
                      np.maximum(full.base_pass[lo:hi], started + 1))


def _advance_block(plan: LoaderPlan, full: Continuation, world: int, counts: np.ndarray,
                   lo: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`advance` for systems ``[lo, lo + len(counts))``: lengths, frames, base passes.

    Each system's new leftover is the unserved part of its old leftover, then the rests of its
    interrupted units.
    """
    at = _positions(plan, full, world, counts, lo)
    lens = np.diff(full.offsets[lo:lo + len(counts) + 1])
    segment, index = _segments(lens)
    block = full.frames[full.offsets[lo]:full.offsets[lo + len(counts)]]
    keep = index // world >= at.served_share[segment, index % world]
    kept_len = np.bincount(segment[keep], minlength=len(counts))
    rests = {s: _unit_rests(plan, lo + s, world, at.pass_[s], at.into[s])
             for s in np.flatnonzero((at.into > 0).any(axis=1))}
    new_len = kept_len.copy()
    for s, rest in rests.items():
        new_len[s] += len(rest)
    new_start = np.concatenate(([0], np.cumsum(new_len)[:-1])).astype(np.int64)
    out = np.empty(int(new_len.sum()), dtype=np.int64)
    kept_segment, kept_index = _segments(kept_len)
    out[new_start[kept_segment] + kept_index] = block[keep]
    for s, rest in rests.items():
        out[new_start[s] + kept_len[s]:new_start[s] + new_len[s]] = rest
    return new_len, out, at.base


def _unit_rests(plan: LoaderPlan, sid: int, world: int, passes: np.ndarray,
                into: np.ndarray) -> np.ndarray:
    """What the old ranks left of their current pass shards of ``sid``: by pass, then rank.

    Rank ``r`` took ``into[r]`` batches of its shard of pass ``passes[r]``: the positions
    ``r, r + W, ...`` of the pass's permutation, padded by wrapping. The rest is one slice of the
    permutation, which stops at the last frame and so leaves out the padding (always in the
    shard's last slot).
    """
    nframes, size = int(plan.nframes[sid]), int(plan.batch_sizes[sid])
    ranks = np.flatnonzero(into > 0)
    ranks = ranks[np.argsort(passes[ranks], kind="stable")]
    parts, perm, perm_pass = [], None, None
    for rank in ranks.tolist():
        p = int(passes[rank])
        if p != perm_pass:
            perm, perm_pass = frame_permutation(job_seed(plan), sid, p, nframes, plan.shuffle), p
        parts.append(perm[rank + world * int(into[rank]) * size:nframes:world])
    return np.concatenate(parts)


def continuation(plan: LoaderPlan, history: Sequence[Generation], rank: int,
                 world_size: int) -> Continuation | None:
    """Where rank ``rank`` of ``world_size`` continues after the finished generations ``history``.

    ``None`` without history: the job has never changed its number of ranks.
    """
    full = full_continuation(plan, history)
    return None if full is None else share_of(full, rank, world_size)


def full_continuation(plan: LoaderPlan, history: Sequence[Generation]) -> Continuation | None:
    """The whole job's continuation after ``history`` (None without history); each rank's is
    :func:`share_of` it (a balanced sampler takes the share of every rank it reads for)."""
    if not history:
        return None
    full = empty_continuation(plan.nsys)
    for index, gen in enumerate(history):
        full = advance(plan, full, gen, generation_counts(plan, index, gen))
    return full


IDENTITY = {"seed": "seed", "nsys": "number of systems",
            "sizes_digest": "system sizes/batch sizes digest",
            "probs_digest": "system probabilities digest",
            "type_map_digest": "type_map digest", "shuffle": "shuffle",
            "same_system_across_ranks": "same_system_across_ranks"}
"""Keys that must be equal for a state to belong to this job, with the words errors use."""
BALANCE_IDENTITY = {"balance_window": "balance window",
                    "balance_cost_digest": "balance cost digest"}
"""Identity keys a balanced sampler's state adds (absent: balancing off), so a state of another
window or cost model is refused while an unbalanced state keeps its layout."""
RANK_KEYS = (*IDENTITY, "history", "rank", "world_size", "steps")
JOB_KEYS = (*IDENTITY, "generations")


def _count(value: Any, what: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise StateDictError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def parse_generations(rows: Any) -> tuple[Generation, ...]:
    """Generations from saved rows ``[W, k_0, ..., k_{W-1}]``, each checked."""
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)):
        raise StateDictError(f"generations must be a list of rows, got {type(rows).__name__}")
    gens = []
    for i, row in enumerate(rows):
        if not isinstance(row, Sequence) or not row:
            raise StateDictError(f"generation {i} must be a row [W, k_0, ..., k_W-1], got {row!r}")
        world = _count(row[0], f"the world size of generation {i}")
        if world < 1 or len(row) != world + 1:
            raise StateDictError(f"generation {i} ran on {row[0]} rank(s) but lists "
                                 f"{len(row) - 1} step count(s)")
        gens.append(Generation(world, tuple(_count(k, f"a step count of generation {i}")
                                            for k in row[1:])))
    return tuple(gens)


def generation_rows(gens: Sequence[Generation]) -> list[list[int]]:
    """The generations as rows of ``[world_size, *steps]``, as a sampler state stores them."""
    return [[g.world_size, *g.steps] for g in gens]


def resume_point(gens: Sequence[Generation], rank: int,
                 world_size: int) -> tuple[tuple[Generation, ...], int]:
    """Where rank ``rank`` of ``world_size`` resumes a job: (finished generations, steps).

    Trailing generations that took no step are dropped first. On the world size of the last
    generation the rank continues it exactly; on another one a new generation starts at step 0.
    """
    kept = list(gens)
    while kept and kept[-1].empty:
        kept.pop()
    if kept and kept[-1].world_size == world_size:
        return tuple(kept[:-1]), kept[-1].steps[rank]
    return tuple(kept), 0


def merge_rank_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The job state from every rank's state (sampler, ``StatefulLoader`` or
    ``BroadcastingDataLoader`` states, rank order free; a ``BroadcastingDataLoader``'s
    non-source ranks hold no source state, which is skipped).

    Load it on any number of ranks: the same number continues every rank exactly, another one
    resumes elastically (:mod:`mdloader.sampling.elastic`).
    """
    present = [s for s in states if s]
    if not present:
        raise StateDictError("no rank state to merge")
    for inner in ("source", "sampler"):  # a BroadcastingDataLoader's, a StatefulLoader's
        if all(inner in s and "history" not in s for s in present):
            versions = {s.get("version") for s in present}
            if len(versions) != 1:
                raise StateDictError(f"the loader states have different versions "
                                     f"{sorted(versions)}")
            return {"version": versions.pop(), inner: merge_rank_states(
                [s[inner] for s in present if s[inner] is not None])}
    for s in present:
        if "history" not in s:
            raise StateDictError(f"not a rank state of a sampler (keys {sorted(s)}); a state "
                                 "that was merged already can be loaded as it is")
    first = present[0]
    world = _count(first["world_size"], "world_size")
    steps: list[int | None] = [None] * world
    for s in present:
        for key, label in {**IDENTITY, **BALANCE_IDENTITY, "version": "version",
                           "history": "history", "world_size": "world size"}.items():
            if s.get(key) != first.get(key):
                raise StateDictError(f"these states are not from one job: rank {s.get('rank')} "
                                     f"has {label} {s.get(key)} but rank {first.get('rank')} "
                                     f"has {first.get(key)}")
        rank = _count(s["rank"], "rank")
        if rank >= world or steps[rank] is not None:
            raise StateDictError(f"rank {rank} appears twice or outside a world of {world}")
        steps[rank] = _count(s["steps"], "steps")
    missing = [r for r, k in enumerate(steps) if k is None]
    if missing:
        raise StateDictError(f"the states of ranks {missing} of {world} are missing: merge the "
                             "state of every rank")
    return {"version": first["version"], **{k: first[k] for k in IDENTITY},
            **{k: first[k] for k in BALANCE_IDENTITY if k in first},
            "generations": [*first["history"], [world, *steps]]}


__all__ = ["Generation", "job_seed", "empty_continuation", "share_of", "replay_counts",
           "generation_counts", "advance", "continuation", "full_continuation",
           "IDENTITY", "BALANCE_IDENTITY", "RANK_KEYS", "JOB_KEYS", "parse_generations",
           "generation_rows", "resume_point", "merge_rank_states"]
