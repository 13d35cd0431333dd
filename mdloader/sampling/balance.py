"""Balanced steps (pure): every rank of a step draws from the same cost stratum.

In data-parallel training a step waits for the slowest rank, and a batch costs about its number
of atoms. The systems are sorted once by (cost, sid) and the probabilities laid out in that
order as one CDF (:class:`Strata`); quantile ``q`` in ``[0, 1)`` names a system by inverse CDF.
Window ``w`` of ``k`` steps cuts ``[0, 1)`` into ``k`` strata ``[i / k, (i + 1) / k)`` and puts
them in a random order shared by all ranks (:func:`window_strata`, from ``(seed, generation,
chunk)``). At step ``w * k + j`` rank ``r`` draws ``u`` from its own stream and takes the system
of quantile ``(i + u) / k``, ``i`` the stratum of position ``j``.

So ``q`` is uniform: each rank draws system ``s`` with probability ``p_s`` at every step, as the
unbalanced stream does. Each rank draws exactly once from every stratum per window (stratified
sampling). At a step all ranks draw from one stratum, whose costs lie between its cheapest and
its dearest system; the strata follow each other in cost, so over a window the sum of the step
maxima exceeds the sum of the step means by at most ``max(cost) - min(cost)``.

Nothing here depends on the number of ranks: a rank needs its own uniforms and the shared
stratum order, drawn per *chunk* of :func:`chunk_windows` whole windows (about
:data:`~mdloader.sampling.order.STREAM_CHUNK` steps), one generator for each. A rank reads the
frames of its own batches (its own per-system counters), like the unbalanced sampler; resume
replays only its own counts (:func:`balanced_counts`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.order import STREAM_CHUNK, weights_to_cdf

TAG_BALANCE = 0x42414C4E       # "BALN": the shared stratum order of a chunk's windows
TAG_BALANCE_RANK = 0x42414C52  # "BALR": one rank's uniforms within the strata of a chunk
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
    nothing to balance, and its lockstep (all ranks in the same pass) would be broken by the
    ranks drawing different systems of a stratum: the combination is refused.
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


_BELOW_ONE = np.nextafter(1.0, 0.0)


@dataclass(frozen=True)
class Strata:
    """The systems in cost order: ``sids[i]`` is the ``i``-th cheapest (ties by sid) and
    ``cdf`` the cumulative probabilities in that order; built once per plan and world size."""

    sids: np.ndarray
    cdf: np.ndarray

    @classmethod
    def of(cls, cdf: np.ndarray, costs: np.ndarray) -> Strata:
        """From the stream's CDF in sid order (``plan.cdf_on(W)``) and one cost per system."""
        cdf = np.asarray(cdf, dtype=np.float64)
        costs = check_costs(costs, len(cdf))
        probs = np.diff(cdf, prepend=0.0)
        sids = np.lexsort((np.arange(len(cdf)), costs)).astype(np.int64)
        sorted_cdf = weights_to_cdf(probs[sids])
        sids.flags.writeable = sorted_cdf.flags.writeable = False
        return cls(sids, sorted_cdf)

    @property
    def nsys(self) -> int:
        return len(self.sids)

    def positions(self, quantiles: np.ndarray) -> np.ndarray:
        """Cost-order positions of the systems at ``quantiles`` in ``[0, 1)`` (inverse CDF)."""
        q = np.minimum(quantiles, _BELOW_ONE)   # (i + u) / k may round up to 1.0
        return np.searchsorted(self.cdf, q, side="right")


def chunk_windows(k: int) -> int:
    """Windows per chunk, ``max(1, STREAM_CHUNK // k)``: a window never straddles two chunks."""
    return max(1, STREAM_CHUNK // check_window(k, 1))


def chunk_of(step: int, k: int) -> int:
    """The chunk that holds ``step``."""
    return int(step) // (chunk_windows(k) * int(k))


def window_strata(seed: int, chunk: int, k: int, generation: int = 0) -> np.ndarray:
    """The stratum of every step of the chunk's windows, ``[m, k]``: one permutation of
    ``range(k)`` per window, the same on every rank."""
    m = chunk_windows(k)
    u = _rng(seed, TAG_BALANCE, int(generation), int(chunk)).random((m, int(k)))
    return u.argsort(axis=1)


def chunk_quantiles(seed: int, rank: int, chunk: int, k: int, generation: int = 0) -> np.ndarray:
    """Rank ``rank``'s quantile at every step of the chunk, ``(stratum + u) / k``, flat."""
    strata = window_strata(seed, chunk, k, generation).reshape(-1)
    u = _rng(seed, TAG_BALANCE_RANK, int(generation), int(rank), int(chunk)).random(strata.size)
    return (strata + u) / int(k)


def balanced_chunk(seed: int, rank: int, chunk: int, strata: Strata, k: int,
                   generation: int = 0) -> np.ndarray:
    """Systems (sids) rank ``rank`` draws at the steps of chunk ``chunk``, ``m * k`` of them."""
    positions = strata.positions(chunk_quantiles(seed, rank, chunk, k, generation))
    return strata.sids[positions]


def balanced_draws(seed: int, rank: int, start: int, stop: int, strata: Strata, k: int,
                   generation: int = 0) -> np.ndarray:
    """Systems rank ``rank`` draws at steps ``[start, stop)``."""
    if stop <= start:
        return np.empty(0, dtype=np.int64)
    steps = chunk_windows(k) * int(k)
    first, last = int(start) // steps, (int(stop) - 1) // steps
    joined = np.concatenate([balanced_chunk(seed, rank, c, strata, k, generation)
                             for c in range(first, last + 1)])
    return joined[int(start) - first * steps:int(stop) - first * steps]


def strata_counts(seed: int, rank: int, start: int, stop: int, strata: Strata, k: int,
                  generation: int = 0) -> np.ndarray:
    """How often rank ``rank`` draws each system (by sid) at steps ``[start, stop)``.

    Counted by cost-order position, one chunk at a time, and mapped to sids once.
    """
    counts = np.zeros(strata.nsys, dtype=np.int64)
    steps = chunk_windows(k) * int(k)
    pos = int(start)
    while pos < stop:
        c = pos // steps
        end = min(int(stop), (c + 1) * steps)
        q = chunk_quantiles(seed, rank, c, k, generation)[pos - c * steps:end - c * steps]
        counts += np.bincount(strata.positions(q), minlength=strata.nsys)
        pos = end
    out = np.empty_like(counts)
    out[strata.sids] = counts
    return out


def balanced_counts(seed: int, rank: int, start: int, stop: int, cdf: np.ndarray,
                    costs: np.ndarray, k: int, generation: int = 0) -> np.ndarray:
    """How often rank ``rank`` draws each system at steps ``[start, stop)`` of a balanced
    generation: its per-system counters (``cdf`` in sid order, ``costs`` the plan's)."""
    return strata_counts(seed, rank, start, stop, Strata.of(cdf, costs), k, generation)


def split_step(step: int, k: int) -> tuple[int, int]:
    """Window and position of a step: the whole resume state next to ``k``."""
    if step < 0:
        raise StateDictError(f"cannot resume at a negative step ({step})")
    return divmod(int(step), check_window(k, 1))


__all__ = [
    "TAG_BALANCE", "TAG_BALANCE_RANK", "KEY_WINDOW", "KEY_COST", "COST_MODELS", "cost_atoms",
    "cost_neighbours", "batch_costs", "check_costs", "check_window", "Strata", "chunk_windows",
    "chunk_of", "window_strata", "chunk_quantiles", "balanced_chunk", "balanced_draws",
    "strata_counts", "balanced_counts", "split_step",
]
