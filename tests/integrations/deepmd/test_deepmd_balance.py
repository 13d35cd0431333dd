"""Balanced steps under ``mdloader dp``: ``training_data.balance_window`` acts on DeePMD-kit's
trainer (taken out of the input before DeePMD-kit's strict check), on 2 gloo ranks under real
torchrun; a multi-task input under per-rank task draws is refused in one line before any set-up.
The bound itself, per task, is checked without a launch in tests/sampling/test_balanced_sampler.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support.deepmd_env import require_deepmd_python
from support.deepmd_inputs import make_task_data, multi_task_input, single_task_input
from support.deepmd_spy import dp_train, spied

from mdloader import DpLoaderSet, get_sampler_from_params
from mdloader.sampling.spec import SamplingSpec
from mdloader.sampling.tasks import task_stream_seed
from mdloader.testing import make_dataset
from mdloader.world import World

REPO = Path(__file__).resolve().parents[3]
K, STEPS, WORLD = 4, 8, 2

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _expected(root: Path, rank: int, balance_window: int, seed: int = 7,
              steps: int = STEPS) -> list[list]:
    """What ``mdloader train``'s streams give ``rank`` of 2 for the same seed: [sid, fids]."""
    spec = SamplingSpec(batch_size=1, balance_window=balance_window,
                        json_path="training.training_data")
    data = DpLoaderSet([str(root)], type_map=["O", "H"], seed=seed, spec=spec,
                       world=World(rank, WORLD))
    sampler = get_sampler_from_params(data, {}, num_workers=0)
    keys = [sampler.next_key() for _ in range(steps)]
    return [[key.sid, list(key.fids)] for key in keys]


@pytest.mark.timeout(400)
def test_two_ranks_train_the_balanced_batches_of_mdloader_train(tmp_path: Path) -> None:
    """Each rank trains the batches of ``mdloader train``'s balanced stream for the seed (not
    the unbalanced ones), and at every step of a window the ranks' batches cost within the
    window's bound: the step maxima exceed the step means by at most ``max - min`` cost."""
    root = tmp_path / "data"
    make_dataset(root, 6, natoms_range=(3, 24), nframes=6, seed=11)
    config = single_task_input(tmp_path)
    config["model"]["data_stat_nbatch"] = 1
    del config["training"]["validation_data"]
    config["training"]["training_data"] = {"systems": [str(root)], "batch_size": 1,
                                           "balance_window": K, "balance_cost": "atoms"}
    job = tmp_path / "job"
    dp_train(job, config, steps=STEPS, world=WORLD, env={"MDLOADER_CACHE_DIR": str(tmp_path)})
    drawn = [rank["drawn"]["Default"] for rank in spied(job, WORLD)]
    expected = [_expected(root, r, K) for r in range(WORLD)]
    assert drawn == expected
    assert drawn != [_expected(root, r, 0) for r in range(WORLD)]
    natoms = DpLoaderSet([str(root)], 1, ["O", "H"], seed=7, world=World(0, WORLD)).plan.natoms
    cost = np.array([[natoms[sid] for sid, _ in rank] for rank in drawn], dtype=np.float64)
    for w in range(STEPS // K):
        window = cost[:, w * K:(w + 1) * K]
        excess = window.max(axis=0).sum() - window.mean(axis=0).sum()
        assert excess <= natoms.max() - natoms.min(), w
    written = json.loads((job / "out.json").read_text())
    assert "balance_window" not in written["training"]["training_data"]


@pytest.mark.timeout(400)
def test_a_multi_task_job_with_the_same_task_on_every_rank_trains_balanced_steps(
        tmp_path: Path) -> None:
    """``MDLOADER_TASK_DRAW=same``: every rank trains the same task at each step, and each
    task's batches are its balanced stream's (the task folded into the seed)."""
    data = make_task_data(tmp_path / "data")
    for name in ("a", "b"):   # systems of different sizes, so that balancing has work to do
        make_dataset(data / f"train_{name}", 4, natoms_range=(3, 24), nframes=4, seed=21)
    config = multi_task_input(data)
    config["model"]["data_stat_nbatch"] = 1
    for name in ("a", "b"):
        config["training"]["data_dict"][name]["training_data"]["balance_window"] = K
    job = tmp_path / "job"
    dp_train(job, config, steps=STEPS, world=WORLD,
             env={"MDLOADER_CACHE_DIR": str(tmp_path), "MDLOADER_TASK_DRAW": "same"})
    ranks = spied(job, WORLD)
    assert ranks[0]["tasks"] == ranks[1]["tasks"]
    for task, drawn in ranks[0]["drawn"].items():
        steps = len(drawn)
        seed = task_stream_seed(7, task)
        assert [r["drawn"][task] for r in ranks] == [
            _expected(data / f"train_{task}", r, K, seed, steps) for r in range(WORLD)], task


def test_multi_task_balanced_steps_under_per_rank_draws_are_refused_before_any_set_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One line naming the key and the setting that allows it; ``check --for dp`` agrees."""
    from mdloader.cli.main import main

    config = multi_task_input(make_task_data(tmp_path / "data"))
    config["training"]["data_dict"]["b"]["training_data"]["balance_window"] = K
    (tmp_path / "input.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k != "MDLOADER_TASK_DRAW"}
    proc = subprocess.run([require_deepmd_python(), "-m", "mdloader", "dp", "--pt", "train",
                           "input.json"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("mdloader: error:")]
    assert errors == ["mdloader: error: training.data_dict.b.training_data.balance_window: "
                      "balanced steps of a multi-task job need the same task on every rank at "
                      "each step; set MDLOADER_TASK_DRAW=same (by default each rank draws its "
                      "own task, DeePMD-kit's rule, and a task's steps do not line up across "
                      "the ranks)"], out[-4000:]
    assert proc.returncode == 2 and "Traceback" not in out, out[-4000:]
    assert "neighbor" not in out.lower() and not (tmp_path / "out.json").exists(), out[-4000:]
    monkeypatch.delenv("MDLOADER_TASK_DRAW", raising=False)
    assert main(["check", str(tmp_path / "input.json"), "--for", "dp"]) == 2
