"""Balanced steps (pure): the same batches as the per-rank streams, dealt so each step is even.

In data-parallel training a step waits for the slowest rank, and a batch costs about its number
of atoms. Window ``w`` of ``k`` steps takes the ``k * W`` batches that the ``W`` independent
per-rank streams draw at steps ``[w * k, (w + 1) * k)`` (:func:`window_draws`, through
:func:`mdloader.sampling.order.stream_draws`), sorts them by cost and cuts the sorted list into
``k`` consecutive chunks of ``W``: one chunk per step, one batch per rank (:func:`arrange`).
Among all ways to split the window into ``k`` steps of ``W`` batches this minimises the sum of
the step maxima, and that sum exceeds the sum of the step means by at most
``max(cost) - min(cost)`` over the window: the chunks do not overlap in cost. The order of the
steps, and which rank of a step takes which batch, are then shuffled from ``(seed, generation,
window)``, so every rank computes the same arrangement without communicating and sizes follow no
schedule.

A slot is ``(drawer, sid, occurrence)``: the batch is the ``occurrence``-th batch of system
``sid`` *in rank ``drawer``'s stream*, so its frames are those ``drawer`` reads
(``FrameOrder(rank=drawer).fids(sid, occurrence)``) and every pass is still covered exactly once
across the ranks. The multiset of slots of a window is the unbalanced one; only who trains which
batch, and when, changes. Within a window the occurrences of each ``(drawer, sid)`` are numbered
in the order the balanced steps serve them, so the batches served before any step form a prefix
of every ``(drawer, sid)`` sequence: what :func:`served_counts` gives an elastic resume.

Resume needs one integer, the step ``s`` (``window, position = divmod(s, k)``), next to ``k``;
the counters at the window start are replayed by :func:`window_start_counts`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.order import STREAM_CHUNK, stream_chunk, stream_counts, stream_draws

TAG_BALANCE = 0x42414C4E  # "BALN": step order and rank lanes of a balanced window
KEY_WINDOW = "training.training_data.balance_window"
"""The proposed ``input.json`` key: steps per window ``k`` (absent or 0: no balancing)."""
KEY_COST = "training.training_data.balance_cost"
"""The proposed ``input.json`` key of the cost model, a name in :data:`COST_MODELS`."""


def cost_atoms(natoms: np.ndarray, batch_sizes: np.ndarray,
               neighbours: np.ndarray | None = None) -> np.ndarray:
    """Atoms per batch, ``natoms * batch_size``: what a step's work mostly follows."""
    return np.asarray(natoms, dtype=np.float64) * np.asarray(batch_sizes, dtype=np.float64)


def cost_neighbours(natoms: np.ndarray, batch_sizes: np.ndarray,
                    neighbours: np.ndarray | None = None) -> np.ndarray:
    """Neighbour pairs per batch, ``natoms * batch_size * mean_neighbours`` (within rcut).

    For descriptors whose cost follows the pairs; ``neighbours`` comes from the neighbour
    statistics, one mean per system.
    """
    if neighbours is None:
        raise ConfigError("the cost model 'neighbours' needs the mean number of neighbours of "
                          "every system", path=KEY_COST)
    return cost_atoms(natoms, batch_sizes) * np.asarray(neighbours, dtype=np.float64)


COST_MODELS: dict[str, Callable[..., np.ndarray]] = {
    "atoms": cost_atoms,
    "neighbours": cost_neighbours,
}
"""Cost model name -> function of (natoms, batch_sizes, neighbours) giving one cost per system."""


