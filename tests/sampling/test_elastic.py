"""Elastic resume on rank grids in one process: W -> W' for W, W' in {1, 2, 4}, chains, and
1024 -> 512 / 1536 computed for two new ranks alone.

Every check is made on what the samplers *served*, against the definitions of
docs/sampling.md#elastic-resume, not against the module's own bookkeeping
(tests/support/elastic_ledger.py): an old rank's batches of each system split into leftover
batches and passes; a pass shard it left half-served is a *unit*; new rank ``r'`` of ``W'`` must
first serve exactly what the old ranks ``d % W' == r'`` owed (the frames of their units that were
not served, and what remained of their own leftover) and then the passes of the new generation
from pass 0, exactly as a job that always ran on W' ranks shards them.
"""

from __future__ import annotations

import copy
import json
from collections import Counter

import numpy as np
import pytest
from support.elastic_ledger import Ledger

from mdloader.errors import StateDictError
from mdloader.sampling.batching import batches_per_rank
from mdloader.sampling.elastic import merge_rank_states
from mdloader.sampling.probability import StyleRule
from mdloader.sampling.samplers import WeightedSystemSampler

NFRAMES = [12, 7, 30, 1, 8, 16, 5]
BSIZES = [2, 3, 4, 1, 1, 3, 2]
SEED = 5
RULE = StyleRule.of("prob_sys_size")   # depends on W: the replay must use each generation's own


def make(rank: int, world: int, **kw) -> WeightedSystemSampler:
    return WeightedSystemSampler(NFRAMES, BSIZES, kw.pop("probs", RULE), seed=SEED, rank=rank,
                                 world_size=world, **kw)


def run(samplers: list[WeightedSystemSampler], steps: list[int]) -> list[list]:
    return [[s.next_key() for _ in range(k)] for s, k in zip(samplers, steps)]


def resume(job: dict, world: int, **kw) -> list[WeightedSystemSampler]:
    samplers = [make(r, world, **kw) for r in range(world)]
    for s in samplers:
        s.load_state_dict(job)
    return samplers


def new_ledger(shuffle: bool = True) -> Ledger:
    return Ledger(NFRAMES, BSIZES, SEED, shuffle)


def test_the_ledger_fails_on_a_wrong_continuation() -> None:
    """The checks below can fail: a resume that restarts at pass 0 is caught."""
    old = [make(r, 2) for r in range(2)]
    ledger = new_ledger()
    ledger.generation(run(old, [40, 41]), 2)
    fresh_start = [make(r, 2) for r in range(2)]   # ignores the state: repeats frames
    with pytest.raises(AssertionError):
        ledger.generation(run(fresh_start, [400, 400]), 2, drained=True)


@pytest.mark.parametrize("same", [False, True], ids=["own-streams", "same-system"])
@pytest.mark.parametrize("new_world", [1, 2, 4])
@pytest.mark.parametrize("old_world", [1, 2, 4])
def test_restart_matrix(old_world: int, new_world: int, same: bool) -> None:
    old = [make(r, old_world, same_system_across_ranks=same) for r in range(old_world)]
    steps = [23] * old_world if same else [23 + 11 * r for r in range(old_world)]
    ledger = new_ledger()
    first = ledger.generation(run(old, steps), old_world)
    owed = dict(ledger.owed)
    job = merge_rank_states([s.state_dict() for s in old])
    new = resume(job, new_world, same_system_across_ranks=same)
    assert all(s.generation == (0 if new_world == old_world else 1) for s in new)
    if new_world == old_world:   # exact continuation, bit for bit
        assert run(new, [50] * new_world) == run(old, [50] * old_world)
        return
    second = ledger.generation(run(new, [400] * new_world), new_world, drained=True)
    for sid in range(len(NFRAMES)):
        assert second["from_leftover"][sid] == owed[sid], "owed frames lost or served twice"
        # every frame of an interrupted unit is served as often as the unit holds it: once
        assert first["prefix"][sid] + second["from_leftover"][sid] == first["units"][sid]
        if same:   # all ranks were in the same pass: each of its frames is served exactly once
            assert set(first["units"][sid].values()) <= {1}
    assert any(first["units"][sid] for sid in range(len(NFRAMES))), "no unit was interrupted"


