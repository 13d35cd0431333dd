"""An ``mdloader dp`` run upgraded between two checkpoints continues exactly.

The loader states of ``tests/fixtures/legacy-states`` were written beside DeePMD-kit's
checkpoint of step 3 by the release before the feed (``mdloader-deepmd-loader-state`` of
version 1); a run of this release restarted from such a checkpoint trains, step for step and
task for task, the batches that release trained when restarted from it, and its next loader
state holds the same stream positions: single-task, multi-task, and a multi-task job without a
seed (the saved schedule seed and stream seeds are adopted).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.deepmd_inputs import make_task_data, multi_task_input, single_task_input
from support.deepmd_spy import dp_train, spied

from mdloader.loading import feed_state

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "legacy-states"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_task_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def checkpoints(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """DeePMD-kit's checkpoint of step 3 of each model (the weights do not choose a batch: the
    multi-task one serves the job without a seed too)."""
    jobs = {}
    for name, make in (("single", single_task_input), ("multi", multi_task_input)):
        jobs[name] = tmp_path_factory.mktemp(name)
        dp_train(jobs[name], make(data), steps=3)
    return jobs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["single", "multi", "multi-unseeded"])
def test_a_loader_state_of_the_earlier_format_continues_exactly(
        data: Path, checkpoints: dict[str, Path], tmp_path: Path, name: str) -> None:
    config = single_task_input(data) if name == "single" else multi_task_input(data)
    if name.endswith("unseeded"):
        del config["training"]["seed"]
    expected = json.loads((FIXTURES / f"deepmd-{name}.json").read_text())
    job = tmp_path / "job"
    shutil.copytree(checkpoints[name.split("-")[0]], job, symlinks=True)
    shutil.copy(FIXTURES / f"deepmd-{name}.mdloader", job / "model.ckpt-3.pt.mdloader")
    log = dp_train(job, config, "--restart", "model.ckpt.pt", steps=6)
    assert "restored the loader state" in log
    (run,) = spied(job)
    assert (run["tasks"], run["drawn"]) == (expected["tasks"], expected["drawn"])
    final = feed_state.read_beside(job / "model.ckpt-6.pt")
    old = feed_state.read(expected["final"])
    assert final is not None and final["streams"] == old["streams"]
    assert final["next_step"] == old["next_step"] == 6
    if old["seed"] is not None:
        assert final["seed"] == old["seed"]