def batch_costs(model: str, natoms: Sequence[int] | np.ndarray,
                batch_sizes: Sequence[int] | np.ndarray,
                neighbours: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
    """The cost of one batch of every system under the named model (:data:`COST_MODELS`)."""
    if model not in COST_MODELS:
        raise ConfigError(f"unknown cost model {model!r}; expected one of {sorted(COST_MODELS)}",
                          path=KEY_COST)
    n = np.asarray(natoms).reshape(-1)
    b = np.asarray(batch_sizes).reshape(-1)
    nb = None if neighbours is None else np.asarray(neighbours, dtype=np.float64).reshape(-1)
    if len(b) != len(n) or (nb is not None and len(nb) != len(n)):
        raise ConfigError(f"cost inputs of different lengths: {len(n)} natoms, {len(b)} batch "
                          f"sizes, {None if nb is None else len(nb)} neighbour means",
                          path=KEY_COST)
    return check_costs(COST_MODELS[model](n, b, nb), len(n))


def check_costs(costs: Sequence[float] | np.ndarray, nsys: int) -> np.ndarray:
    """Costs as float64, one finite value >= 0 per system, or a :class:`ConfigError`."""
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    if len(c) != nsys or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ConfigError(f"balancing needs one finite cost >= 0 per system ({nsys}), got "
                          f"{len(c)} value(s) with min {c.min() if len(c) else None}",
                          path=KEY_COST)
    return c


def check_window(k: int, world_size: int, same_system_across_ranks: bool = False) -> int:
    """Validate the window ``k`` (steps, >= 1) against the sampler's settings; return it.

    ``same_system_across_ranks`` already gives every rank of a step the same system, so there is
    nothing to balance, and its lockstep (all ranks in the same pass) would be broken by moving
    batches between ranks: the combination is refused.
    """
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ConfigError(f"the balance window must be a positive number of steps, got {k!r}",
                          path=KEY_WINDOW)
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) \
            or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if same_system_across_ranks:
        raise ConfigError("balanced steps cannot be combined with same_system_across_ranks=True,"
                          " which already gives every rank the same system at each step: set "
                          "one of them", path=KEY_WINDOW)
    return int(k)


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def chunk_draws(seed: int, chunk: int, world_size: int, cdf: np.ndarray,
                generation: int = 0) -> np.ndarray:
    """Stream chunk ``chunk`` of every rank, ``[W, STREAM_CHUNK]`` in the smallest integer type:
    what a sampler caches so a window costs no new draws (a chunk holds ``STREAM_CHUNK / k``)."""
    dtype = np.min_scalar_type(max(len(cdf) - 1, 0))
    return np.stack([stream_chunk(seed, r, int(chunk), cdf, False, generation).astype(dtype)
                     for r in range(int(world_size))])


