"""A ``mix:N`` stream of the feed on a database written by ``mdloader pack``'s writer: batches
as DeePMD-kit's LMDB dataset pads them, read by the pool (with and without workers), saved in
the feed's state and continued exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import mdloader
from mdloader.errors import ConfigError
from mdloader.loading.build import Section
from mdloader.loading.feed import Feed, StreamSpec
from mdloader.sampling.loop import TrainingLoop
from mdloader.sampling.spec import SamplingSpec
from mdloader.testing import make_lmdb, make_system
from mdloader.world import World

TYPE_MAP = ["O", "H"]


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Four systems of 3, 4, 5 and 6 atoms in one database."""
    root = tmp_path_factory.mktemp("mixed")
    systems = [make_system(root / "src", f"s{i}", natoms=3 + i, nframes=4 + i, seed=i)
               for i in range(4)]
    return make_lmdb(root / "train.lmdb", systems)


def _feed(database: str, workers: int, seed: int = 11) -> Feed:
    spec = StreamSpec(Section.of(None, "training", [database]),
                      SamplingSpec(batch_size="mix:20", json_path="training.training_data"))
    return Feed.build([spec], seed=seed, world=World(), labels=[], num_workers=workers,
                      type_map=TYPE_MAP)


def _draw(feed: Feed, count: int) -> list[dict]:
    stream = feed.stream(None, "training")
    out = []
    for _ in range(count):
        with feed.training_step():
            out.append(next(stream))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_the_feed_reads_deepmds_padded_mix_batches_and_continues_them_exactly(
        database: str, workers: int) -> None:
    loop = TrainingLoop(displays=False)
    with _feed(database, workers) as feed:
        feed.start(0, loop)
        whole = _draw(feed, 14)
    reader = mdloader.LmdbDataReader(database, TYPE_MAP, "mix:20")
    batches = mdloader.LmdbBatchSampler(reader, seed=11).batches()  # DeePMD-kit's pass 0
    for batch, frames in zip(whole, batches):
        expected = reader.decode_batch(frames)
        assert batch["fid"] == expected["fid"]
        for key in ("coord", "atype", "box"):
            assert torch.is_tensor(batch[key]) and batch[key].device.type == "cpu"
            np.testing.assert_array_equal(batch[key].numpy(), expected[key])
    assert any(bool((b["atype"] == -1).any()) for b in whole), "no padded batch"
    for b in whole:  # a padded slot is -1 in atype and zero in the coordinates
        phantom = b["atype"] == -1
        assert not b["coord"].reshape(*phantom.shape, 3)[phantom].any()
    assert all(b["atype"].shape[0] * b["atype"].shape[1] <= 20 or b["atype"].shape[0] == 1
               for b in whole)
    with _feed(database, workers) as feed:
        feed.start(0, loop)
        _draw(feed, 5)
        state = feed.gather_state()
    assert state["streams"]["training"]["consumed"] == 5
    with _feed(database, workers) as feed:
        feed.start(5, loop, state)
        rest = _draw(feed, 9)
    assert [b["fid"] for b in rest] == [b["fid"] for b in whole[5:]]
    assert len(batches) < 14  # the run crossed into a second pass, in a new order
    assert [b["fid"] for b in whole[len(batches):]] != [b["fid"] for b in whole[:14 - len(batches)]]


def test_a_state_of_another_seed_is_refused(database: str) -> None:
    loop = TrainingLoop(displays=False)
    with _feed(database, 0) as feed:
        feed.start(0, loop)
        _draw(feed, 2)
        state = feed.gather_state()
    with _feed(database, 0, seed=12) as feed, pytest.raises(Exception, match="seed"):
        feed.start(2, loop, state)


def test_mix_reads_one_lmdb_database_and_names_the_key(tmp_path: Path) -> None:
    system = make_system(tmp_path, "npy", natoms=3, nframes=2)
    spec = StreamSpec(Section.of(None, "training", [system]),
                      SamplingSpec(batch_size="mix:20", json_path="training.training_data"))
    with pytest.raises(ConfigError, match=r"^training\.training_data\.batch_size: mix:N "
                                          r"batches frames .* from one LMDB database"):
        Feed.build([spec], seed=1, world=World(), labels=[], num_workers=0)


def test_a_display_stream_of_a_mix_stream_draws_its_own_order(database: str) -> None:
    """A multi-task display draws from a stream of its own: the same database and rule under
    the display seed, saved beside the training stream."""
    from mdloader.sampling.mixed import MixedBatchSampler
    from mdloader.sampling.tasks import display_stream_seed

    with _feed(database, 0) as feed:
        feed.add_display_streams()
        training, display = feed.stream(None, "training"), feed.stream(None, "display")
        assert isinstance(display.sampler, MixedBatchSampler)
        assert display.dataset is training.dataset
        assert display.sampler.seed == display_stream_seed(training.sampler.seed)
        assert display.sampler.pass_batches(0) != training.sampler.pass_batches(0)
        feed.start(0, TrainingLoop(displays=False))
        _draw(feed, 2)
        state = feed.gather_state()
    assert state["streams"]["display"]["seed"] == display.sampler.seed
