"""The loader plan: computed once, read by the loader set, the samplers, check and the elastic
resume; a saved seed is adopted in one place, and a refused state changes nothing."""
from __future__ import annotations

from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from mdloader.cli.check import check_input, config_for_paths
from mdloader.errors import ConfigError, StateDictError
from mdloader.loading.loader import DpLoaderSet, get_validation_sampler, get_weighted_sampler
from mdloader.sampling.batching import batches_per_rank, resolve_batch_sizes
from mdloader.sampling.elastic import (
    continuation,
    job_seed,
    merge_rank_states,
    parse_generations,
)
from mdloader.sampling.order import weights_to_cdf
from mdloader.sampling.plan import LoaderPlan
from mdloader.sampling.probability import StyleRule, system_probabilities
from mdloader.sampling.samplers import WeightedSystemSampler
from mdloader.sampling.spec import SamplingSpec
from mdloader.testing import make_system
from mdloader.world import World

NATOMS = [6, 3, 12, 6, 200]
NFRAMES = [10, 7, 1, 16, 5]
STYLE = "prob_sys_size;0:2:0.5;2:5:0.5"
TYPE_MAP = ["O", "H"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    spec = [(6, 10), (3, 7), (12, 1), (6, 16)]       # (natoms, nframes)
    return [make_system(root, f"sys{i}", natoms=n, nframes=f, seed=i)
            for i, (n, f) in enumerate(spec)]


# -- the plan alone -------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_on_a_rank_grid(world):
    plan = LoaderPlan.build(NATOMS, NFRAMES, SamplingSpec("filter:100"), seed=7,
                            world_size=world).with_probabilities(STYLE)
    sizes = resolve_batch_sizes("filter:100", NATOMS)
    kept_frames = np.asarray(NFRAMES)[sizes.kept]
    nb = batches_per_rank(kept_frames, sizes.batch_sizes, world)
    assert plan.kept.tolist() == sizes.kept.tolist() == [0, 1, 2, 3]
    assert plan.natoms.tolist() == NATOMS[:4] and plan.nsys_original == 5
    assert plan.batch_sizes.tolist() == sizes.batch_sizes.tolist()
    assert plan.nbatches.tolist() == nb.tolist() and plan.total_batches == int(nb.sum())
    probs = system_probabilities(nb, STYLE, kept=sizes.kept, nsys_original=5)
    assert np.allclose(plan.probabilities, probs)
    assert np.array_equal(plan.cdf, weights_to_cdf(plan.probabilities))
    one = LoaderPlan.build(NATOMS, NFRAMES, SamplingSpec("filter:100"),
                           seed=7).with_probabilities(STYLE)
    assert np.array_equal(one.cdf_on(world), plan.cdf)
    for sid in range(plan.nsys):     # pass 0 over the ranks covers every frame
        served = {f for rank in range(world) for j in range(int(plan.nbatches[sid]))
                  for f in plan.frame_order(rank).fids(sid, j)}
        assert served == set(range(int(kept_frames[sid])))
    base = LoaderPlan.build(NATOMS, NFRAMES, SamplingSpec("filter:100"), seed=7,
                            world_size=world)
    samplers = [WeightedSystemSampler.of_plan(base, plan.rule, rank=r) for r in range(world)]
    for rank, sampler in enumerate(samplers):
        assert np.array_equal(sampler.plan.cdf, plan.cdf)
        assert sampler.weights.tolist() == plan.probabilities.tolist()
        assert sampler.order.seed == 7 and sampler.order.rank == rank
        assert sampler.plan.nframes is base.nframes     # read, not copied


def test_the_spec_is_taken_whole():
    spec = SamplingSpec(batch_size=(2, 3), sys_probs=(0.25, 0.75), shuffle=False,
                        balance_window=2, json_path="training.data_dict.a.training_data")
    plan = LoaderPlan.build([3, 4], [6, 9], spec, seed=1, world_size=2).with_spec_probabilities()
    assert plan.spec is spec and plan.batch_sizes.tolist() == [2, 3]
    assert (plan.shuffle, plan.same_system_across_ranks, plan.balance_window) == (False, False, 2)
    assert plan.probabilities.tolist() == [0.25, 0.75]
    assert spec.probability_source() == ([0.25, 0.75], True,
                                         "training.data_dict.a.training_data.sys_probs")
    with pytest.raises(ConfigError, match=r"training\.data_dict\.a\.training_data\.balance_window"
                       ": the balance window must be 0"):
        LoaderPlan.build([3, 4], [6, 9], SamplingSpec(balance_window=-1, json_path=spec.json_path),
                         seed=1)


def test_the_plan_is_frozen():
    plan = LoaderPlan.of_sizes([4, 5], [2, 2], seed=1, probabilities=[0.5, 0.5])
    with pytest.raises(FrozenInstanceError):
        plan.seed = 2  # type: ignore[misc]
    for array in (plan.nframes, plan.batch_sizes, plan.nbatches, plan.probabilities, plan.cdf):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0


def test_adopt_seed_returns_a_new_plan_and_refuses_a_given_seed():
    drawn = LoaderPlan.of_sizes([4, 5], [2, 2], seed=7, seed_given=False)
    adopted = drawn.adopt_seed(8, "sampler")
    assert (adopted.seed, drawn.seed) == (8, 7) and adopted.nframes is drawn.nframes
    assert drawn.adopt_seed(7) is drawn
    given = LoaderPlan.of_sizes([4, 5], [2, 2], seed=7)
    assert given.adopt_seed(7) is given
    with pytest.raises(StateDictError, match="cannot resume the sampler: the saved state has "
                       "seed 8 but this loader has 7"):
        given.adopt_seed(8, "sampler")
    for bad in ("8", -1, True, 2**64, 8.0):
        with pytest.raises(StateDictError, match=r"the saved seed must be an integer in "
                           r"\[0, 2\*\*64\), got "):
            drawn.adopt_seed(bad)


def test_plan_errors():
    cases = [
        (lambda: LoaderPlan.build([1, 2], [3, 4, 5], SamplingSpec(1, json_path="t.d"), seed=0),
         ConfigError, r"t\.d\.batch_size: 2 atom counts for 3 systems"),
        (lambda: LoaderPlan.build([1, 2], [3, 4], SamplingSpec(
            (1, 2, 3), json_path="training.training_data"), seed=0),
         ConfigError, r"training\.training_data\.batch_size: batch size list has 3 entries"),
        (lambda: LoaderPlan.build([1, 2], [3, 4], SamplingSpec(
            1, auto_prob="prob_sys_sze", json_path="training.training_data"),
            seed=0).with_spec_probabilities(),
         ConfigError, r"training\.training_data\.auto_prob: unknown probability style"),
        (lambda: LoaderPlan.build([1, 2], [3, 4], SamplingSpec(1, sys_probs=(1.0,), json_path="v"),
                                  seed=0).with_spec_probabilities(),
         ConfigError, r"v\.sys_probs: sys_probs has 1 entries but there are 2 systems"),
        (lambda: LoaderPlan.of_sizes([3, 4], [1, 1, 1], seed=0),
         ConfigError, "3 batch sizes for 2 systems"),
        (lambda: LoaderPlan.of_sizes([3, 4], [1, 1], seed=0, world_size=0),
         ConfigError, "world_size must be an integer >= 1, got 0"),
        (lambda: LoaderPlan([3, 4], [1, 1], 0, kept=[0]),
         ConfigError, "1 kept indices for 2 systems"),
        (lambda: LoaderPlan.of_sizes([3, 4], [1, 1], seed=0).probabilities,
         ConfigError, "this loader plan has no probabilities yet"),
        (lambda: LoaderPlan.of_sizes([3, 4], [1, 1], seed=0).cdf,
         ConfigError, "this loader plan has no probabilities yet"),
        (lambda: LoaderPlan.of_sizes([3, 4], [1, 1], seed=0).with_rule([0.5, 0.25, 0.25]),
         ConfigError, "3 probabilities for 2 systems"),
        (lambda: LoaderPlan.of_sizes([3, 4], [1, 1], seed=None).frame_order(0),
         ConfigError, "this loader plan has no seed"),
        (lambda: LoaderPlan.of_sizes([3, 4], [1, 1], seed=0, world_size=2).frame_order(2),
         ConfigError, r"rank must be in \[0, world_size\), got rank 2 of 2"),
        (lambda: job_seed(LoaderPlan.of_sizes([3], [1], seed=None)),
         StateDictError, "an elastic resume needs the job seed"),
    ]
    for make, error, match in cases:
        with pytest.raises(error, match=match):
            make()


# -- one plan drives the loader set and the sampler -----------------------------------------------
def test_the_loader_set_and_its_samplers_read_one_plan(paths):
    ls = DpLoaderSet(paths, "max:24", TYPE_MAP, seed=3, world=World(rank=1, world_size=2))
    plan = ls.plan
    assert ls.index == plan.nbatches.tolist() and ls.total_batch == plan.total_batches
    assert ls.batch_sizes is plan.batch_sizes and ls.nframes is plan.nframes
    assert ls.seed == plan.seed == 3 and ls.plan.seed_given
    sampler = get_weighted_sampler(ls, "prob_sys_size", num_samples=10)
    expected = plan.with_probabilities("prob_sys_size")
    assert sampler.weights.tolist() == expected.probabilities.tolist()
    assert np.array_equal(sampler.plan.cdf, expected.cdf)
    assert np.array_equal(ls.probabilities("prob_sys_size"), expected.probabilities)
    assert sampler.plan.nframes is plan.nframes and sampler.order.rank == 1
    assert [ls.frame_order.fids(0, j) for j in range(ls.index[0])] == \
        [plan.frame_order(1).fids(0, j) for j in range(ls.index[0])]
    assert len(ls.dataloaders[0]) == plan.nbatches[0]
    valid = get_validation_sampler(ls)
    assert valid.nframes.tolist() == plan.nframes.tolist() and valid.world_size == 2


def test_a_saved_seed_is_adopted_by_what_loads_it(paths):
    a = DpLoaderSet(paths, 2, TYPE_MAP)                       # seed=None: a drawn seed
    sa = get_weighted_sampler(a, "prob_uniform", num_samples=10)
    [sa.next_key() for _ in range(3)]
    loader_state, sampler_state = a.state_dict(), sa.state_dict()

    b = DpLoaderSet(paths, 2, TYPE_MAP)
    sb = get_weighted_sampler(b, "prob_uniform", num_samples=10)
    assert b.seed != a.seed
    sb.load_state_dict(sampler_state)                         # only the sampler loads a state
    assert sb.plan.seed == sb.order.seed == a.seed and not sb.plan.seed_given
    assert b.seed != a.seed                                   # the loader set keeps its own
    assert [sb.next_key() for _ in range(5)] == [sa.next_key() for _ in range(5)]

    c = DpLoaderSet(paths, 2, TYPE_MAP)
    c.load_state_dict(loader_state)                           # only the loader set loads one
    assert c.seed == a.seed and not c.plan.seed_given
    assert [x["fid"] for x in c.dataloaders[0]] == [x["fid"] for x in a.dataloaders[0]]


def test_a_refused_state_changes_nothing(paths):
    ls = DpLoaderSet(paths, 2, TYPE_MAP, seed=2)
    sampler = get_weighted_sampler(ls, "prob_uniform", num_samples=10)
    [sampler.next_key() for _ in range(2)]
    plan, before = ls.plan, sampler.state_dict()
    other = DpLoaderSet(paths, 2, TYPE_MAP, seed=3)
    other_sampler = get_weighted_sampler(other, "prob_uniform", num_samples=10)
    with pytest.raises(StateDictError, match="DpLoaderSet: the saved state has seed 3 but this "
                       "loader has 2"):
        ls.load_state_dict(other.state_dict())
    with pytest.raises(StateDictError, match="sampler: the saved state has seed 3 but this "
                       "loader has 2"):
        sampler.load_state_dict(other_sampler.state_dict())
    assert ls.plan is plan and sampler.state_dict() == before

    drawn = DpLoaderSet(paths, 2, TYPE_MAP)                   # would adopt a seed, but ...
    drawn_sampler = get_weighted_sampler(drawn, "prob_uniform", num_samples=10)
    [drawn_sampler.next_key() for _ in range(4)]
    plan, before = drawn.plan, drawn_sampler.state_dict()
    foreign = dict(other_sampler.state_dict(), nsys=5)        # ... another job's state
    with pytest.raises(StateDictError, match="number of systems 5 but this loader has 4"):
        drawn_sampler.load_state_dict(foreign)
    with pytest.raises(StateDictError, match="rank 1 but this loader has 0"):
        drawn.load_state_dict(dict(other.state_dict(), rank=1))
    with pytest.raises(StateDictError, match="1 cursor counts for 0 cursor systems"):
        drawn.load_state_dict(dict(other.state_dict(), cursor_counts=[3]))
    assert drawn.plan is plan and drawn_sampler.state_dict() == before


# -- check and the elastic resume read the plan ---------------------------------------------------
def test_checks_table_is_the_plan(paths):
    report = check_input(config_for_paths(paths, type_map=TYPE_MAP, batch_size="filter:10"))
    section = report.sections[0]
    natoms = [r.natoms for r in section.rows]
    nframes = [r.nframes for r in section.rows]
    plan = LoaderPlan.build(natoms, nframes, SamplingSpec(
        "filter:10", json_path="training.training_data"), seed=None).with_spec_probabilities()
    table = {i: (r.batch_size, r.batches, r.prob) for i, r in enumerate(section.rows)}
    assert table == {**{i: (None, None, None) for i in range(len(paths))},
                     **{int(i): (int(b), int(n), float(p)) for i, b, n, p in zip(
                         plan.kept, plan.batch_sizes, plan.nbatches, plan.probabilities)}}
    assert section.filtered == [paths[2]] and plan.kept.tolist() == [0, 1, 3]
    loader = DpLoaderSet(paths, "filter:10", TYPE_MAP, seed=0)
    assert loader.index == plan.nbatches.tolist()
    assert loader.probabilities("prob_sys_size").tolist() == plan.probabilities.tolist()


def test_the_elastic_resume_reads_the_plan():
    nframes, sizes = [12, 7, 30, 1, 8], [2, 3, 4, 1, 1]
    rule = StyleRule.of("prob_sys_size")
    plan = LoaderPlan.of_sizes(nframes, sizes, seed=5, probabilities=rule)
    assert job_seed(plan) == 5
    cdfs = {}
    for world in (1, 2, 4):  # prob_sys_size on the batch counts of one rank of ``world``
        nbatch = batches_per_rank(nframes, sizes, world)
        direct = weights_to_cdf(system_probabilities(nbatch, "prob_sys_size"))
        assert np.allclose(direct, np.cumsum(nbatch / nbatch.sum()))
        assert np.array_equal(plan.cdf_on(world), direct)
        cdfs[world] = direct
    assert not np.allclose(cdfs[1], cdfs[4])  # the world changes the draws
    old = [WeightedSystemSampler(nframes, sizes, rule, seed=5, rank=r, world_size=2)
           for r in range(2)]
    for sampler, steps in zip(old, (9, 14)):
        [sampler.next_key() for _ in range(steps)]
    state = merge_rank_states([s.state_dict() for s in old])
    new = WeightedSystemSampler(nframes, sizes, rule, seed=5, rank=1, world_size=3)
    new.load_state_dict(state)
    history = parse_generations(state["generations"])
    expected = continuation(new.plan, history, 1, 3)
    assert new.plan.world_size == 3 and new.order.seed == new.plan.seed == 5
    got = new.order.continuation
    assert got.generation == expected.generation == 1
    assert np.array_equal(got.pieces, expected.pieces) and len(got.pieces)
    assert set(got.pieces["rank"].tolist()) == {1}   # new rank 1 of 3 owns old rank 1 alone
    for sid in range(len(nframes)):
        assert np.array_equal(new.order.leftover(sid), expected.frames(sid, 5, nframes[sid]))