def window_draws(seed: int, window: int, k: int, world_size: int, cdf: np.ndarray,
                 generation: int = 0,
                 chunks: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
    """Systems the ``W`` per-rank streams draw in window ``window``: ``[W, k]``, row = rank.

    ``chunks`` maps chunk numbers to :func:`chunk_draws` already computed; without it (or for a
    chunk it lacks) the draws come from :func:`mdloader.sampling.order.stream_draws`.
    """
    k = check_window(k, world_size)
    start, stop = int(window) * k, (int(window) + 1) * k
    spanned = range(start // STREAM_CHUNK, (stop - 1) // STREAM_CHUNK + 1)
    if chunks is None or any(c not in chunks for c in spanned):
        return np.stack([stream_draws(seed, r, start, stop, cdf, False, generation)
                         for r in range(int(world_size))])
    joined = np.concatenate([chunks[c] for c in spanned], axis=1)
    offset = spanned.start * STREAM_CHUNK
    return joined[:, start - offset:stop - offset].astype(np.int64)


def window_start_counts(seed: int, window: int, k: int, world_size: int, cdf: np.ndarray,
                        generation: int = 0, drawers: Sequence[int] | None = None) -> np.ndarray:
    """Batches each rank's stream drew of each system before window ``window``: ``[W, nsys]``.

    The occurrence counters of every ``(drawer, sid)`` at the window start, replayed with
    :func:`mdloader.sampling.order.stream_counts`; ``drawers`` limits the rows to those ranks
    (a rank can replay its own row only and gather the others').
    """
    k = check_window(k, world_size)
    rows = range(int(world_size)) if drawers is None else drawers
    return np.stack([stream_counts(seed, int(r), 0, int(window) * k, cdf, False, generation)
                     for r in rows])


def next_start_counts(start_counts: np.ndarray, draws: np.ndarray,
                      out: np.ndarray | None = None) -> np.ndarray:
    """The counters at the next window's start: ``start_counts`` plus this window's ``draws``.

    ``out=start_counts`` updates in place, in O(k W) instead of copying ``W * nsys`` counters.
    """
    out = start_counts.copy() if out is None else out
    np.add.at(out, (np.repeat(np.arange(draws.shape[0]), draws.shape[1]), draws.reshape(-1)), 1)
    return out


def arrange(draws: np.ndarray, costs: np.ndarray, seed: int, window: int,
            generation: int = 0) -> np.ndarray:
    """Where each drawn batch of a window goes: ``src[step, rank]`` indexes ``draws.reshape(-1)``.

    Sort by (cost, system, draw index), cut into ``k`` chunks of ``W`` (one per step), then
    shuffle the steps and, within each step, the ranks, from ``(seed, generation, window)``.
    Every rank gets exactly one batch per step, so ``k`` per window.
    """
    world, k = draws.shape
    flat = draws.reshape(-1)
    order = np.lexsort((np.arange(flat.size), flat, costs[flat])).reshape(k, world)
    rng = _rng(seed, TAG_BALANCE, int(generation), int(window))
    steps = rng.permutation(k)
    lanes = np.argsort(rng.random((k, world)), axis=1)
    return np.take_along_axis(order[steps], lanes, axis=1)


class Slots(NamedTuple):
    """Balanced slots, arrays of one shape: the ``occurrence``-th batch of ``sid`` in the
    stream of rank ``drawer``. A window's slots are ``[k, W]`` (step, rank); one rank's ``[k]``."""

    drawer: np.ndarray
    sid: np.ndarray
    occurrence: np.ndarray


def label(draws: np.ndarray, src: np.ndarray, start_counts: np.ndarray) -> Slots:
    """Slots of an arranged window, occurrences numbered from ``start_counts`` per
    ``(drawer, sid)`` in the order the balanced steps (then ranks) serve them."""
    world, k = draws.shape
    nsys = start_counts.shape[1]
    drawer, sid = src // k, draws.reshape(-1)[src]
    group = (drawer * nsys + sid).reshape(-1)
    by = np.lexsort((np.arange(group.size), group))  # slots in (step, rank) order within groups
    sorted_group = group[by]
    first = np.flatnonzero(np.r_[True, sorted_group[1:] != sorted_group[:-1]])
    within = np.arange(group.size) - np.repeat(first, np.diff(np.r_[first, group.size]))
    occ = np.empty(group.size, dtype=np.int64)
    occ[by] = start_counts.reshape(-1)[sorted_group] + within
    return Slots(drawer, sid, occ.reshape(src.shape))


def balanced_window(seed: int, window: int, k: int, world_size: int, cdf: np.ndarray,
                    costs: np.ndarray, start_counts: np.ndarray, generation: int = 0,
                    chunks: Mapping[int, np.ndarray] | None = None) -> Slots:
    """Every slot of window ``window``: ``[k, W]`` slots, identical on every rank."""
    draws = window_draws(seed, window, k, world_size, cdf, generation, chunks)
    costs = check_costs(costs, len(cdf))
    if start_counts.shape != (world_size, len(cdf)):
        raise StateDictError(f"start counts of shape {start_counts.shape}, expected "
                             f"{(world_size, len(cdf))}")
    return label(draws, arrange(draws, costs, seed, window, generation), start_counts)


def rank_slots(window: Slots, rank: int, position: int = 0) -> Slots:
    """Rank ``rank``'s slots of a whole window from step ``position`` on, in step order."""
    k, world = window.drawer.shape
    if not 0 <= rank < world or not 0 <= position <= k:
        raise ConfigError(f"rank {rank} of {world} at position {position} of a {k}-step window")
    return Slots(*(a[position:, rank] for a in window))


def split_step(step: int, k: int) -> tuple[int, int]:
    """Window and position of a step: the whole resume state next to ``k``."""
    if step < 0:
        raise StateDictError(f"cannot resume at a negative step ({step})")
    return divmod(int(step), check_window(k, 1))


def served_counts(seed: int, k: int, steps: Sequence[int], cdf: np.ndarray,
                  costs: np.ndarray, generation: int = 0) -> np.ndarray:
    """Batches of each ``(sid, drawer)`` served when every rank has taken ``steps[r]`` steps.

    ``[nsys, W]``, the ``counts`` that :func:`mdloader.sampling.elastic.advance` takes in place of
    ``replay_counts`` for a balanced generation: thanks to :func:`label` they are prefixes of
    every drawer's per-system sequence, also when the generation stopped inside a window. The
    ranks of a balanced job step together, so ``steps`` must all be equal.
    """
    world = len(steps)
    if world < 1 or len(set(steps)) != 1:
        raise StateDictError(f"a balanced generation stops with every rank at the same step, got "
                             f"steps {list(steps)}")
    window, position = split_step(int(steps[0]), k)
    start = window_start_counts(seed, window, k, world, cdf, generation)
    if position == 0:
        return start.T.copy()
    slots = balanced_window(seed, window, k, world, cdf, costs, start, generation)
    nsys = len(cdf)
    done = (slots.drawer[:position] * nsys + slots.sid[:position]).reshape(-1)
    return (start + np.bincount(done, minlength=world * nsys).reshape(world, nsys)).T.copy()


__all__ = [
    "TAG_BALANCE", "KEY_WINDOW", "KEY_COST", "COST_MODELS", "cost_atoms", "cost_neighbours",
    "batch_costs", "check_costs", "check_window", "chunk_draws", "window_draws",
    "window_start_counts", "next_start_counts", "arrange", "Slots", "label", "balanced_window",
    "rank_slots", "split_step", "served_counts",
]
