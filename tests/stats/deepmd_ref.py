"""Run DeePMD-kit's own statistics code in its interpreter and read back what it printed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from deepmd_env import require_deepmd_python

REPO = Path(__file__).resolve().parents[2]

#: DeePMD-kit's neighbour statistics for each case ``{"systems", "type_map", "rcut",
#: "mixed_type"}``: per system ``[max counts, min squared distance as float.hex]`` and merged
#: ``min_nbor_dist`` (hex) and ``max_nbor_size``.
NEIGHBOURS = r"""
import json, os, sys, logging
logging.disable(logging.WARNING)
import numpy as np
from deepmd.utils.data_system import DeepmdDataSystem
from deepmd.pt.utils.neighbor_stat import NeighborStat
from deepmd.pt.utils.update_sel import UpdateSel
out = []
for case in json.loads(sys.argv[1])["cases"]:
    data = DeepmdDataSystem(case["systems"], 1, 1, rcut=None, type_map=case["type_map"])
    data.get_batch()
    ntypes = max(len(case["type_map"]), data.get_ntypes())
    stat = NeighborStat(ntypes, case["rcut"], mixed_type=case["mixed_type"])
    per = {}
    for mn, dt, jj in stat.iterator(data):
        key = os.path.dirname(str(jj).rstrip("/"))
        mn = np.asarray(mn).astype(int).tolist()
        if key in per:
            mn = np.maximum(mn, per[key][0]).tolist()
            dt = min(float(dt), float.fromhex(per[key][1]))
        per[key] = [mn, float(dt).hex()]
    dist, size = stat.get_stat(data)
    upd = UpdateSel()
    upd.get_nbor_stat = lambda *a, **k: (dist, size)  # the rule alone, on these statistics
    sels = {json.dumps(s): [int(v) for v in upd.update_one_sel(
        data, case["type_map"], case["rcut"], s, case["mixed_type"])[1]]
        for s in case.get("sels", [])}
    out.append({"systems": per, "min_nbor_dist": float(dist).hex(),
                "max_nbor_size": np.asarray(size).astype(int).tolist(), "sels": sels})
print("RESULT " + json.dumps({"cases": out}))
"""


def run(script: str, args: dict, *, timeout: float = 600) -> dict:
    """``script`` run by DeePMD-kit's interpreter with ``args`` as JSON; its ``RESULT`` line."""
    python = require_deepmd_python()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUM_WORKERS="0",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([python, "-c", script, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError((proc.stdout + proc.stderr)[-4000:])
    return json.loads(lines[-1][len("RESULT "):])
