"""Exact resume and a stream per task under DeePMD-kit's own trainer (``mdloader dp``).

A run stopped at step N and restarted from its checkpoint writes, after step N, the same
``lcurve.out`` rows as an uninterrupted run (a constant learning rate, so that ``numb_steps``
does not change the schedule). A checkpoint without a loader state restarts with a warning.
Each task draws its own stream: adding a task leaves another task's batches unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.deepmd_env import require_deepmd_python

from mdloader.testing import make_dataset

REPO = Path(__file__).resolve().parents[3]

LOSS = {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
        "limit_pref_f": 1}
DESCRIPTOR = {"type": "se_e2_a", "sel": [12, 24], "rcut_smth": 0.5, "rcut": 4.0,
              "neuron": [4, 8], "axis_neuron": 4, "seed": 1}
LR = {"type": "exp", "decay_steps": 5, "start_lr": 1e-3, "stop_lr": 1e-3}


SPY = r'''
import json, sys
import numpy as np
import mdloader.integrations.deepmd as md
from mdloader.integrations.deepmd import seam
md.install()
trainer = sys.modules[seam.TRAINING].Trainer
drawn = {}
_get_data = trainer.get_data
def get_data(self, is_train=True, task_key="Default"):
    batch = _get_data(self, is_train, task_key)
    if is_train and batch[2]:
        key = [int(np.asarray(batch[2]["sid"]).reshape(-1)[0]),
               np.asarray(batch[2]["fid"]).reshape(-1).tolist()]
        drawn.setdefault(task_key, []).append(key)
    return batch
trainer.get_data = get_data
code = md.run_dp(sys.argv[1:])
with open("drawn.json", "w") as fh:
    json.dump(drawn, fh)
sys.exit(code)
'''


def _data(tmp_path: Path, name: str, seed: int) -> dict:
    if not (tmp_path / f"train_{name}").exists():
        make_dataset(tmp_path / f"train_{name}", 2, nframes=4, seed=seed)
        make_dataset(tmp_path / f"valid_{name}", 1, nframes=4, seed=seed + 50)
    return {"training_data": {"systems": [str(tmp_path / f"train_{name}")], "batch_size": 1},
            "validation_data": {"systems": [str(tmp_path / f"valid_{name}")], "batch_size": 1,
                                "numb_btch": 2}}


def single_task_input(tmp_path: Path) -> dict:
    """A one-head se_e2_a input on 4-frame systems, with validation data."""
    return {"model": {"type_map": ["O", "H"], "descriptor": DESCRIPTOR,
                      "fitting_net": {"neuron": [8], "seed": 1}},
            "learning_rate": LR, "loss": LOSS,
            "training": {**_data(tmp_path, "a", 3), "seed": 7, "disp_freq": 1,
                         "save_freq": 100}}


def multi_task_input(tmp_path: Path, tasks: tuple[str, ...] = ("a", "b"),
                     data: dict[str, str] | None = None) -> dict:
    """A multi-head se_e2_a input sharing one descriptor, each head its own data (or the data
    ``data`` names for it)."""
    data = data or {}
    head = {"type_map": "type_map_all", "descriptor": "shared_descriptor",
            "fitting_net": {"neuron": [8], "seed": 1}}
    return {"model": {"shared_dict": {"type_map_all": ["O", "H"],
                                      "shared_descriptor": DESCRIPTOR},
                      "model_dict": {t: dict(head) for t in tasks}},
            "learning_rate": LR, "loss_dict": dict.fromkeys(tasks, LOSS),
            "training": {"data_dict": {t: _data(tmp_path, data.get(t, t), 3 + i)
                                       for i, t in enumerate(tasks)},
                         "model_prob": dict.fromkeys(tasks, 1.0),
                         "seed": 7, "disp_freq": 1, "save_freq": 100}}


def train(job: Path, config: dict, steps: int, *extra: str, world: int = 1,
          spy: bool = False) -> str:
    """Write ``config`` with ``numb_steps`` = ``steps`` and run ``mdloader dp`` on it (``spy``:
    recording each task's training batches in ``drawn.json``)."""
    config["training"]["numb_steps"] = steps
    job.mkdir(parents=True, exist_ok=True)
    (job / "input.json").write_text(json.dumps(config))
    (job / "spy.py").write_text(SPY)
    peer = require_deepmd_python()
    launch = ([peer] if world == 1 else
              [peer, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"])
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUM_WORKERS="0")
    command = ["spy.py"] if spy else ["-m", "mdloader", "dp"]
    proc = subprocess.run([*launch, *command, "--pt", "train", "input.json",
                           "--skip-neighbor-stat", *extra], cwd=job, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def rows_after(job: Path, step: int) -> list[str]:
    """The ``lcurve.out`` rows of the steps after ``step`` (as text)."""
    rows = [line for line in (job / "lcurve.out").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return [line for line in rows if int(line.split()[0]) > step]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_restart_continues_the_streams_of_an_uninterrupted_run(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    train(whole, single_task_input(tmp_path), 6)
    parts = tmp_path / "parts"
    train(parts, single_task_input(tmp_path), 3)
    assert (parts / "model.ckpt-3.pt.mdloader").is_file()
    assert (parts / "model.ckpt.pt").is_symlink()
    log = train(parts, single_task_input(tmp_path), 6, "--restart", "model.ckpt.pt")
    assert "restored the loader state" in log
    assert rows_after(parts, 3) == rows_after(whole, 3)
    assert len(rows_after(whole, 3)) == 3
    # a checkpoint without loader state (plain dp) restarts with the data from the start
    (parts / "model.ckpt-6.pt.mdloader").unlink()
    log = train(parts, single_task_input(tmp_path), 7, "--restart", "model.ckpt-6.pt")
    assert log.count("no mdloader loader state beside it") == 1


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_multi_task_restart_on_two_ranks_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    train(whole, multi_task_input(tmp_path), 6, world=2)
    parts = tmp_path / "parts"
    train(parts, multi_task_input(tmp_path), 3, world=2)
    assert (parts / "model.ckpt-3.pt.mdloader").is_file()
    train(parts, multi_task_input(tmp_path), 6, "--restart", "model.ckpt.pt", world=2)
    assert rows_after(parts, 3) == rows_after(whole, 3)
    assert len(rows_after(whole, 3)) == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adding_a_task_leaves_another_tasks_batches_unchanged(tmp_path: Path) -> None:
    two = tmp_path / "two"
    train(two, multi_task_input(tmp_path), 4, spy=True)
    three = tmp_path / "three"
    train(three, multi_task_input(tmp_path, ("a", "b", "c"), data={"c": "a"}), 4, spy=True)
    before = json.loads((two / "drawn.json").read_text())
    after = json.loads((three / "drawn.json").read_text())
    for task in ("a", "b"):
        common = min(len(before[task]), len(after[task]))
        assert common >= 4
        assert after[task][:common] == before[task][:common]
    # c trains on a's systems, from a stream of its own
    common = min(len(after["a"]), len(after["c"]))
    assert after["c"][:common] != after["a"][:common]


def test_a_tasks_seed_folds_in_its_key_and_a_single_task_keeps_the_job_seed() -> None:
    from mdloader.integrations.deepmd.systems import task_seed
    from mdloader.sampling.tasks import task_stream_seed

    assert task_seed([1, 7], "a") == [1, task_stream_seed(7, "a")]
    assert task_seed(7, "a") == task_stream_seed(7, "a")
    assert task_stream_seed(7, "a") != task_stream_seed(7, "b")
    assert task_stream_seed(7, "a") != task_stream_seed(8, "a")
    assert task_seed(None, "a") is None


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_state_of_two_ranks_restarts_on_one(tmp_path: Path) -> None:
    job = tmp_path / "job"
    train(job, single_task_input(tmp_path), 3, world=2)
    state = json.loads((job / "model.ckpt-3.pt.mdloader").read_text())
    assert state["world_size"] == 2 and state["step"] == 2
    assert set(state["streams"]) == {"training", "validation"}
    log = train(job, single_task_input(tmp_path), 5, "--restart", "model.ckpt.pt")
    assert "restored the loader state" in log
    assert [int(row.split()[0]) for row in rows_after(job, 3)] == [4, 5]
