"""Balanced steps (mdloader.sampling.balance): whole rank grids played in one process.

Each rank's draws are computed alone, from (seed, rank, chunk); the guarantees are checked on
what every rank of a grid drew: marginal probabilities, one draw per stratum per window, the
costs of a step inside its stratum, and the slowdown bound.
"""

from __future__ import annotations

import numpy as np
import pytest

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.balance import (
    COST_MODELS,
    Strata,
    balanced_chunk,
    balanced_counts,
    balanced_draws,
    batch_costs,
    check_window,
    chunk_of,
    chunk_quantiles,
    chunk_windows,
    split_step,
    strata_counts,
    window_strata,
)
from mdloader.sampling.batching import batches_per_rank, resolve_batch_sizes
from mdloader.sampling.order import STREAM_CHUNK, stream_draws, weights_to_cdf
from mdloader.sampling.probability import prob_sys_size

SEEDS = (0, 7, 2**63 + 5)


def mixed_set(nsys: int = 200, nframes: int = 40, world: int = 8, seed: int = 1):
    """Systems of 3..200 atoms, equal frames, batch_size auto, prob_sys_size: (cdf, costs, ...)."""
    natoms = np.random.default_rng(seed).integers(3, 201, nsys)
    sizes = resolve_batch_sizes("auto", natoms).batch_sizes
    frames = np.full(nsys, nframes)
    cdf = weights_to_cdf(prob_sys_size(batches_per_rank(frames, sizes, world)))
    return cdf, batch_costs("atoms", natoms, sizes), frames, sizes


def grid(seed: int, world: int, start: int, stop: int, strata: Strata, k: int) -> np.ndarray:
    """What every rank draws at steps [start, stop), each rank computed alone: ``[W, steps]``."""
    return np.stack([balanced_draws(seed, r, start, stop, strata, k) for r in range(world)])


def slowdown(costs: np.ndarray) -> float:
    """Sum over steps (columns) of the busiest rank's cost over the sum of the step means."""
    return float(costs.max(axis=0).sum() / costs.mean(axis=0).sum())


def stratum_ranges(strata: Strata, k: int) -> np.ndarray:
    """``[k, 2]``: the first and last cost-order position whose quantiles meet each stratum."""
    lo = np.r_[0.0, strata.cdf[:-1]]
    edges = np.arange(k + 1) / k
    first = np.searchsorted(strata.cdf, edges[:-1], side="right")
    last = np.searchsorted(lo, edges[1:], side="left") - 1
    return np.stack([first, last], axis=1)


@pytest.mark.parametrize("seed", SEEDS)
def test_each_rank_draws_every_system_with_its_probability(seed: int) -> None:
    """Frequencies over 1e5 steps of one rank against p (chi-square, 6 sigma), then a CDF that
    is not the plan's: the same statistic is far off."""
    cdf, costs, *_ = mixed_set(nsys=40, world=4)
    steps, k = 100_000, 32
    p = np.diff(cdf, prepend=0.0)
    for rank in (0, 3):
        counts = balanced_counts(seed, rank, 0, steps, cdf, costs, k)
        assert counts.sum() == steps
        chi2 = float(((counts - steps * p) ** 2 / (steps * p)).sum())
        df = len(p) - 1
        assert chi2 < df + 6 * np.sqrt(2 * df)
    wrong = weights_to_cdf(np.r_[p[:20] * 1.1, p[20:]])
    counts = balanced_counts(seed, 0, 0, steps, wrong, costs, k)
    assert float(((counts - steps * p) ** 2 / (steps * p)).sum()) > df + 6 * np.sqrt(2 * df)


def test_zero_probability_systems_are_never_drawn_and_ties_go_by_sid() -> None:
    cdf = weights_to_cdf([0.0, 1.0, 0.0, 2.0, 1.0, 0.0])
    costs = np.array([5.0, 9.0, 1.0, 3.0, 3.0, 100.0])
    strata = Strata.of(cdf, costs)
    assert strata.sids.tolist() == [2, 3, 4, 0, 1, 5]
    assert not strata.sids.flags.writeable and not strata.cdf.flags.writeable
    counts = balanced_counts(3, 0, 0, 20_000, cdf, costs, 4)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0] and counts.sum() == 20_000
    assert np.all(counts[[1, 3, 4]] > 0)


@pytest.mark.parametrize("world", [1, 3, 8, 64])
def test_every_rank_draws_once_from_every_stratum_and_a_step_stays_in_its_stratum(
        world: int) -> None:
    cdf, costs, *_ = mixed_set(world=world)
    strata, k, seed, windows = Strata.of(cdf, costs), 32, 11, 6
    start = (chunk_windows(k) - 3) * k           # windows 125..130: across a chunk boundary
    draws = grid(seed, world, start, start + windows * k, strata, k)
    position = np.argsort(strata.sids)[draws]    # cost-order position of each draw
    ranges = stratum_ranges(strata, k)
    c = costs[draws]
    positive = costs[np.diff(cdf, prepend=0.0) > 0]
    for w in range(windows):
        window = start // k + w
        order = window_strata(seed, chunk_of(window * k, k), k)[window % chunk_windows(k)]
        assert sorted(order.tolist()) == list(range(k))      # one draw per stratum per rank
        cols = slice(w * k, (w + 1) * k)
        lo, hi = ranges[order, 0], ranges[order, 1]
        assert np.all((position[:, cols] >= lo) & (position[:, cols] <= hi))
        by_stratum = np.argsort(order)
        step_lo = c[:, cols].min(axis=0)[by_stratum]
        step_hi = c[:, cols].max(axis=0)[by_stratum]
        assert np.all(step_hi[:-1] <= step_lo[1:])           # strata follow each other in cost
        excess = c[:, cols].max(axis=0).sum() - c[:, cols].mean(axis=0).sum()
        assert excess <= positive.max() - positive.min() + 1e-9
    q = chunk_quantiles(seed, 0, 0, k).reshape(-1, k)
    assert np.array_equal(np.floor(q * k).astype(int), window_strata(seed, 0, k))


