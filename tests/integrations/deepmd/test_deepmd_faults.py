"""Faults during DeePMD-kit's training under ``mdloader dp``, 2 gloo ranks under real torchrun:
every rank ends with the same one line naming the rank, the system and the file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.deepmd_env import require_deepmd_python

from mdloader.testing import make_system

REPO = Path(__file__).resolve().parents[3]
DEADLINE = 300.0  # a hang guard for the whole job, several times a run's length here
DESCRIPTOR = {"type": "se_e2_a", "sel": "auto", "rcut_smth": 0.5, "rcut": 4.0,
              "neuron": [4, 8], "axis_neuron": 4, "seed": 1}

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _input(root: Path) -> list[Path]:
    systems = [make_system(root / "data", f"sys{i}", natoms=6, nframes=400, seed=i,
                           keys=("energy", "force")) for i in range(2)]
    config = {
        "model": {"type_map": ["O", "H"], "descriptor": DESCRIPTOR,
                  "fitting_net": {"neuron": [8, 8], "seed": 1}},
        "learning_rate": {"type": "exp", "decay_steps": 50, "start_lr": 1e-3, "stop_lr": 1e-5},
        "loss": {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
                 "limit_pref_f": 1},
        "training": {"training_data": {"systems": [str(s) for s in systems], "batch_size": 1},
                     "numb_steps": 100000, "seed": 7, "disp_freq": 5, "save_freq": 100000},
    }
    (root / "input.json").write_text(json.dumps(config))
    return [Path(s) / "set.000" / "force.npy" for s in systems]


FAULTS = {
    "truncated": (lambda target: os.truncate(target, target.stat().st_size // 3),
                  "CorruptFileError: the npy file shrank while it was read"),
    "moved away": (lambda target: target.rename(target.with_name("away.npy")),
                   "MissingDataError: the npy file is gone (moved or deleted while it was read)"),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(FAULTS))
def test_a_force_file_changed_mid_training_is_one_line_on_every_rank(tmp_path: Path,
                                                                      case: str) -> None:
    """Truncated, it used to kill a DataLoader worker with SIGBUS (torch's shared-memory hint)
    and the other rank with gloo's "Connection closed by peer"; moved away, it trained on."""
    damage, said = FAULTS[case]
    peer = require_deepmd_python()
    targets = _input(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUM_WORKERS="1",
               MDLOADER_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen([peer, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", "-m", "mdloader", "dp", "--pt", "train",
                             "input.json"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    curve, start = tmp_path / "lcurve.out", time.monotonic()
    try:
        while not (curve.exists() and len(curve.read_text().splitlines()) > 3):
            assert proc.poll() is None, proc.stdout.read()[-4000:]  # type: ignore[union-attr]
            assert time.monotonic() - start < DEADLINE, "training never started"
            time.sleep(0.1)
        for target in targets:
            damage(target)
        fault = time.monotonic()
        out, _ = proc.communicate(timeout=DEADLINE)
        print(f"{case} under mdloader dp: every rank ended {time.monotonic() - fault:.1f} s "
              "after the fault")  # shown with -s
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the job did not end after the fault")
    errors = [line for line in out.splitlines() if line.startswith("mdloader: error:")]
    assert proc.returncode != 0 and len(errors) == 2 and errors[0] == errors[1], out[-4000:]
    assert said in errors[0], errors[0]
    assert "failed (DeePMD-kit's training)" in errors[0]
    assert any(f"file: {target}" in errors[0] for target in targets), errors[0]
    assert "Bus error" not in out and "shared memory" not in out, out[-4000:]
