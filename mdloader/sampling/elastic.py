"""Elastic resume (pure): where each system continues when a job resumes on another number of ranks.

A job's sampling is a list of *generations*: generation ``g`` ran on ``W_g`` ranks and rank ``r``
took ``k_{g,r}`` batches from its system stream (keys that hold ``g``:
:func:`mdloader.sampling.order.stream_key`). Nothing else is saved: replaying the streams gives how
many batches every rank took from every system, hence where each rank stood in its passes.

When generation ``g + 1`` starts on ``W'`` ranks, new rank ``r'`` *owns* the old ranks ``d``
with ``d % W' == r'`` (:func:`owned_ranks`; a rank beyond the old world owns none), and every
system continues on it with

1. its *leftover*: for each owned old rank, ascending, what that rank left unserved -- first the
   rest of its own leftover (which it took over the same way from the ranks it owned), then the
   rest of the pass shard it had begun, without the shard's wrap-around padding; then
2. the fresh passes of generation ``g + 1``, numbered from 0 under permutation keys that hold the
   generation (:func:`mdloader.sampling.order.frame_key`), sharded over ``W'`` exactly as a job
   that always ran on ``W'`` ranks shards them.

So within an interrupted unit (a begun shard, or a leftover) no frame that was served is served
again and none that was not is lost. A rank replays only the streams of the old ranks it owns
(and of the ranks they owned, generation by generation): ``O(owned * (steps + N))`` arithmetic and
nothing of size ``N * W``. A leftover is a list of pieces (:data:`mdloader.sampling.order.PIECE`);
its frames are drawn when the rank first draws the system. Generation 0 has no leftover and its
passes keep their keys, which is the job as it runs before any elastic resume.

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
from typing import Any

import numpy as np

from mdloader.errors import StateDictError
from mdloader.sampling.balance import balanced_counts
from mdloader.sampling.batching import batches_per_rank
from mdloader.sampling.order import PIECE, Continuation, real_shard_lengths, stream_counts
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


def owned_ranks(rank: int, world_size: int, old_world: int) -> range:
    """The old ranks (of ``old_world``) whose leftover rank ``rank`` of ``world_size`` takes
    over: those ``d`` with ``d % world_size == rank`` (none for a rank beyond the old world)."""
    return range(rank, old_world, world_size)


def rank_counts(plan: LoaderPlan, index: int, gen: Generation, rank: int,
                cdf: np.ndarray | None = None) -> np.ndarray:
    """Batches rank ``rank`` of generation ``index`` took from each system: ``[nsys]``, from a
    replay of its own system stream alone (unbalanced or balanced: a rank reads its own frames);
    ``cdf``: ``plan.cdf_on(gen.world_size)`` when the caller has it already."""
    cdf = plan.cdf_on(gen.world_size) if cdf is None else cdf
    if plan.balance_window:
        return balanced_counts(job_seed(plan), rank, 0, gen.steps[rank], cdf, plan.balance_costs,
                               plan.balance_window, generation=index)
    return stream_counts(job_seed(plan), rank, 0, gen.steps[rank], cdf,
                         plan.same_system_across_ranks, generation=index)


def left_pieces(plan: LoaderPlan, index: int, gen: Generation, rank: int,
                before: Continuation | None, counts: np.ndarray) -> np.ndarray:
    """The pieces old rank ``rank`` of generation ``index`` left after taking ``counts`` batches
    of each system: the unserved rest of its own leftover ``before`` (None: it had none), then
    the rest of the pass shard it had begun, without the wrap-around padding (arithmetic only;
    pieces sorted by system)."""
    world, nsys = gen.world_size, plan.nsys
    served = np.zeros(nsys, dtype=np.int64)
    fresh_parts = []
    for lo in range(0, nsys, SYSTEM_BLOCK):
        hi = min(nsys, lo + SYSTEM_BLOCK)
        size, took = plan.batch_sizes[lo:hi], counts[lo:hi].astype(np.int64)
        if before is not None:
            left = before.lengths[lo:hi]
            from_left = np.minimum(took, -(-left // size))
            served[lo:hi] = np.minimum(from_left * size, left)
            took = took - from_left
        nb = batches_per_rank(plan.nframes[lo:hi], size, world)
        sids = np.flatnonzero(took % nb)
        start = (took[sids] % nb[sids]) * size[sids]
        stop = real_shard_lengths(plan.nframes[lo + sids], rank, world)
        begun = start < stop
        sids = sids[begun]
        piece = np.empty(len(sids), dtype=PIECE)
        piece["sid"], piece["start"], piece["stop"] = lo + sids, start[begun], stop[begun]
        piece["generation"], piece["world"], piece["rank"] = index, world, rank
        piece["pass_"] = took[sids] // nb[sids]
        fresh_parts.append(piece)
    rest = np.empty(0, dtype=PIECE) if before is None else before.rest(served)
    pieces = np.concatenate([rest, *fresh_parts])
    return pieces[np.argsort(pieces["sid"], kind="stable")]


def _inherited(plan: LoaderPlan, history: Sequence[Generation], rank: int, world_size: int,
               replays: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    """The pieces rank ``rank`` of generation ``len(history)`` on ``world_size`` ranks takes
    over: those its owned old ranks left, in ascending old rank, each old rank's own leftover
    computed the same way from the ranks it owned (so only the owned ranks are replayed)."""
    if not history:
        return np.empty(0, dtype=PIECE)
    index, gen = len(history) - 1, history[-1]
    parts, cdf = [], None
    for old in owned_ranks(rank, world_size, gen.world_size):
        before = None
        if index:
            before = Continuation.of_pieces(index, plan.nsys, _inherited(
                plan, history[:-1], old, gen.world_size, replays))
        counts = replays.get((index, gen.steps[old]))
        if counts is None:
            cdf = plan.cdf_on(gen.world_size) if cdf is None else cdf
            counts = rank_counts(plan, index, gen, old, cdf)
            if plan.same_system_across_ranks:   # a shared stream: equal steps, equal counts
                replays[index, gen.steps[old]] = counts
        parts.append(left_pieces(plan, index, gen, old, before, counts))
    return np.concatenate(parts) if parts else np.empty(0, dtype=PIECE)


def continuation(plan: LoaderPlan, history: Sequence[Generation], rank: int,
                 world_size: int) -> Continuation | None:
    """Where rank ``rank`` of ``world_size`` continues after the finished generations
    ``history``: the leftover of the old ranks it owns, then the fresh passes of generation
    ``len(history)``. ``None`` without history: the job has never changed its number of ranks.
    """
    if not history:
        return None
    return Continuation.of_pieces(len(history), plan.nsys,
                                  _inherited(plan, history, rank, world_size, {}))


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


__all__ = ["Generation", "job_seed", "owned_ranks", "rank_counts", "left_pieces", "continuation",
           "IDENTITY", "BALANCE_IDENTITY", "RANK_KEYS", "JOB_KEYS", "parse_generations",
           "generation_rows", "resume_point", "merge_rank_states"]
