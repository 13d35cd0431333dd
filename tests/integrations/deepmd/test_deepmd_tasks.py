"""mdloader's multi-task schedule under DeePMD-kit's own trainer (``mdloader dp``).

A two-head se_e2_a input shares one descriptor; a spy records the task DeePMD-kit's loop trained
at every step on every rank. Two launches train the same tasks; ``num_epoch_dict`` targets are
met exactly.
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

SPY = r'''
import json, os, sys
import mdloader.integrations.deepmd as md
from mdloader.integrations.deepmd.training import SCHEDULED_TASKS
chosen = []
_choice = SCHEDULED_TASKS.choice
def choice(*a, **k):
    task = _choice(*a, **k)
    chosen.append(int(task))
    return task
SCHEDULED_TASKS.choice = choice
code = md.run_dp(sys.argv[1:])
with open(f"tasks.rank{os.environ.get('RANK', '0')}.json", "w") as fh:
    json.dump({"tasks": chosen, "keys": ["a", "b"], "steps": len(chosen)}, fh)
sys.exit(code)
'''


def _head() -> dict:
    return {"type_map": "type_map_all", "descriptor": "shared_descriptor",
            "fitting_net": {"neuron": [8], "seed": 1}}


def multitask_job(tmp_path: Path, training: dict) -> Path:
    """A two-head ``dp --pt train`` job on 4-frame systems, each head its own data."""
    for name in ("a", "b"):
        make_dataset(tmp_path / f"data_{name}", 2, nframes=4, seed=len(name) + ord(name))
    data = {name: {"training_data": {"systems": [str(tmp_path / f"data_{name}")],
                                     "batch_size": 1}} for name in ("a", "b")}
    loss = {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
            "limit_pref_f": 1}
    config = {
        "model": {"shared_dict": {"type_map_all": ["O", "H"],
                                  "shared_descriptor": {"type": "se_e2_a", "sel": [12, 24],
                                                        "rcut_smth": 0.5, "rcut": 4.0,
                                                        "neuron": [4, 8], "axis_neuron": 4,
                                                        "seed": 1}},
                  "model_dict": {"a": _head(), "b": _head()}},
        "learning_rate": {"type": "exp", "decay_steps": 5, "start_lr": 1e-3, "stop_lr": 1e-3},
        "loss_dict": {"a": loss, "b": loss},
        "training": {"data_dict": data, "seed": 7, "disp_freq": 1, "save_freq": 100,
                     **training},
    }
    (tmp_path / "input.json").write_text(json.dumps(config))
    (tmp_path / "spy.py").write_text(SPY)
    return tmp_path


def _train(job: Path, world: int, **env: str) -> list[dict]:
    peer = require_deepmd_python()
    launch = ([peer] if world == 1 else
              [peer, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"])
    full_env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUM_WORKERS="0",
                    **env)
    proc = subprocess.run([*launch, "spy.py", "--pt", "train", "input.json",
                           "--skip-neighbor-stat"], cwd=job, env=full_env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads((job / f"tasks.rank{r}.json").read_text()) for r in range(world)]


def _lcurve(job: Path) -> list[str]:
    return [line for line in (job / "lcurve.out").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_two_launches_train_the_same_tasks_and_write_the_same_lcurve(tmp_path: Path) -> None:
    runs = []
    for launch in ("first", "second"):
        job = multitask_job(tmp_path / launch, {"numb_steps": 8,
                                                "model_prob": {"a": 0.5, "b": 0.5}})
        runs.append((_train(job, 2), _lcurve(job)))
    (first, first_curve), (second, second_curve) = runs
    assert [r["tasks"] for r in first] == [r["tasks"] for r in second]
    assert first_curve == second_curve
    assert all(len(r["tasks"]) == 8 for r in first)
    assert first[0]["tasks"] != first[1]["tasks"]  # per-rank draws by default


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_num_epoch_dict_targets_are_met_exactly(tmp_path: Path) -> None:
    # 2 systems x 4 frames, batch 1: 8 batches per epoch; 0.375 and 0.25 epochs: 3 and 2 steps
    job = multitask_job(tmp_path, {"num_epoch_dict": {"a": 0.375, "b": 0.25}})
    (run,) = _train(job, 1)
    assert run["steps"] == 5
    counts = {key: run["tasks"].count(i) for i, key in enumerate(run["keys"])}
    assert counts == {"a": 3, "b": 2}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_same_task_on_every_rank_on_request(tmp_path: Path) -> None:
    job = multitask_job(tmp_path, {"numb_steps": 6, "model_prob": {"a": 0.5, "b": 0.5}})
    ranks = _train(job, 2, MDLOADER_TASK_DRAW="same")
    assert ranks[0]["tasks"] == ranks[1]["tasks"]


def test_schedule_of_reads_deepmd_kit_training_section(monkeypatch: pytest.MonkeyPatch) -> None:
    from mdloader.errors import ConfigError, MdloaderError
    from mdloader.integrations.deepmd.training import ScheduledTasks, schedule_of

    monkeypatch.delenv("MDLOADER_TASK_DRAW", raising=False)
    drawn = schedule_of({"seed": 7}, [0.25, 0.75], 10)
    assert (drawn.seed, drawn.window, drawn.same_task_across_ranks) == (7, 0, False)
    exact = schedule_of({"seed": None, "num_epoch_dict": {"a": 1, "b": 1}}, [0.6, 0.4], 5)
    assert (exact.seed, exact.window) == (0, 5)
    assert exact.counts(0, 0, 5).tolist() == [3, 2]
    monkeypatch.setenv("MDLOADER_TASK_DRAW", "same")
    assert schedule_of({"seed": 7}, [0.5, 0.5], 4).same_task_across_ranks
    monkeypatch.setenv("MDLOADER_TASK_DRAW", "both")
    with pytest.raises(ConfigError, match="MDLOADER_TASK_DRAW"):
        schedule_of({"seed": 7}, [0.5, 0.5], 4)
    with pytest.raises(MdloaderError, match="outside Trainer.run"):
        ScheduledTasks().choice(2, p=[0.5, 0.5])
