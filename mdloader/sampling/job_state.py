"""A sampler's saved state: one rank's or the whole job's (every rank merged), and where to resume.

A **rank state** (``WeightedSystemSampler.state_dict()``) holds what identifies the job (seed,
system sizes, probability rule, type map, flags), the finished generations of the job
(``history``: one row ``[W, k_0, ..., k_{W-1}]`` per generation, see
:mod:`mdloader.sampling.elastic`) and this rank's place in the current one (``rank``,
``world_size``, ``steps``). A **job state** (:func:`merge_rank_states`) holds the same identity
and ``generations``: the history plus the current generation's row. Either grows by ``W + 1``
integers per elastic resume, never with the number of steps or of systems.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from mdloader.errors import StateDictError
from mdloader.sampling.elastic import Generation

IDENTITY = {"seed": "seed", "nsys": "number of systems",
            "sizes_digest": "system sizes/batch sizes digest",
            "probs_digest": "system probabilities digest",
            "type_map_digest": "type_map digest", "shuffle": "shuffle",
            "same_system_across_ranks": "same_system_across_ranks"}
"""Keys that must be equal for a state to belong to this job, with the words errors use."""
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
    """The job state from every rank's state (sampler or ``StatefulLoader`` states, rank order
    free; the ``{}`` of a ``BroadcastingDataLoader``'s non-source ranks is skipped).

    Load it on any number of ranks: the same number continues every rank exactly, another one
    resumes elastically (:mod:`mdloader.sampling.elastic`).
    """
    present = [s for s in states if s]
    if not present:
        raise StateDictError("no rank state to merge")
    if all("sampler" in s and "history" not in s for s in present):
        versions = {s.get("version") for s in present}
        if len(versions) != 1:
            raise StateDictError(f"the loader states have different versions {sorted(versions)}")
        return {"version": versions.pop(), "sampler": merge_rank_states(
            [s["sampler"] for s in present])}
    for s in present:
        if "history" not in s:
            raise StateDictError(f"not a rank state of a sampler (keys {sorted(s)}); a state "
                                 "that was merged already can be loaded as it is")
    first = present[0]
    world = _count(first["world_size"], "world_size")
    steps: list[int | None] = [None] * world
    for s in present:
        for key, label in {**IDENTITY, "version": "version", "history": "history",
                           "world_size": "world size"}.items():
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
            "generations": [*first["history"], [world, *steps]]}


__all__ = ["IDENTITY", "RANK_KEYS", "JOB_KEYS", "parse_generations", "generation_rows",
           "resume_point", "merge_rank_states"]
