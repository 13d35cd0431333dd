"""One build per ``mdloader dp`` job, for every task, and joint statistics of a shared descriptor.

In process: :func:`~mdloader.loading.job.build_job` gives sections with equal requests one list.
End to end (DeePMD-kit's venv, ``torchrun`` at W = 2): a two-head se_e2_a input whose heads
share a descriptor with ``sel: "auto"`` over different data -- which DeePMD-kit cannot train,
the two heads' ``sel`` differ -- trains, with one ``sel`` for both and one build in the log.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from support.deepmd_env import require_deepmd_python

from mdloader.loading.job import JobSection, build_job
from mdloader.testing import make_dataset

REPO = Path(__file__).resolve().parents[3]
STEPS = 2


def test_sections_with_equal_requests_share_one_list(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", 3, nframes=4, seed=1)
    b = make_dataset(tmp_path / "b", 2, nframes=4, seed=2)
    sections = [JobSection.of("t1", "training", [str(tmp_path / "a")], None, ["O", "H"]),
                JobSection.of("t2", "training", [str(tmp_path / "a")], None, ["O", "H"]),
                JobSection.of("t2", "validation", [str(tmp_path / "b")], None, ["O", "H"])]
    job = build_job(sections, index_mode="off")
    assert job.view(sections[0]) is job.view(sections[1])
    assert [d.meta.address for d in job.view(sections[0])] == a
    assert [d.meta.address for d in job.view(sections[2])] == b
    assert job.find(str(tmp_path / "b"), None, ["O", "H"]) is job.view(sections[2])
    assert job.find(str(tmp_path / "c"), None, ["O", "H"]) is None


def _multitask_job(tmp_path: Path) -> Path:
    make_dataset(tmp_path / "sparse", 2, natoms_range=(3, 5), nframes=4, seed=1)
    make_dataset(tmp_path / "dense", 2, natoms_range=(20, 24), nframes=4, seed=2)
    head = {"type_map": "my_type_map", "descriptor": "my_descriptor",
            "fitting_net": {"neuron": [8], "seed": 1}}
    loss = {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
            "limit_pref_f": 1}
    config = {
        "model": {
            "shared_dict": {"my_type_map": ["O", "H"],
                            "my_descriptor": {"type": "se_e2_a", "sel": "auto",
                                              "rcut_smth": 0.5, "rcut": 4.0, "neuron": [4, 8],
                                              "axis_neuron": 4, "seed": 1}},
            "model_dict": {"sparse": dict(head), "dense": dict(head)}},
        "learning_rate": {"type": "exp", "decay_steps": 5, "start_lr": 1e-3, "stop_lr": 1e-5},
        "loss_dict": {"sparse": loss, "dense": loss},
        "training": {
            "model_prob": {"sparse": 0.5, "dense": 0.5},
            "data_dict": {t: {"training_data": {"systems": [str(tmp_path / t)], "batch_size": 1},
                              "validation_data": {"systems": [str(tmp_path / t)],
                                                  "batch_size": 1}}
                          for t in ("sparse", "dense")},
            "numb_steps": STEPS, "seed": 7, "disp_freq": 1, "save_freq": STEPS},
    }
    (tmp_path / "input.json").write_text(json.dumps(config))
    return tmp_path


def _run(cmd: list[str], cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUM_WORKERS="0")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(320)
def test_shared_auto_sel_over_different_data_trains_on_two_ranks(tmp_path: Path) -> None:
    peer = require_deepmd_python()
    job = _multitask_job(tmp_path)
    out = _run([peer, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "mdloader", "dp", "--pt", "train", "input.json"], job)
    # training and validation read the same systems in each task: two requests, one build
    assert out.count("job systems: one build of 4 sections (2 distinct requests") == 1
    assert re.search(r"(built|loaded) \d+ systems \(", out) is None  # no per-set build
    model = json.loads((job / "out.json").read_text())["model"]["model_dict"]
    sels = {t: model[t]["descriptor"]["sel"] for t in ("sparse", "dense")}
    assert sels["sparse"] == sels["dense"]  # one sel for the shared descriptor
    assert (job / f"model.ckpt-{STEPS}.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_single_task_builds_its_systems_once(tmp_path: Path) -> None:
    peer = require_deepmd_python()
    job = _multitask_job(tmp_path)
    config = json.loads((job / "input.json").read_text())
    shared = config["model"]["shared_dict"]
    data = config["training"]["data_dict"]
    config["model"] = {"type_map": shared["my_type_map"], "descriptor": shared["my_descriptor"],
                       "fitting_net": {"neuron": [8], "seed": 1}}
    config["loss"] = config.pop("loss_dict")["sparse"]
    config["training"] = {"training_data": data["sparse"]["training_data"],
                          "validation_data": data["dense"]["validation_data"],
                          "numb_steps": STEPS, "seed": 7, "disp_freq": 1, "save_freq": STEPS}
    (job / "input.json").write_text(json.dumps(config))
    out = _run([peer, "-m", "mdloader", "dp", "--pt", "train", "input.json"], job)
    # the neighbour statistics and both loader sets take their systems from one build
    assert out.count("job systems: one build of 2 sections (2 distinct requests") == 1
    assert re.search(r"(built|loaded) \d+ systems \(", out) is None
    assert (job / f"model.ckpt-{STEPS}.pt").exists()