@pytest.mark.parametrize("world", [8, 64])
def test_the_slowdown_at_k32_is_within_5_percent_where_the_unbalanced_one_is_not(
        world: int) -> None:
    cdf, costs, *_ = mixed_set(world=world)
    strata, k, seed, steps = Strata.of(cdf, costs), 32, 3, 1024
    balanced = slowdown(costs[grid(seed, world, 0, steps, strata, k)])
    unbalanced = slowdown(costs[np.stack([stream_draws(seed, r, 0, steps, cdf)
                                          for r in range(world)])])
    assert balanced <= 1.05 < 1.3 < unbalanced


def test_a_stratified_rank_is_closer_to_p_than_an_independent_one() -> None:
    """Per window of k = 64 steps one draw per stratum: the counts of a rank spread less than
    the multinomial counts of the unbalanced stream (same systems, same steps)."""
    cdf, costs, *_ = mixed_set(nsys=8, world=2)
    k, windows = 64, 64
    p = np.diff(cdf, prepend=0.0)
    strata = Strata.of(cdf, costs)
    balanced = balanced_draws(5, 0, 0, k * windows, strata, k).reshape(windows, k)
    unbalanced = stream_draws(5, 0, 0, k * windows, cdf).reshape(windows, k)

    def spread(draws: np.ndarray) -> float:
        counts = np.stack([np.bincount(row, minlength=len(p)) for row in draws])
        return float(((counts - k * p) ** 2).mean())

    assert spread(balanced) * 4 < spread(unbalanced)


@pytest.mark.parametrize("k", [1, 3, 32, 100, 5000])
def test_draws_and_counts_of_any_range_agree_with_the_chunks(k: int) -> None:
    cdf, costs, *_ = mixed_set(nsys=50, world=2)
    strata, seed = Strata.of(cdf, costs), 9
    m = chunk_windows(k)
    assert m == max(1, STREAM_CHUNK // k) and m * k >= k
    whole = np.concatenate([balanced_chunk(seed, 1, c, strata, k) for c in range(3)])
    assert len(whole) == 3 * m * k
    for start, stop in [(0, 1), (m * k - 2, m * k + 5), (5, 2 * m * k + 3), (7, 7)]:
        assert np.array_equal(balanced_draws(seed, 1, start, stop, strata, k),
                              whole[start:stop])
        assert np.array_equal(strata_counts(seed, 1, start, stop, strata, k),
                              np.bincount(whole[start:stop], minlength=50))
    assert np.array_equal(balanced_counts(seed, 1, 5, 2 * m * k, cdf, costs, k),
                          np.bincount(whole[5:2 * m * k], minlength=50))


def test_ranks_share_the_strata_not_the_draws_and_seeds_generations_share_neither() -> None:
    cdf, costs, *_ = mixed_set(nsys=50, world=2)
    strata, k = Strata.of(cdf, costs), 16
    base = balanced_chunk(1, 0, 0, strata, k)
    for other in (balanced_chunk(2, 0, 0, strata, k),
                  balanced_chunk(1, 0, 0, strata, k, generation=1),
                  balanced_chunk(1, 0, 1, strata, k)):
        assert np.mean(base == other) < 0.2
    q0, q1 = chunk_quantiles(1, 0, 0, k), chunk_quantiles(1, 1, 0, k)
    assert np.array_equal(np.floor(q0 * k), np.floor(q1 * k))         # the same strata
    assert abs(np.corrcoef(q0 * k % 1, q1 * k % 1)[0, 1]) < 0.1       # independent within
    assert 0.2 < np.mean(base == balanced_chunk(1, 1, 0, strata, k)) < 0.9
    assert not np.array_equal(window_strata(1, 0, k), window_strata(1, 0, k, generation=1))


def test_cost_models() -> None:
    assert sorted(COST_MODELS) == ["atoms", "neighbours"]
    assert batch_costs("atoms", [6, 192], [6, 1]).tolist() == [36.0, 192.0]
    assert batch_costs("neighbours", [6, 192], [6, 1], [10.0, 50.0]).tolist() == [360.0, 9600.0]


def test_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="balance_window.*same_system_across_ranks"):
        check_window(8, 4, same_system_across_ranks=True)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="balance_window: .*positive number of steps"):
            check_window(bad, 4)
    with pytest.raises(ConfigError, match="balance_window: .*positive number of steps"):
        chunk_windows(0)
    with pytest.raises(ConfigError, match="balance_cost: unknown cost model 'flops'"):
        batch_costs("flops", [3], [11])
    with pytest.raises(ConfigError, match="balance_cost: .*needs the mean number of neighbours"):
        batch_costs("neighbours", [3], [11])
    with pytest.raises(ConfigError, match="balance_cost: cost inputs of different lengths"):
        batch_costs("atoms", [3, 4], [11])
    cdf, costs, *_ = mixed_set(nsys=5, world=2)
    with pytest.raises(ConfigError, match="balance_cost: .*one finite cost >= 0 per system"):
        Strata.of(cdf, costs[:4])
    with pytest.raises(ConfigError, match="balance_cost: .*one finite cost"):
        balanced_counts(0, 0, 0, 4, cdf, np.r_[costs[:4], np.nan], 4)
    with pytest.raises(StateDictError, match="negative step"):
        split_step(-1, 4)
    assert split_step(70, 32) == (2, 6)
