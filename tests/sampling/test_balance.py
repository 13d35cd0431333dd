"""Balanced steps (mdloader.sampling.balance): whole rank grids played in one process."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.balance import (
    COST_MODELS,
    Slots,
    balanced_window,
    batch_costs,
    check_window,
    chunk_draws,
    next_start_counts,
    rank_slots,
    served_counts,
    split_step,
    window_draws,
    window_start_counts,
)
from mdloader.sampling.batching import batches_per_rank, resolve_batch_sizes
from mdloader.sampling.order import FrameOrder, stream_counts, stream_draws, weights_to_cdf
from mdloader.sampling.probability import prob_sys_size

SEEDS = (0, 7, 2**63 + 5)


def mixed_set(nsys: int = 200, nframes: int = 40, world: int = 8, seed: int = 1):
    """Systems of 3..200 atoms, equal frames, batch_size auto, prob_sys_size: (cdf, costs, ...)."""
    natoms = np.random.default_rng(seed).integers(3, 201, nsys)
    sizes = resolve_batch_sizes("auto", natoms).batch_sizes
    frames = np.full(nsys, nframes)
    cdf = weights_to_cdf(prob_sys_size(batches_per_rank(frames, sizes, world)))
    return cdf, batch_costs("atoms", natoms, sizes), frames, sizes


def unbalanced_slots(seed: int, start: int, stop: int, world: int, cdf: np.ndarray) -> Slots:
    """What today's sampler serves at steps [start, stop): ``[steps, W]`` (drawer = rank)."""
    sids = np.stack([stream_draws(seed, r, start, stop, cdf) for r in range(world)], axis=1)
    occ = np.empty_like(sids)
    for r in range(world):
        counts = stream_counts(seed, r, 0, start, cdf)
        for t, sid in enumerate(sids[:, r]):
            occ[t, r] = counts[sid]
            counts[sid] += 1
    return Slots(np.broadcast_to(np.arange(world), sids.shape), sids, occ)


def triples(slots: Slots) -> list[tuple[int, int, int]]:
    return sorted(zip(*(a.reshape(-1).tolist() for a in slots)))


def plans(seed: int, windows: range, k: int, world: int, cdf: np.ndarray,
          costs: np.ndarray) -> list[Slots]:
    """Consecutive window plans, counters carried from one window to the next."""
    start = window_start_counts(seed, windows.start, k, world, cdf)
    out = []
    for w in windows:
        out.append(balanced_window(seed, w, k, world, cdf, costs, start))
        start = next_start_counts(start, window_draws(seed, w, k, world, cdf))
    return out


def step_ratios(costs: np.ndarray) -> np.ndarray:
    """Per step (row) the busiest rank's cost over the mean."""
    return costs.max(axis=1) / costs.mean(axis=1)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", SEEDS)
def test_window_multiset_is_the_unbalanced_one(world: int, seed: int) -> None:
    cdf, costs, *_ = mixed_set(nsys=30, world=world)
    for k, window in [(1, 0), (5, 3), (32, 1), (100, 40)]:   # the last crosses a stream chunk
        plan = balanced_window(seed, window, k, world, cdf, costs,
                               window_start_counts(seed, window, k, world, cdf))
        assert plan.sid.shape == (k, world)
        expected = unbalanced_slots(seed, window * k, (window + 1) * k, world, cdf)
        assert triples(plan) == triples(expected)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_every_rank_computes_its_k_slots_and_the_ranks_partition_the_window(world: int) -> None:
    cdf, costs, *_ = mixed_set(world=world)
    k, window, seed = 16, 5, 11
    mine = []
    for rank in range(world):   # each rank computes the plan on its own
        plan = balanced_window(seed, window, k, world, cdf, costs,
                               window_start_counts(seed, window, k, world, cdf))
        slots = rank_slots(plan, rank)
        assert slots.sid.shape == (k,)
        mine.append(slots)
    joined = Slots(*(np.stack([s[i] for s in mine], axis=1) for i in range(3)))
    assert np.array_equal(np.stack(joined), np.stack(plan))
    assert triples(joined) == triples(unbalanced_slots(seed, window * k, (window + 1) * k,
                                                       world, cdf))