@pytest.mark.parametrize("worlds", [(2, 4, 1, 2), (4, 2, 3, 1), (1, 3, 2, 2)])
def test_chain_of_elastic_resumes(worlds: tuple[int, ...]) -> None:
    """Each transition conserves what is owed; the state grows by W + 1 integers per resume."""
    ledger = new_ledger()
    samplers = [make(r, worlds[0]) for r in range(worlds[0])]
    keys, world_of_keys = run(samplers, [30 + 7 * r for r in range(worlds[0])]), worlds[0]
    for world in worlds[1:]:
        job = merge_rank_states([s.state_dict() for s in samplers])
        samplers = resume(job, world)
        more = run(samplers, [17 + 5 * r for r in range(world)])
        if world == world_of_keys:   # the same generation goes on
            keys = [a + b for a, b in zip(keys, more)]
        else:
            ledger.generation(keys, world_of_keys)
            keys, world_of_keys = more, world
    ledger.generation(keys, world_of_keys)
    job = merge_rank_states([s.state_dict() for s in samplers])
    rows = [len(row) for row in job["generations"]]
    changes = sum(a != b for a, b in zip(worlds, worlds[1:]))
    assert len(rows) == changes + 1 and sum(rows) == sum(w + 1 for w in _distinct_runs(worlds))
    owed = dict(ledger.owed)
    last = ledger.generation(run(resume(job, 3), [600] * 3), 3, drained=True)
    assert all(last["from_leftover"][sid] == owed[sid] for sid in range(len(NFRAMES)))


BIG_NFRAMES = [6000, 4500, 3001, 2100, 1500]
BIG_BSIZES = [1, 2, 1, 1, 1]
BIG_WORLD = 1024
BIG_RANKS = (0, 511, 512, 1023)   # the old ranks that new ranks 0 and W' - 1 own, W' in {512, 1536}


BIG_NATOMS = [3, 40, 9, 120, 17]


def _big(rank: int, world: int, window: int) -> WeightedSystemSampler:
    return WeightedSystemSampler(BIG_NFRAMES, BIG_BSIZES, RULE, seed=SEED, rank=rank,
                                 world_size=world, balance_window=window, natoms=BIG_NATOMS)


@pytest.fixture(scope="module", params=[0, 32], ids=["unbalanced", "balanced"])
def big_job(request: pytest.FixtureRequest) -> tuple[Ledger, dict, dict, int]:
    """Old ranks ``BIG_RANKS`` of a 1024-rank job (balance window 0 or 32), each past one
    stream chunk with its own number of steps, checked by a ledger; the facts of that check; the
    job state of all 1024 ranks (the others' states only name their steps); the window."""
    window = request.param
    steps = [4097 + (37 * r) % 301 for r in range(BIG_WORLD)]
    served = {}
    for r in BIG_RANKS:
        sampler = _big(r, BIG_WORLD, window)
        served[r] = [sampler.next_key() for _ in range(steps[r])]
        assert sampler.state_dict()["steps"] == steps[r]
    base = sampler.state_dict()
    job = merge_rank_states([dict(base, rank=r, steps=k) for r, k in enumerate(steps)])
    ledger = Ledger(BIG_NFRAMES, BIG_BSIZES, SEED)
    first = ledger.generation(served, BIG_WORLD)
    assert any(first["units"][sid] for sid in range(len(BIG_NFRAMES))), "no unit interrupted"
    return ledger, first, job, window


@pytest.mark.parametrize("new_world", [512, 1536])
def test_1024_ranks_resume_elastically_on_two_new_ranks(
        big_job: tuple[Ledger, dict, dict, int], new_world: int) -> None:
    """New ranks 0 and W' - 1 alone serve what the old ranks they own left, then W'-rank passes
    (balanced too: a balanced rank reads its own frames, and resumes from uneven steps)."""
    ledger, first, job, window = copy.deepcopy(big_job)
    new, owed = {}, {}
    for r in (0, new_world - 1):
        sampler = _big(r, new_world, window)
        sampler.load_state_dict(job)
        cont = sampler.order.continuation
        owed[r] = ledger.handed_to(r, new_world)
        assert cont.generation == sampler.generation == 1
        assert set(cont.pieces["rank"].tolist()) <= set(range(r, BIG_WORLD, new_world))
        assert cont.lengths.tolist() == [sum(owed[r][sid].values())
                                         for sid in range(len(BIG_NFRAMES))]
        new[r] = [sampler.next_key() for _ in range(300)]
    second = ledger.generation(new, new_world, drained=True)   # exactly what was owed, then passes
    if new_world < BIG_WORLD:   # the two new ranks own all four old ranks
        assert all(any(owed[r].values()) for r in owed), "a new rank was owed nothing"
        for sid in range(len(BIG_NFRAMES)):
            assert first["prefix"][sid] + second["from_leftover"][sid] == first["units"][sid]
    else:   # growth: the last new rank owns no old rank and starts with the fresh passes
        assert any(owed[0].values()) and not any(owed[new_world - 1].values())


def _distinct_runs(worlds: tuple[int, ...]) -> list[int]:
    return [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]


def test_a_generation_without_steps_is_dropped() -> None:
    """2 -> 4 with no step, then back to 2: the original streams continue exactly."""
    old = [make(r, 2) for r in range(2)]
    run(old, [9, 14])
    job = merge_rank_states([s.state_dict() for s in old])
    idle = resume(job, 4)
    back = resume(merge_rank_states([s.state_dict() for s in idle]), 2)
    assert [s.generation for s in back] == [0, 0]
    assert run(back, [30, 30]) == run(old, [30, 30])


