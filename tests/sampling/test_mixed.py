"""The key source of a ``mix:N`` stream on rank grids in one process: each pass is DeePMD-kit's
batches split over the ranks, a new order every pass, and a state saved at any step continues
exactly on the same ranks and on any other number of ranks."""

from __future__ import annotations

import numpy as np
import pytest

from mdloader.errors import StateDictError
from mdloader.sampling import lmdb_batches as lb
from mdloader.sampling.mixed import MixedBatchSampler, merge_mixed_states, rest_of_pass

NLOCS = np.random.default_rng(5).integers(1, 9, size=41)
RULE = lb.parse_lmdb_rule("mix:12")


def _rank(rank: int, world: int, seed: int = 3, ragged: bool = False) -> MixedBatchSampler:
    return MixedBatchSampler(NLOCS, RULE, seed=seed, rank=rank, world_size=world, ragged=ragged)


def _global(epoch: int, seed: int = 3, ragged: bool = False) -> list[list[int]]:
    return lb.pass_batches(RULE, NLOCS, lb.batch_groups(RULE, NLOCS, np.arange(len(NLOCS))),
                           seed=seed, epoch=epoch, ragged=ragged)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("ragged", [False, True])
def test_each_pass_is_deepmds_batches_split_over_the_ranks(world: int, ragged: bool) -> None:
    samplers = [_rank(r, world, ragged=ragged) for r in range(world)]
    for epoch in range(3):
        expected = [lb.rank_batches(_global(epoch, ragged=ragged), r, world)
                    for r in range(world)]
        steps = samplers[0].steps_in_pass(epoch)
        assert steps == len(expected[0])
        for r, sampler in enumerate(samplers):
            assert [list(sampler.next_key()) for _ in range(steps)] == expected[r]
    assert _global(0) != _global(1)  # a new order every pass
    for batch in _global(0, ragged=ragged):  # DeePMD-kit's budget: a lone frame may exceed it
        atoms = NLOCS[batch]
        axis = atoms.sum() if ragged else len(batch) * atoms.max()
        assert axis <= RULE.value or len(batch) == 1


def _uninterrupted(world: int, steps: int) -> list[list[tuple[int, ...]]]:
    samplers = [_rank(r, world) for r in range(world)]
    return [[s.next_key() for _ in range(steps)] for s in samplers]


@pytest.mark.parametrize("world, stop", [(1, 3), (2, 5), (3, 6), (3, 7), (2, 11), (3, 13)])
def test_a_restored_rank_continues_with_the_batches_of_an_uninterrupted_run(
        world: int, stop: int) -> None:
    whole = _uninterrupted(world, stop + 20)
    for r in range(world):
        first = _rank(r, world)
        for _ in range(stop + 4):  # workers read ahead: the state is at the batches taken
            first.next_key()
        state = first.state_dict(consumed=stop)
        again = _rank(r, world)
        again.load_state_dict(state)
        assert [again.next_key() for _ in range(20)] == whole[r][stop:]


@pytest.mark.parametrize("old, new, stop", [(2, 3, 1), (2, 3, 9), (3, 1, 4), (1, 2, 13),
                                            (4, 2, 4), (4, 3, 1)])
def test_a_job_restored_on_another_number_of_ranks_reads_exactly_the_rest(
        old: int, new: int, stop: int) -> None:
    before = [_rank(r, old) for r in range(old)]
    taken = [[s.next_key() for _ in range(stop)] for s in before]
    merged = merge_mixed_states([s.state_dict() for s in reversed(before)])
    epoch, read = merged["epoch"], merged["consumed"]
    after = [_rank(r, new) for r in range(new)]
    for s in after:
        s.load_state_dict(merged)
    rest = _global(epoch)[read:]
    steps = -(-len(rest) // new)
    keys = [[list(s.next_key()) for _ in range(steps)] for s in after]
    assert keys == [rest_of_pass(_global(epoch), read, r, new) for r in range(new)]
    # every batch of the rest once, then the pass's first batches fill the last step
    order = [keys[r][k] for k in range(steps) for r in range(new)]
    assert order == rest + _global(epoch)[:steps * new - len(rest)]
    # what the old ranks read is the pass's first ``read`` batches, step by step, rank by rank
    assert epoch == 0 and read == stop * old
    assert [list(taken[r][k]) for k in range(stop) for r in range(old)] == _global(0)[:read]
    # then the next pass, as an uninterrupted job on the new ranks reads it
    assert [list(s.next_key()) for s in after] == [
        lb.rank_batches(_global(epoch + 1), r, new)[0] for r in range(new)]


def test_another_streams_state_is_refused_quoting_both_values() -> None:
    state = _rank(0, 1).state_dict()
    with pytest.raises(StateDictError, match="seed 3 but this loader has 4"):
        _rank(0, 1, seed=4).load_state_dict(state)
    with pytest.raises(StateDictError, match="ragged False but this loader has True"):
        _rank(0, 1, ragged=True).load_state_dict(state)
    with pytest.raises(StateDictError, match="world size 1 but this loader has 2"):
        _rank(0, 2).load_state_dict(state)
    with pytest.raises(StateDictError, match="unknown keys"):
        _rank(0, 1).load_state_dict({**state, "extra": 1})
    states = [_rank(r, 2).state_dict() for r in range(2)]
    with pytest.raises(StateDictError, match="merge the state of every rank"):
        merge_mixed_states(states[:1])
    moved = _rank(1, 2)
    moved.next_key()
    with pytest.raises(StateDictError, match="not from one step of one job"):
        merge_mixed_states([states[0], moved.state_dict()])
