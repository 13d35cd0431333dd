"""An ``mdloader train`` run upgraded between two checkpoints continues exactly.

The checkpoints of ``tests/fixtures/legacy-states`` were written by the release before the feed
(loader state of version 3: ``loader`` and ``valid_loader``); restarted by this release, the run
trains the batches that release trained after them, and its last checkpoint holds the same
stream positions, validation included (with a seed, and without one: the saved seeds are
adopted).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mdloader.config.input_json import parse_config
from mdloader.loading import feed_state
from mdloader.testing import make_dataset
from mdloader.train.io import load_checkpoint
from mdloader.train.job import ModelOptions, train

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "legacy-states"
SMALL = ModelOptions(rcut=2.5, nbasis=4, hidden=(8,))


def _config(root: Path, seed: int | None) -> dict:
    make_dataset(root / "train", 3, nframes=10, seed=21)
    make_dataset(root / "valid", 2, nframes=6, seed=22)
    training = {"training_data": {"systems": [str(root / "train")], "batch_size": 2},
                "validation_data": {"systems": [str(root / "valid")], "batch_size": 1,
                                    "numb_btch": 2},
                "disp_freq": 1, "save_freq": 100, "numb_steps": 8}
    if seed is not None:
        training["seed"] = seed
    return {"model": {"type_map": ["O", "H"]}, "training": training,
            "learning_rate": {"start_lr": 1e-3, "stop_lr": 1e-3, "decay_steps": 100}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "seed"), [("seeded", 11), ("unseeded", None)])
def test_a_checkpoint_of_the_earlier_format_continues_exactly(tmp_path: Path, name: str,
                                                              seed: int | None) -> None:
    expected = json.loads((FIXTURES / f"train-{name}.json").read_text())
    cfg = parse_config(_config(tmp_path / "data", seed), base_dir=str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(FIXTURES / f"train-{name}.pt", out / "model.ckpt-3.pt")
    assert load_checkpoint(str(out / "model.ckpt-3.pt"))["version"] == 3
    result = train(cfg, output=str(out), num_workers=2, options=SMALL,
                   restart=str(out / "model.ckpt-3.pt"))
    trained = [[step, sid, list(fids)] for step, sid, fids in result.batches]
    assert trained == expected["batches"]
    final = load_checkpoint(str(out / "model.ckpt-8.pt"))["loader_state"]
    old = feed_state.from_training_checkpoint(
        {"step": 8, "world_size": 1, **expected["final"]})
    assert final["streams"] == old["streams"] and final["next_step"] == 8
