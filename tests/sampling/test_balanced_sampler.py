"""Balanced steps in WeightedSystemSampler: rank grids played in one process.

The sampler in balanced mode must serve, over whole windows, exactly the batches (system, frames
and the stream that drew them) of the unbalanced sampler, with the costs of each step's ranks
sorted into non-overlapping chunks; it resumes exactly from its state and elastically (checked
with the ledger of tests/support/elastic_ledger.py, counting each batch for its drawer).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from support.elastic_ledger import Ledger, by_drawer

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.elastic import merge_rank_states
from mdloader.sampling.order import STREAM_CHUNK
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


def batches(keys: list[list]) -> Counter:
    return Counter((k.sid, k.fids, k.drawer) for row in keys for k in row)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_whole_windows_serve_the_unbalanced_batches(world: int, k: int) -> None:
    steps = 6 * k
    balanced = run([make(r, world, k) for r in range(world)], [steps] * world)
    today = run([make(r, world, 0) for r in range(world)], [steps] * world)
    assert batches(balanced) == batches(today)
    assert all(key.drawer == r for r, row in enumerate(today) for key in row)
    if world > 1 and k > 1:
        assert any(key.drawer != r for r, row in enumerate(balanced) for key in row)


def test_a_window_across_a_stream_chunk_after_a_seek() -> None:
    """Window 1365 of k = 3 holds steps 4095..4097: the last draw of chunk 0, two of chunk 1."""
    world, start = 3, STREAM_CHUNK - 1
    out = []
    for k in (3, 0):
        samplers = [make(r, world, k) for r in range(world)]
        for s in samplers:
            s.seek(start)
        out.append(run(samplers, [6] * world))
    assert batches(out[0]) == batches(out[1])
    assert all(key.step == start + i for row in out[0] for i, key in enumerate(row))


@pytest.mark.parametrize("world", [2, 4])
def test_steps_of_a_window_cover_disjoint_cost_ranges(world: int) -> None:
    k = 8
    keys = run([make(r, world, k) for r in range(world)], [10 * k] * world)
    cost = np.array([[COSTS[key.sid] for key in row] for row in keys])   # [W, steps]
    lo, hi = cost.min(axis=0), cost.max(axis=0)
    for w in range(10):
        s = slice(w * k, (w + 1) * k)
        a, b = np.meshgrid(np.arange(k), np.arange(k))
        ok = (hi[s][a] <= lo[s][b]) | (hi[s][b] <= lo[s][a]) | (a == b)
        assert ok.all(), f"window {w}: steps overlap in cost"
    today = np.array([[COSTS[key.sid] for key in row]
                      for row in run([make(r, world, 0) for r in range(world)], [10 * k] * world)])
    assert hi.sum() / cost.mean(axis=0).sum() < today.max(0).sum() / today.mean(0).sum()


@pytest.mark.parametrize("at", [0, 3, 4, 13])
def test_exact_resume_inside_and_between_windows(at: int) -> None:
    world = 3
    old = [make(r, world) for r in range(world)]
    run(old, [at] * world)
    states = [s.state_dict() for s in old]
    assert all(s["balance_window"] == 4 for s in states)
    fresh = [make(r, world) for r in range(world)]
    for s, state in zip(fresh, states):
        s.load_state_dict(state)
    assert run(fresh, [20] * world) == run(old, [20] * world)
    merged = resume(merge_rank_states([s.state_dict() for s in old]), world)
    assert run(merged, [9] * world) == run(old, [9] * world)


def test_seek_back_and_forth() -> None:
    s = make(1, 2)
    keys = [s.next_key() for _ in range(30)]
    for step in (17, 2, 29, 4, 0):
        s.seek(step)
        assert s.next_key() == keys[step]


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


@pytest.mark.parametrize("new_world", [1, 2, 4])
@pytest.mark.parametrize("old_world", [1, 2, 4])
def test_elastic_resume_serves_what_was_owed(old_world: int, new_world: int) -> None:
    old = [make(r, old_world) for r in range(old_world)]
    ledger = Ledger(NFRAMES, BSIZES, SEED)
    served = run(old, [23] * old_world)     # inside a window: 23 = 5 * 4 + 3
    first = ledger.generation(by_drawer(served, old_world), old_world)
    owed = dict(ledger.owed)
    job = merge_rank_states([s.state_dict() for s in old])
    new = resume(job, new_world)
    if new_world == old_world:
        assert run(new, [30] * new_world) == run(old, [30] * old_world)
        return
    second = ledger.generation(by_drawer(run(new, [400] * new_world), new_world), new_world,
                               drained=True)
    for sid in range(len(NFRAMES)):
        assert second["from_leftover"][sid] == owed[sid], "owed frames lost or served twice"
        assert first["prefix"][sid] + second["from_leftover"][sid] == first["units"][sid]
    assert any(first["units"][sid] for sid in range(len(NFRAMES))), "no unit was interrupted"


def test_the_ledger_by_drawer_catches_a_balanced_resume_that_forgets_the_leftover() -> None:
    old = [make(r, 2) for r in range(2)]
    ledger = Ledger(NFRAMES, BSIZES, SEED)
    ledger.generation(by_drawer(run(old, [23, 23]), 2), 2)
    fresh = [make(r, 4) for r in range(4)]    # ignores the state
    with pytest.raises(AssertionError):
        ledger.generation(by_drawer(run(fresh, [400] * 4), 4), 4, drained=True)


def test_uneven_steps_resume_on_the_same_world_only() -> None:
    old = [make(r, 2) for r in range(2)]
    run(old, [9, 11])
    job = merge_rank_states([s.state_dict() for s in old])
    same = resume(job, 2)
    assert run(same, [5, 5]) == run(old, [5, 5])
    fresh = make(0, 4)
    with pytest.raises(StateDictError, match=r"every rank took the same number of steps, got "
                       r"steps \[9, 11\]"):
        fresh.load_state_dict(job)
    assert fresh.position == 0 and fresh.generation == 0     # refused before any change


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
