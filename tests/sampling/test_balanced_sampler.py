"""Balanced steps in WeightedSystemSampler: rank grids played in one process.

In balanced mode a rank draws its systems from the cost strata (mdloader.sampling.balance) and
reads its own frames of them, with its own per-system counters, exactly as the unbalanced sampler
reads the systems it draws; it resumes exactly from its state, at any step and on any world size
(checked with the ledger of tests/support/elastic_ledger.py).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from support.elastic_ledger import Ledger

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.balance import Strata, balanced_draws, chunk_of, chunk_windows, window_strata
from mdloader.sampling.batching import resolve_batch_sizes
from mdloader.sampling.elastic import merge_rank_states
from mdloader.sampling.order import FrameOrder
from mdloader.sampling.probability import StyleRule
from mdloader.sampling.samplers import WeightedSystemSampler

NFRAMES = [12, 7, 30, 1, 8, 16, 5]
BSIZES = [2, 3, 4, 1, 1, 3, 2]
NATOMS = [3, 50, 9, 120, 7, 40, 20]
COSTS = np.array(NATOMS) * np.array(BSIZES)
SEED = 5
RULE = StyleRule.of("prob_sys_size")


def make(rank: int, world: int, k: int = 4, **kw) -> WeightedSystemSampler:
    return WeightedSystemSampler(NFRAMES, BSIZES, kw.pop("probs", RULE), seed=SEED, rank=rank,
                                 world_size=world, natoms=NATOMS, balance_window=k, **kw)


def run(samplers: list[WeightedSystemSampler], steps: list[int]) -> list[list]:
    return [[s.next_key() for _ in range(n)] for s, n in zip(samplers, steps)]


def resume(job: dict, world: int, **kw) -> list[WeightedSystemSampler]:
    samplers = [make(r, world, **kw) for r in range(world)]
    for s in samplers:
        s.load_state_dict(job)
    return samplers


@pytest.mark.parametrize("world", [1, 3])
def test_a_rank_reads_its_own_frames_of_the_systems_it_draws(world: int) -> None:
    """The sids are the balanced draws; the frames of the n-th batch of a system are the rank's
    own n-th batch, as in the unbalanced sampler; each pass 0 covers every frame across ranks."""
    k, steps = 8, 400
    samplers = [make(r, world, k) for r in range(world)]
    strata = Strata.of(samplers[0].plan.cdf, samplers[0].plan.balance_costs)
    keys = run(samplers, [steps] * world)
    for rank, row in enumerate(keys):
        assert [key.sid for key in row] == balanced_draws(SEED, rank, 0, steps, strata,
                                                          k).tolist()
        order = FrameOrder(NFRAMES, BSIZES, seed=SEED, rank=rank, world_size=world)
        seen: Counter = Counter()
        for key in row:
            assert key.drawer == rank and key.fids == order.fids(key.sid, seen[key.sid])
            seen[key.sid] += 1
    nb, covered = samplers[0].order.nbatches, 0
    for sid in range(len(NFRAMES)):
        mine = [[key.fids for key in row if key.sid == sid] for row in keys]
        if all(len(m) >= nb[sid] for m in mine):
            covered += 1
            pass0 = {f for m in mine for b in m[:int(nb[sid])] for f in b}
            assert pass0 == set(range(NFRAMES[sid]))
    assert covered >= 3


@pytest.mark.parametrize("world", [2, 4])
def test_steps_of_a_window_follow_each_other_in_cost(world: int) -> None:
    k = 8
    keys = run([make(r, world, k) for r in range(world)], [10 * k] * world)
    cost = np.array([[COSTS[key.sid] for key in row] for row in keys])   # [W, steps]
    lo, hi = cost.min(axis=0), cost.max(axis=0)
    for w in range(10):
        by_stratum = np.argsort(window_strata(SEED, chunk_of(w * k, k), k)[w])
        s = slice(w * k, (w + 1) * k)
        assert np.all(hi[s][by_stratum][:-1] <= lo[s][by_stratum][1:]), f"window {w}"
    today = np.array([[COSTS[key.sid] for key in row]
                      for row in run([make(r, world, 0) for r in range(world)], [10 * k] * world)])
    assert hi.sum() / cost.mean(axis=0).sum() < today.max(0).sum() / today.mean(0).sum()


@pytest.mark.parametrize(("k", "at"), [(4, 0), (4, 3), (4, 4), (4, 13), (3, 4094), (3, 4096)])
def test_exact_resume_inside_and_between_windows_and_across_a_chunk(k: int, at: int) -> None:
    """k = 3: a chunk holds 1365 windows, 4095 steps; 4094 and 4096 sit on either side."""
    world = 3
    old = [make(r, world, k) for r in range(world)]
    for s in old:
        s.seek(max(0, at - 3))
    run(old, [at - old[0].position] * world)
    states = [s.state_dict() for s in old]
    assert all(s["balance_window"] == k and s["steps"] == at for s in states)
    fresh = [make(r, world, k) for r in range(world)]
    for s, state in zip(fresh, states):
        s.load_state_dict(state)
    assert run(fresh, [6] * world) == run(old, [6] * world)
    merged = resume(merge_rank_states([s.state_dict() for s in old]), world, k=k)
    assert run(merged, [5] * world) == run(old, [5] * world)


def test_seek_back_and_forth_across_a_chunk() -> None:
    s = make(1, 2, 3)
    s.seek(4080)
    keys = [s.next_key() for _ in range(30)]
    assert chunk_of(keys[0].step, 3) == 0 != chunk_of(keys[-1].step, 3)
    for step in (4097, 4082, 4109, 4084, 4080):
        s.seek(step)
        assert s.next_key() == keys[step - 4080]


def test_the_last_of_1024_ranks_resumes_exactly_after_more_than_a_chunk() -> None:
    """W = 1024 in one process, only ranks 0 and 1023 built: a resume inside a window of the
    second chunk serves the keys of the uninterrupted run."""
    natoms = np.random.default_rng(2).integers(3, 201, 60)
    nframes = np.random.default_rng(3).integers(10, 3000, 60)
    sizes = resolve_batch_sizes("auto", natoms).batch_sizes
    world, k = 1024, 32
    at = chunk_windows(k) * k + 3 * k + 17

    def sampler(rank: int) -> WeightedSystemSampler:
        return WeightedSystemSampler(nframes, sizes, RULE, seed=SEED, rank=rank,
                                     world_size=world, natoms=natoms, balance_window=k)

    for rank in (0, world - 1):
        whole = sampler(rank)
        keys = [whole.next_key() for _ in range(at)]
        state = whole.state_dict()
        keys += [whole.next_key() for _ in range(40)]
        assert chunk_of(keys[at].step, k) == 1 and at % k and state["steps"] == at
        resumed = sampler(rank)
        resumed.load_state_dict(state)
        assert [resumed.next_key() for _ in range(40)] == keys[at:]
        assert all(key.drawer == rank for key in keys)


def test_a_state_of_another_window_or_cost_is_refused() -> None:
    state = make(0, 2, 4).state_dict()
    with pytest.raises(StateDictError, match="balance window 4 but this loader has 8"):
        make(0, 2, 8).load_state_dict(state)
    with pytest.raises(StateDictError, match="balance window 0 but this loader has 4"):
        make(0, 2, 4).load_state_dict(make(0, 2, 0).state_dict())
    with pytest.raises(StateDictError, match="balance window 4 but this loader has 0"):
        make(0, 2, 0).load_state_dict(state)
    other = WeightedSystemSampler(NFRAMES, BSIZES, RULE, seed=SEED, world_size=2,
                                  natoms=NATOMS, balance_window=4, balance_cost="neighbours",
                                  neighbours=np.arange(7) + 1.0)
    with pytest.raises(StateDictError, match="balance cost digest"):
        other.load_state_dict(state)
    assert "balance_window" not in make(0, 2, 0).state_dict()   # unbalanced layout unchanged


@pytest.mark.parametrize(("old_steps", "new_world"),
                         [([23, 23], 4), ([23] * 4, 2), ([9, 11], 4), ([23, 23], 1)])
def test_elastic_resume_serves_what_was_owed(old_steps: list[int], new_world: int) -> None:
    """Even or uneven steps, inside a window: within every interrupted unit no frame is served
    twice and none is lost."""
    old_world = len(old_steps)
    old = [make(r, old_world) for r in range(old_world)]
    ledger = Ledger(NFRAMES, BSIZES, SEED)
    first = ledger.generation(run(old, old_steps), old_world)
    new = resume(merge_rank_states([s.state_dict() for s in old]), new_world)
    second = ledger.generation(run(new, [400] * new_world), new_world, drained=True)
    for sid in range(len(NFRAMES)):
        assert first["prefix"][sid] + second["from_leftover"][sid] == first["units"][sid]
    assert any(first["units"][sid] for sid in range(len(NFRAMES))), "no unit was interrupted"
    assert all(key.drawer == r for r, s in enumerate(new) for key in [s.next_key()])


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="balance_window: .*same_system_across_ranks"):
        make(0, 2, same_system_across_ranks=True)
    with pytest.raises(ConfigError, match="balance_cost: the cost model 'neighbours' needs"):
        make(0, 2, balance_cost="neighbours")
    with pytest.raises(ConfigError, match="balance_cost: unknown cost model 'pairs'"):
        make(0, 2, balance_cost="pairs")
    with pytest.raises(ConfigError, match="balance_window: .* got -2"):
        make(0, 2, -2)
    with pytest.raises(ConfigError, match="atom count"):
        WeightedSystemSampler(NFRAMES, BSIZES, RULE, seed=SEED, balance_window=4)
    nb = np.array([1.0, 2, 3, 4, 5, 6, 7])
    s = make(0, 2, balance_cost="neighbours", neighbours=nb)
    np.testing.assert_array_equal(s.plan.balance_costs, COSTS * nb)
    np.testing.assert_array_equal(make(0, 2).plan.balance_costs, COSTS)


TASK_B = {"nframes": [9, 20, 4, 15], "bsizes": [1, 2, 4, 1], "natoms": [96, 12, 5, 60]}


@pytest.mark.parametrize("world", [2, 8])
def test_the_slowdown_bound_holds_per_task_when_every_rank_takes_the_same_task(
        world: int) -> None:
    """A multi-task job under ``mdloader dp`` (each task's training stream its own balanced
    sampler, the task of a step from mdloader's schedule): with the same task on every rank, a
    task's stream advances at the same steps on every rank, so each window of that task's
    steps keeps ``mdloader train``'s bound (``sum of step maxima - sum of step means <=
    max(cost) - min(cost)`` of the task, docs/sampling.md); with per-rank task draws a step
    mixes tasks and windows, which is why ``mdloader dp`` refuses that combination."""
    from mdloader.sampling.tasks import TaskSchedule

    k, steps = 8, 400
    costs = [COSTS, np.array(TASK_B["natoms"]) * np.array(TASK_B["bsizes"])]

    def play(same: bool) -> tuple[np.ndarray, np.ndarray]:
        schedule = TaskSchedule(SEED, (0.4, 0.6), same_task_across_ranks=same)
        streams = [[make(r, world, k) for r in range(world)],
                   [WeightedSystemSampler(TASK_B["nframes"], TASK_B["bsizes"], RULE, seed=SEED + 1,
                                          rank=r, world_size=world, natoms=TASK_B["natoms"],
                                          balance_window=k) for r in range(world)]]
        tasks = np.stack([schedule.tasks(r, 0, steps) for r in range(world)])   # [W, steps]
        cost = np.array([[costs[t][streams[t][r].next_key().sid] for t in tasks[r]]
                         for r in range(world)], dtype=np.float64)
        return tasks, cost

    tasks, cost = play(same=True)
    assert np.all(tasks == tasks[0])
    allowed = 0.0
    for t, c in enumerate(costs):
        own = cost[:, tasks[0] == t]                    # the task's steps, in order
        for w in range(own.shape[1] // k):
            window = own[:, w * k:(w + 1) * k]
            excess = window.max(axis=0).sum() - window.mean(axis=0).sum()
            assert excess <= c.max() - c.min() + 1e-9, (t, w)
            allowed += c.max() - c.min()
    same = slowdown_of(cost)
    assert same <= 1 + (allowed + 2 * k * max(c.max() for c in costs)) / cost.mean(0).sum()
    _, mixed = play(same=False)
    assert slowdown_of(mixed) > same


def slowdown_of(costs: np.ndarray) -> float:
    """Sum over steps of the busiest rank's cost over the sum of the step means."""
    return float(costs.max(axis=0).sum() / costs.mean(axis=0).sum())
