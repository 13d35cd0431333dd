"""``mdloader dp --pt train`` launched as a user launches it, with a spy on what it trains.

The spy runs ``mdloader dp`` in the DeePMD-kit interpreter and records, on every rank, the
task of each step and the batch it trained (``Trainer._next_training_batch``: the batch the
optimizer step uses, never a display-time or validation one) as ``[sid, fids]``, the most
child processes (DataLoader workers) the rank had at once, and every attribute of the trainer
that mdloader's code read or wrote (``touched``: ``[use, name]``), in ``spy.rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from support.deepmd_env import require_deepmd_python

REPO = Path(__file__).resolve().parents[2]

SPY = r'''
import glob, json, os, sys, threading, time
import numpy as np
import mdloader.integrations.deepmd as md
from mdloader.integrations.deepmd import seam
md.install()
trainer = sys.modules[seam.TRAINING].Trainer
tasks, drawn, touched = [], {}, set()
import mdloader
MDLOADER = os.path.dirname(os.path.abspath(mdloader.__file__))
def _by_mdloader():
    return sys._getframe(2).f_code.co_filename.startswith(MDLOADER + os.sep)
def _get(self, name):
    if _by_mdloader():
        touched.add(("read", name))
    return object.__getattribute__(self, name)
def _set(self, name, value):
    if _by_mdloader():
        touched.add(("write", name))
    object.__setattr__(self, name, value)
trainer.__getattribute__, trainer.__setattr__ = _get, _set
_next = trainer._next_training_batch
def _next_training_batch(self, task_key="Default"):
    batch = _next(self, task_key)
    tasks.append(task_key)
    if batch[2]:
        drawn.setdefault(task_key, []).append(
            [int(np.asarray(batch[2]["sid"]).reshape(-1)[0]),
             np.asarray(batch[2]["fid"]).reshape(-1).tolist()])
    return batch
trainer._next_training_batch = _next_training_batch
most = [0]
def _count_children():
    while True:
        pids = set()
        for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
            try:
                pids.update(open(path).read().split())
            except OSError:
                pass
        most[0] = max(most[0], len(pids))
        time.sleep(0.02)
threading.Thread(target=_count_children, daemon=True).start()
code = md.run_dp(sys.argv[1:])
with open(f"spy.rank{os.environ.get('RANK', '0')}.json", "w") as fh:
    json.dump({"tasks": tasks, "drawn": drawn, "most_children": most[0],
               "touched": sorted(touched)}, fh)
sys.exit(code)
'''


def dp_train(job: Path, config: dict[str, Any] | None, *extra: str, steps: int | None = None,
             world: int = 1, env: dict[str, str] | None = None,
             input_name: str = "input.json") -> str:
    """Run the spied ``mdloader dp --pt train`` in ``job`` on ``world`` ranks (``config``, with
    ``numb_steps`` = ``steps`` when given, is written first); returns the log."""
    job.mkdir(parents=True, exist_ok=True)
    if config is not None:
        if steps is not None:
            config["training"]["numb_steps"] = steps
        (job / input_name).write_text(json.dumps(config))
    (job / "spy.py").write_text(SPY)
    peer = require_deepmd_python()
    launch = ([peer] if world == 1 else
              [peer, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"])
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                "NUM_WORKERS": "0", **(env or {})}
    proc = subprocess.run([*launch, "spy.py", "--pt", "train", input_name,
                           "--skip-neighbor-stat", *extra], cwd=job, env=full_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def spied(job: Path, world: int = 1) -> list[dict[str, Any]]:
    """What each rank's spy recorded in the last launch in ``job``: ``tasks`` (one per step),
    ``drawn`` (by task, DeePMD-kit's ``Default`` for a single task), ``most_children`` and
    ``touched`` (the trainer's attributes mdloader's code read or wrote)."""
    return [json.loads((job / f"spy.rank{r}.json").read_text()) for r in range(world)]


def lcurve_rows(job: Path, after: int = -1) -> list[str]:
    """The ``lcurve.out`` rows of the steps after ``after`` (as text)."""
    rows = [line for line in (job / "lcurve.out").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return [line for line in rows if int(line.split()[0]) > after]