@pytest.mark.parametrize("world", [2, 3])
def test_frames_of_the_passes_are_those_of_the_unbalanced_sampler(world: int) -> None:
    cdf, costs, frames, sizes = mixed_set(nsys=12, nframes=7, world=world)
    seed, k, nwin = 5, 8, 40
    orders = [FrameOrder(frames, sizes, seed=seed, rank=r, world_size=world)
              for r in range(world)]
    balanced, served = Counter(), [0] * world
    for plan in plans(seed, range(nwin), k, world, cdf, costs):
        for rank in range(world):
            for drawer, sid, occ in zip(*rank_slots(plan, rank)):
                balanced.update((int(sid), f) for f in orders[drawer].fids(sid, occ))
                served[rank] += 1
    ref = unbalanced_slots(seed, 0, nwin * k, world, cdf)
    unbalanced = Counter()
    for drawer, sid, occ in zip(*(a.reshape(-1) for a in ref)):
        unbalanced.update((int(sid), f) for f in orders[drawer].fids(sid, occ))
    assert balanced == unbalanced and served == [nwin * k] * world
    # pass 0 of a system the stream finished: every frame once across the ranks (+ padding)
    sid = int(np.argmax(np.bincount(ref.sid.reshape(-1), minlength=len(frames))))
    nb = int(orders[0].nbatches[sid])
    assert all(np.count_nonzero(ref.sid[:, r] == sid) >= nb for r in range(world))
    pass0 = Counter(f for r in range(world) for o in range(nb) for f in orders[r].fids(sid, o))
    assert set(pass0) == set(range(int(frames[sid])))
    assert all(balanced[(sid, f)] >= n for f, n in pass0.items())


def test_balanced_steps_meet_the_bound_that_the_unbalanced_ones_miss() -> None:
    world, k, seed = 8, 32, 3
    cdf, costs, *_ = mixed_set(world=world)
    for w, plan in enumerate(plans(seed, range(20), k, world, cdf, costs)):
        c = costs[plan.sid]
        bound = 1 + (c.max() - c.min()) / (k * c.mean())   # the sorted-chunk guarantee
        assert c.max(axis=1).sum() / c.mean(axis=1).sum() <= bound + 1e-12
        raw = costs[window_draws(seed, w, k, world, cdf)].T
        assert np.isclose(raw.sum(), c.sum())
        assert raw.max(axis=1).sum() / raw.mean(axis=1).sum() > bound
        assert step_ratios(c).mean() < 1.1 < 1.3 < step_ratios(raw).mean()


def test_no_other_split_of_the_window_has_a_smaller_sum_of_step_maxima() -> None:
    world, k, seed = 4, 6, 8
    cdf, costs, *_ = mixed_set(nsys=50, world=world)
    plan = plans(seed, range(2, 3), k, world, cdf, costs)[0]
    best = costs[plan.sid].max(axis=1).sum()
    flat = costs[plan.sid].reshape(-1)
    rng = np.random.default_rng(0)
    others = [flat[rng.permutation(flat.size)].reshape(k, world).max(axis=1).sum()
              for _ in range(2000)]
    assert best <= min(others) + 1e-9 and best < np.mean(others)


def test_steps_are_shuffled_within_a_window() -> None:
    world, k, seed = 8, 32, 3
    cdf, costs, *_ = mixed_set(world=world)
    heaviest = [int(np.argmax(costs[p.sid].sum(axis=1)))
                for p in plans(seed, range(12), k, world, cdf, costs)]
    assert len(set(heaviest)) > 6   # the heaviest step moves around the window
    one = plans(seed, range(1), k, world, cdf, costs)[0]
    assert not np.all(np.diff(costs[one.sid].sum(axis=1)) >= 0)


@pytest.mark.parametrize("world", [1, 3])
def test_resume_from_window_and_position_continues_exactly(world: int) -> None:
    cdf, costs, *_ = mixed_set(nsys=20, world=world)
    seed, k = 9, 12
    stream = plans(seed, range(6), k, world, cdf, costs)
    for step in (0, 5, 12, 29, 47):
        window, position = split_step(step, k)
        start = window_start_counts(seed, window, k, world, cdf)
        for rank in range(world):
            plan = balanced_window(seed, window, k, world, cdf, costs, start)
            resumed = [rank_slots(plan, rank, position)]
            later = plans(seed, range(window + 1, 6), k, world, cdf, costs)
            resumed += [rank_slots(p, rank) for p in later]
            whole = [rank_slots(p, rank) for p in stream]
            got = np.concatenate([np.stack(s) for s in resumed], axis=1)
            assert np.array_equal(got, np.concatenate([np.stack(s) for s in whole],
                                                      axis=1)[:, step:])