def test_shuffle_off_and_fixed_probabilities() -> None:
    probs = [0.2, 0.1, 0.3, 0.05, 0.1, 0.15, 0.1]
    old = [make(r, 4, shuffle=False, probs=probs) for r in range(4)]
    ledger = new_ledger(shuffle=False)
    ledger.generation(run(old, [31, 5, 18, 40]), 4)
    owed = dict(ledger.owed)
    new = resume(merge_rank_states([s.state_dict() for s in old]), 2, shuffle=False, probs=probs)
    second = ledger.generation(run(new, [400, 400]), 2, drained=True)
    assert all(second["from_leftover"][sid] == owed[sid] for sid in range(len(NFRAMES)))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_new_generation_draws_with_its_own_probabilities(world: int) -> None:
    old = [make(r, 2) for r in range(2)]
    run(old, [10, 10])
    new = resume(merge_rank_states([s.state_dict() for s in old]), world)
    expected = RULE(batches_per_rank(NFRAMES, BSIZES, world))
    np.testing.assert_allclose(new[0].weights.numpy(), expected)
    draws = Counter(k.sid for k in run(new[:1], [6000])[0])
    counts = np.array([draws[s] for s in range(len(NFRAMES))])
    sigma = np.sqrt(6000 * expected * (1 - expected))
    assert np.all(np.abs(counts - 6000 * expected) < 5 * sigma + 1)
    restarted = [make(r, 2) for r in range(2)]   # and not the draws of the old generation
    assert [k.sid for k in run(new[:1], [50])[0]] != [k.sid for k in run(restarted[:1], [50])[0]]


def test_state_size_does_not_grow_with_steps_or_systems() -> None:
    def size(nsys: int, steps: int, world: int) -> int:
        samplers = [WeightedSystemSampler([10] * nsys, [2] * nsys, np.full(nsys, 1 / nsys),
                                          seed=SEED, rank=r, world_size=world)
                    for r in range(world)]
        states = [s.state_dict(consumed=steps) for s in samplers]   # a position, no replay
        return len(json.dumps(merge_rank_states(states)))

    small, large = size(10, 10, 4), size(100_000, 1_000_000, 4)
    assert large - small <= 48   # more digits in the step counts, nsys and digests only
    assert large < 400           # the whole job on 4 ranks, whatever the number of systems


def test_merge_errors() -> None:
    states = [make(r, 2).state_dict() for r in range(2)]
    with pytest.raises(StateDictError, match=r"the states of ranks \[1\] of 2 are missing"):
        merge_rank_states(states[:1])
    with pytest.raises(StateDictError, match="rank 0 appears twice"):
        merge_rank_states([states[0], states[0]])
    other = dict(states[1], seed=6)
    with pytest.raises(StateDictError, match="not from one job: rank 1 has seed 6 but rank 0 "
                       "has 5"):
        merge_rank_states([states[0], other])
    with pytest.raises(StateDictError, match="no rank state to merge"):
        merge_rank_states([{}, {}])
    job = merge_rank_states(states)
    with pytest.raises(StateDictError, match="merged already can be loaded as it is"):
        merge_rank_states([job])
    assert merge_rank_states([{}, *reversed(states)]) == job   # rank order free, {} skipped


def test_load_errors_quote_both_values() -> None:
    old = [make(r, 2) for r in range(2)]
    run(old, [3, 4])
    rank_state, job = old[0].state_dict(), merge_rank_states([s.state_dict() for s in old])
    with pytest.raises(StateDictError, match="world size 2 but this loader has 4; to resume on "
                       "another number of ranks, load the state of every rank merged"):
        make(0, 4).load_state_dict(rank_state)
    cases = [
        (dict(probs=StyleRule.of("prob_uniform")), r"system probabilities digest \d+ but this "
         r"loader has \d+ \(this loader's probabilities: auto_prob 'prob_uniform'\)"),
        (dict(type_map=["O", "H"]), r"type_map digest 0 but this loader has \d+ \(this "
         r"loader's type_map is \['O', 'H'\]\)"),
        (dict(same_system_across_ranks=True), "same_system_across_ranks 0 but this loader has 1"),
    ]
    for kwargs, match in cases:
        with pytest.raises(StateDictError, match=match):
            make(0, 4, **kwargs).load_state_dict(job)
    reseeded = WeightedSystemSampler(NFRAMES, BSIZES, RULE, seed=6, rank=0, world_size=4)
    with pytest.raises(StateDictError, match="seed 5 but this loader has 6"):
        reseeded.load_state_dict(job)
    for rows, match in [([[2, 3]], "ran on 2 rank"), ([[0]], "ran on 0 rank"),
                        ([[1, -3]], "non-negative integer, got -3"), ("x", "list of rows")]:
        with pytest.raises(StateDictError, match=match):
            make(0, 4).load_state_dict(dict(job, generations=rows))
