"""Exact resume under DeePMD-kit's own trainer (``mdloader dp --pt train``).

A run stopped at step N and restarted from its checkpoint writes, after step N, the same
``lcurve.out`` rows as an uninterrupted run (a constant learning rate, so that ``numb_steps``
does not change the schedule). A checkpoint without a loader state restarts with a warning.
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


def _data(tmp_path: Path, name: str, seed: int) -> dict:
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


def multi_task_input(tmp_path: Path, tasks: tuple[str, ...] = ("a", "b")) -> dict:
    """A multi-head se_e2_a input sharing one descriptor, each head its own data."""
    head = {"type_map": "type_map_all", "descriptor": "shared_descriptor",
            "fitting_net": {"neuron": [8], "seed": 1}}
    return {"model": {"shared_dict": {"type_map_all": ["O", "H"],
                                      "shared_descriptor": DESCRIPTOR},
                      "model_dict": {t: dict(head) for t in tasks}},
            "learning_rate": LR, "loss_dict": dict.fromkeys(tasks, LOSS),
            "training": {"data_dict": {t: _data(tmp_path, t, 3 + i)
                                       for i, t in enumerate(tasks)},
                         "model_prob": dict.fromkeys(tasks, 1.0),
                         "seed": 7, "disp_freq": 1, "save_freq": 100}}


def train(job: Path, config: dict, steps: int, *extra: str, world: int = 1) -> str:
    """Write ``config`` with ``numb_steps`` = ``steps`` and run ``mdloader dp`` on it."""
    config["training"]["numb_steps"] = steps
    job.mkdir(parents=True, exist_ok=True)
    (job / "input.json").write_text(json.dumps(config))
    peer = require_deepmd_python()
    launch = ([peer] if world == 1 else
              [peer, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"])
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUM_WORKERS="0")
    proc = subprocess.run([*launch, "-m", "mdloader", "dp", "--pt", "train", "input.json",
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