def test_frequencies_over_1e5_steps_are_unchanged() -> None:
    world, k, seed, steps = 2, 32, 4, 100_000
    cdf, costs, *_ = mixed_set(world=world)
    nsys = len(cdf)
    start = np.zeros((world, nsys), dtype=np.int64)
    balanced = np.zeros(nsys, dtype=np.int64)
    chunks = {c: chunk_draws(seed, c, world, cdf) for c in range(-(-steps // 4096))}
    for w in range(steps // k):
        draws = window_draws(seed, w, k, world, cdf, chunks=chunks)
        plan = balanced_window(seed, w, k, world, cdf, costs, start, chunks=chunks)
        balanced += np.bincount(plan.sid.reshape(-1), minlength=nsys)
        next_start_counts(start, draws, out=start)
    unbalanced = sum(stream_counts(seed, r, 0, steps, cdf) for r in range(world))
    assert np.array_equal(balanced, unbalanced)
    assert np.array_equal(start.sum(axis=0), unbalanced)


def test_served_counts_are_prefixes_even_inside_a_window() -> None:
    world, k, seed = 3, 10, 2
    cdf, costs, *_ = mixed_set(nsys=6, world=world)
    plan = plans(seed, range(4, 5), k, world, cdf, costs)[0]
    start = window_start_counts(seed, 4, k, world, cdf)
    for position in range(k + 1):
        counts = served_counts(seed, k, [4 * k + position] * world, cdf, costs)
        assert counts.shape == (len(cdf), world)
        done = Slots(*(a[:position] for a in plan))
        for drawer in range(world):
            for sid in range(len(cdf)):
                mask = (done.drawer == drawer) & (done.sid == sid)
                occ = sorted(done.occurrence[mask].tolist())
                assert occ == list(range(start[drawer, sid], counts[sid, drawer]))
    assert np.array_equal(served_counts(seed, k, [5 * k] * world, cdf, costs).T,
                          window_start_counts(seed, 5, k, world, cdf))
    with pytest.raises(StateDictError, match="every rank at the same step"):
        served_counts(seed, k, [40, 41, 40], cdf, costs)


def test_cached_chunks_and_per_rank_rows_give_the_same_numbers() -> None:
    world, seed = 3, 6
    cdf, costs, *_ = mixed_set(nsys=300, world=world)
    chunks = {c: chunk_draws(seed, c, world, cdf) for c in (0, 1)}
    assert chunks[0].dtype == np.uint16 and chunks[0].shape == (world, 4096)
    for k, window in [(32, 0), (32, 127), (100, 40), (7, 600)]:  # (100, 40) spans two chunks
        assert np.array_equal(window_draws(seed, window, k, world, cdf, chunks=chunks),
                              window_draws(seed, window, k, world, cdf))
    start = window_start_counts(seed, 40, 100, world, cdf)
    assert np.array_equal(window_start_counts(seed, 40, 100, world, cdf, drawers=[2, 0]),
                          start[[2, 0]])
    draws = window_draws(seed, 40, 100, world, cdf)
    expected = next_start_counts(start, draws)
    assert np.array_equal(expected, window_start_counts(seed, 41, 100, world, cdf))
    assert next_start_counts(start, draws, out=start) is start
    assert np.array_equal(start, expected)


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
    with pytest.raises(ConfigError, match="balance_cost: unknown cost model 'flops'"):
        batch_costs("flops", [3], [11])
    with pytest.raises(ConfigError, match="balance_cost: .*needs the mean number of neighbours"):
        batch_costs("neighbours", [3], [11])
    with pytest.raises(ConfigError, match="balance_cost: cost inputs of different lengths"):
        batch_costs("atoms", [3, 4], [11])
    cdf, costs, *_ = mixed_set(nsys=5, world=2)
    start = np.zeros((2, 5), dtype=np.int64)
    with pytest.raises(ConfigError, match="balance_cost: .*one finite cost >= 0 per system"):
        balanced_window(0, 0, 4, 2, cdf, costs[:4], start)
    with pytest.raises(ConfigError, match="balance_cost: .*one finite cost"):
        balanced_window(0, 0, 4, 2, cdf, np.r_[costs[:4], np.nan], start)
    with pytest.raises(StateDictError, match="start counts of shape"):
        balanced_window(0, 0, 4, 2, cdf, costs, start[:1])
    with pytest.raises(StateDictError, match="negative step"):
        split_step(-1, 4)
    plan = balanced_window(0, 0, 4, 2, cdf, costs, start)
    with pytest.raises(ConfigError, match="rank 2 of 2"):
        rank_slots(plan, 2)
