"""Which systems each rank takes for the statistics: disjoint shares balanced by work.

The work of a system is ``frames x atoms`` (neighbour and environment statistics scale with
the atoms of every frame). Systems are dealt greedily, heaviest first, to the currently lightest
rank (ties: the lower rank; equal weights: the lower system position), so the assignment is a
pure function of the weights and the world size: every rank computes the same one.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from mdloader.errors import ConfigError


def system_weights(nframes: Sequence[int], natoms: Sequence[int]) -> np.ndarray:
    """Work per system: frames x atoms."""
    frames, atoms = np.asarray(nframes, dtype=np.int64), np.asarray(natoms, dtype=np.int64)
    if frames.shape != atoms.shape:
        raise ConfigError(f"{frames.size} frame counts for {atoms.size} atom counts")
    return frames * atoms


def assign(weights: Sequence[int], world_size: int) -> np.ndarray:
    """The rank of each system (``weights[i]`` is system ``i``'s work)."""
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    w = np.asarray(weights, dtype=np.int64)
    if (w < 0).any():
        raise ConfigError(f"system weights must be >= 0, got {int(w.min())}")
    ranks = np.empty(w.size, dtype=np.int64)
    load = [(0, r) for r in range(world_size)]
    for i in np.lexsort((np.arange(w.size), -w)).tolist():
        total, r = heapq.heappop(load)
        ranks[i] = r
        heapq.heappush(load, (total + int(w[i]), r))
    return ranks


def share(weights: Sequence[int], rank: int, world_size: int) -> np.ndarray:
    """Positions of the systems rank ``rank`` of ``world_size`` takes, in increasing order."""
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank}")
    return np.flatnonzero(assign(weights, world_size) == rank)
