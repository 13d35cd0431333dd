"""Exactly-once sharded validation: every frame on one rank, and RMSEs equal to one rank's."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from support.distributed_utils import run_ranks, values
from torch.utils.data import DistributedSampler

from mdloader import ShardedValidationSampler, reduce_sums
from mdloader.errors import ConfigError
from mdloader.loading.build import Section
from mdloader.loading.feed import Feed, StreamSpec
from mdloader.sampling.loop import TrainingLoop
from mdloader.sampling.spec import SamplingSpec
from mdloader.testing import make_system
from mdloader.train.job import LABELS
from mdloader.train.model import RadialPotential
from mdloader.train.validation import Validation, rmse_from_sums

SIZES = [5, 1, 12, 3, 7, 2, 9]
BATCHES = [2, 1, 4, 3, 1, 2, 5]


def _keys(world: int, sizes=SIZES, batches=BATCHES) -> list[list]:
    return [list(ShardedValidationSampler(sizes, batches, rank=r, world_size=world))
            for r in range(world)]


@pytest.mark.parametrize("world", range(1, 9))
def test_every_frame_once_per_pass(world: int) -> None:
    keys = _keys(world)
    served = Counter((k.sid, f) for rank in keys for k in rank for f in k.fids)
    assert served == Counter((s, f) for s, n in enumerate(SIZES) for f in range(n))
    per_rank = [sum(len(k.fids) for k in rank) for rank in keys]
    total = sum(SIZES)
    assert set(per_rank) <= {total // world, -(-total // world)}   # balanced, no padding
    for rank, rank_keys in enumerate(keys):
        sampler = ShardedValidationSampler(SIZES, BATCHES, rank=rank, world_size=world)
        assert len(rank_keys) == len(sampler) and sampler.num_frames == per_rank[rank]
        assert [k.step for k in rank_keys] == list(range(len(rank_keys)))
        assert all(1 <= len(k.fids) <= BATCHES[k.sid] for k in rank_keys)
        assert rank_keys == list(sampler), "every iter() is the same full pass"


def test_small_systems_spread_over_the_ranks() -> None:
    """A hundred 1-frame systems on 4 ranks: 25 frames each, not 100 on rank 0."""
    keys = _keys(4, [1] * 100, [1] * 100)
    assert [len(rank) for rank in keys] == [25, 25, 25, 25]


def test_distributed_sampler_would_repeat_frames() -> None:
    """What the padding of DistributedSampler does to a 5-frame system on 4 ranks."""
    padded = [i for r in range(4) for i in DistributedSampler(range(5), num_replicas=4, rank=r,
                                                              shuffle=False)]
    ours = [f for rank in _keys(4, [5], [1]) for k in rank for f in k.fids]
    assert len(padded) == 8 and sorted(ours) == [0, 1, 2, 3, 4]


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="2 batch sizes for 3 systems"):
        ShardedValidationSampler([1, 2, 3], [1, 1])
    with pytest.raises(ConfigError, match=r"rank must be in \[0, world_size\), got rank 2 of 2"):
        ShardedValidationSampler([1], [1], rank=2, world_size=2)


def _reduce(rank: int, world: int) -> dict[str, float]:
    return reduce_sums({"b": 0.1 * (rank + 1), "a": 1e16 if rank == 0 else 1.0})


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_reduce_sums_is_the_same_on_every_rank() -> None:
    out = values(run_ranks(_reduce, 3, timeout=60))
    expected = {"b": math.fsum([0.1 * r for r in (1, 2, 3)]), "a": math.fsum([1e16, 1.0, 1.0])}
    assert out == [expected] * 3 and list(out[0]) == ["b", "a"]
    assert expected["a"] == 1e16 + 2   # fsum keeps what a left-to-right float sum loses
    assert reduce_sums({"x": 2.5}) == {"x": 2.5}   # one process: the values themselves


@pytest.fixture(scope="module")
def valid_systems(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("valid")
    return [make_system(root, f"v{i}", natoms=4 + i, nframes=n, seed=20 + i,
                        keys=("energy", "force")) for i, n in enumerate([9, 1, 6, 4, 3])]


def _full_pass(rank: int, world: int, systems: list[str]) -> tuple[dict, list]:
    """One full validation pass of a seeded model; returns the result and the frames seen."""
    from mdloader.distributed.group import current_world

    section = Section.of(None, "validation", systems, type_map=["O", "H"])
    spec = SamplingSpec(2, json_path="training.validation_data")
    feed = Feed.build([StreamSpec(section, spec)], seed=3, world=current_world(), labels=LABELS,
                      num_workers=0, type_map=["O", "H"])
    feed.start(0, TrainingLoop())
    valid = Validation(feed, numb_btch=1)
    torch.manual_seed(0)
    model = RadialPotential(2, rcut=2.5, nbasis=4, hidden=(8,))
    seen = []

    def predict(batch: dict) -> tuple[dict, dict]:
        seen.extend((int(batch["sid"]), int(f)) for f in batch["fid"])
        out = model(batch["coord"], batch["atype"], batch["box"], create_graph=False)
        labels = {k: batch[k].to(torch.float64) for k in ("energy", "force")}
        return {k: v.detach() for k, v in out.items()}, labels

    with feed:
        result = valid.full(predict, step=1)
    return {"rmse_e": result.rmse_e, "rmse_f": result.rmse_f, "frames": result.frames}, seen


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_full_validation_over_ranks_equals_one_rank(valid_systems: list[str]) -> None:
    one, seen = _full_pass(0, 1, valid_systems)
    assert one["frames"] == 23 and sorted(seen) == sorted(
        (s, f) for s, n in enumerate([9, 1, 6, 4, 3]) for f in range(n))
    for world in (2, 4):
        outcomes = values(run_ranks(_full_pass, world, valid_systems, timeout=200))
        frames = Counter(f for _, rank_seen in outcomes for f in rank_seen)
        assert frames == Counter(seen), f"W={world}: a frame was skipped or repeated"
        for result, _ in outcomes:
            assert result["frames"] == 23
            for key in ("rmse_e", "rmse_f"):
                assert result[key] == pytest.approx(one[key], rel=1e-12, abs=0)


def test_rmse_from_sums() -> None:
    assert rmse_from_sums({"sse_e": 8.0, "frames": 2.0, "sse_f": 27.0, "force_terms": 3.0}) \
        == (2.0, 3.0)
