"""The two system streams behind the weighted sampler, and who adopts a loaded seed.

A stream made from a plan serves exactly the sampler's keys, and seeks to any step as a fresh
one stepped there would stand; the strategy follows the plan's balance window. A seed loaded
from a state is adopted by what loads it (a sampler, a copied sampler, a loader set), and by
nothing else: no seed is pushed from one to another.
"""

from __future__ import annotations

import itertools
import pickle

import pytest

from mdloader.errors import StateDictError
from mdloader.loading.loader import DpLoaderSet, get_weighted_sampler
from mdloader.sampling.plan import LoaderPlan
from mdloader.sampling.probability import StyleRule
from mdloader.sampling.samplers import WeightedSystemSampler
from mdloader.sampling.spec import SamplingSpec
from mdloader.sampling.streams import BalancedStream, IndependentStream, stream_type
from mdloader.testing import make_system

NFRAMES = [12, 7, 30, 1, 8]
BSIZES = [2, 3, 4, 1, 1]
NATOMS = [3, 50, 9, 120, 7]
RULE = StyleRule.of("prob_sys_size")


def plan_of(world: int, window: int = 0, **kw) -> LoaderPlan:
    return LoaderPlan.of_sizes(NFRAMES, BSIZES, seed=5, world_size=world, natoms=NATOMS,
                               spec=SamplingSpec(balance_window=window), probabilities=RULE,
                               **kw)


@pytest.mark.parametrize(("window", "kind"), [(0, IndependentStream), (4, BalancedStream)])
def test_a_stream_serves_the_samplers_keys_and_seeks_anywhere(window, kind):
    world = 3
    for rank in range(world):
        plan = plan_of(world, window)
        assert stream_type(plan) is kind
        stream = kind(plan, plan.frame_order(rank), 0)
        sampler = WeightedSystemSampler(NFRAMES, BSIZES, RULE, seed=5, rank=rank,
                                        world_size=world, natoms=NATOMS, balance_window=window)
        keys = [stream.next_key() for _ in range(40)]
        assert keys == [sampler.next_key() for _ in range(40)]
        assert stream.step == sampler.position == 40
        assert all(k.drawer == rank for k in keys)
        for step in (17, 3, 33, 0, 39):
            stream.seek(step)
            assert [stream.next_key() for _ in range(40 - step)] == keys[step:]
        state = sampler.state_dict()
        assert set(stream.identity()) == ({"balance_window", "balance_cost_digest"} if window
                                          else set())
        assert all(state[key] == value for key, value in stream.identity().items())


# Recorded from the sampler before it delegated to the streams: (sid, fids, step, drawer) of the
# first 12 keys (one 8-step epoch and 4 steps into the next) of rank 1 of 2. Unbalanced keys
# never change; the balanced ones changed once, on purpose, with the stratified design.
GOLDEN_CONFIG = dict(nframes=[7, 5, 9, 4], batch_sizes=[2, 1, 3, 2], probs=[0.25] * 4, seed=11,
                     rank=1, world_size=2)
GOLDEN_KEYS = {
    0: [(3, (2, 0), 0, 1), (0, (5, 4), 1, 1), (0, (2, 1), 2, 1), (0, (0, 3), 3, 1),
        (2, (5, 6, 2), 4, 1), (2, (0, 4), 5, 1), (1, (4,), 6, 1), (2, (1, 3, 0), 7, 1),
        (3, (0, 3), 8, 1), (3, (3, 0), 9, 1), (1, (2,), 10, 1), (1, (3,), 11, 1)],
    # balanced (re-recorded for the stratified design): each window of 2 steps takes one
    # system of the cheap half (sids 1, 0) and one of the dear half (sids 2, 3), in either order
    2: [(3, (2, 0), 0, 1), (1, (4,), 1, 1), (0, (5, 4), 2, 1), (2, (5, 6, 2), 3, 1),
        (2, (0, 4), 4, 1), (1, (2,), 5, 1), (3, (0, 3), 6, 1), (0, (2, 1), 7, 1),
        (1, (3,), 8, 1), (2, (1, 3, 0), 9, 1), (0, (0, 3), 10, 1), (2, (6, 4), 11, 1)],
}


@pytest.mark.parametrize("window", sorted(GOLDEN_KEYS))
def test_the_sampler_draws_the_keys_it_drew_before_the_streams(window):
    def plain(key):
        return (int(key.sid), tuple(int(f) for f in key.fids), int(key.step), int(key.drawer))

    extra = dict(balance_window=window, natoms=[3, 5, 2, 4]) if window else {}
    sampler = WeightedSystemSampler(**GOLDEN_CONFIG, **extra)
    assert [plain(sampler.next_key()) for _ in range(12)] == GOLDEN_KEYS[window]
    epoch = [plain(k) for k in itertools.islice(iter(WeightedSystemSampler(**GOLDEN_CONFIG,
                                                                           **extra)), 12)]
    assert epoch == GOLDEN_KEYS[window][:8]


def test_each_stream_refuses_the_other_strategys_state():
    plain = WeightedSystemSampler(NFRAMES, BSIZES, RULE, seed=5, natoms=NATOMS)
    balanced = WeightedSystemSampler(NFRAMES, BSIZES, RULE, seed=5, natoms=NATOMS,
                                     balance_window=4)
    with pytest.raises(StateDictError, match="the saved state has balance window 4 but this "
                       r"loader has 0 \(training_data.balance_window, balance_cost\)"):
        plain.load_state_dict(balanced.state_dict())
    with pytest.raises(StateDictError, match="the saved state has balance window 0 but this "
                       "loader has 4"):
        balanced.load_state_dict(plain.state_dict())


def test_a_copied_sampler_still_hears_an_adopted_seed():
    sampler = WeightedSystemSampler(NFRAMES, BSIZES, RULE, seed=5, adopt_seed=True)
    [sampler.next_key() for _ in range(6)]
    other = WeightedSystemSampler(NFRAMES, BSIZES, RULE, seed=77, adopt_seed=True)
    [other.next_key() for _ in range(4)]
    copy = pickle.loads(pickle.dumps(sampler))
    assert copy.next_key() == sampler.next_key()
    copy.load_state_dict(other.state_dict())
    assert copy.order.seed == copy.plan.seed == 77 and copy.position == 4
    assert copy.next_key() == other.next_key()
    assert sampler.plan.seed == 5                                  # the original is its own


def test_a_seed_loaded_into_the_loader_set_is_the_sets_alone(tmp_path):
    paths = [make_system(tmp_path, f"sys_{i}", natoms=3 + i, nframes=5 + i) for i in range(3)]
    a = DpLoaderSet(paths, 2, ["O", "H"], seed=21)
    b = DpLoaderSet(paths, 2, ["O", "H"])                          # a drawn seed
    sampler = get_weighted_sampler(b, "prob_uniform", num_samples=10)
    drawn = b.seed
    assert b.frame_order.seed == drawn != 21
    b.load_state_dict(a.state_dict())
    assert b.seed == b.frame_order.seed == 21 and sampler.order.seed == drawn
    assert [x["fid"] for x in b.dataloaders[0]] == [x["fid"] for x in a.dataloaders[0]]
    again = pickle.loads(pickle.dumps(b))                          # a worker's copy of the set
    assert again.sampler is None and again.frame_order.seed == 21
    again.load_state_dict(DpLoaderSet(paths, 2, ["O", "H"], seed=33).state_dict())
    assert again.frame_order.seed == again.seed == 33 and b.seed == 21
