"""Run DeePMD-kit's own statistics code in its interpreter and read back what it printed, or
what its trainer saved."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import torch

from support.deepmd_env import require_deepmd_python

REPO = Path(__file__).resolve().parents[2]

#: DeePMD-kit's own ``dp``, for ``python -c`` in DeePMD-kit's interpreter
DEEPMD_DP = "import sys; from deepmd.main import main; main(sys.argv[1:])"


def run_job(cmd: list[str], cwd: Path, **env: str) -> str:
    """``cmd`` in ``cwd`` (one thread, no DataLoader workers, the cache in ``cwd``); its output.
    A failure fails the test with the output's tail."""
    full = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUM_WORKERS="0",
                MDLOADER_CACHE_DIR=str(cwd / "cache"), **env)
    proc = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr

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

#: DeePMD-kit's descriptor statistics (``compute_input_stats``) on every frame of the systems of
#: each case ``{"systems", "type_map", "kind": "se_e2_a"|"dpa1", "rcut", "rcut_smth", "sel",
#: "set_davg_zero", "exclude_types", "env_protection"}``: mean, stddev and the stat items.
ENV_MAT = r"""
import json, sys, logging
logging.disable(logging.WARNING)
import numpy as np, torch
from deepmd.utils.data import DeepmdData
from deepmd.pt.model.descriptor.se_a import DescrptSeA
from deepmd.pt.model.descriptor.dpa1 import DescrptDPA1
out = []
for case in json.loads(sys.argv[1])["cases"]:
    merged = []
    for path in case["systems"]:
        data = DeepmdData(path, type_map=case["type_map"])
        for set_dir in data.dirs:
            arrays = data._load_set(set_dir)
            nf = arrays["coord"].shape[0]
            frame = {"coord": torch.tensor(arrays["coord"]).reshape(nf, -1, 3),
                     "atype": torch.tensor(arrays["type"]).reshape(nf, -1)}
            if data.pbc:
                frame["box"] = torch.tensor(arrays["box"]).reshape(nf, 9)
            merged.append(frame)
    common = dict(set_davg_zero=case["set_davg_zero"], exclude_types=case["exclude_types"],
                  env_protection=case["env_protection"])
    if case["kind"] == "se_e2_a":
        desc = DescrptSeA(case["rcut"], case["rcut_smth"], case["sel"], **common)
        block = desc.sea
    else:
        desc = DescrptDPA1(case["rcut"], case["rcut_smth"], case["sel"],
                           len(case["type_map"]), **common)
        block = desc.se_atten
    block.compute_input_stats(merged)
    mean, std = block.get_stat_mean_and_stddev() if hasattr(block, "get_stat_mean_and_stddev") \
        else (block.mean, block.stddev)
    items = {k: [float(v.number), float(v.sum), float(v.squared_sum)]
             for k, v in block.get_stats().items()}
    out.append({"mean": mean.detach().cpu().numpy().tolist(),
                "stddev": std.detach().cpu().numpy().tolist(), "items": items})
print("RESULT " + json.dumps({"cases": out}))
"""

#: DeePMD-kit's ``compute_output_stats`` for energy on every frame of the systems of each case
#: ``{"systems", "type_map", "rcond", "preset"}``: bias and std.
OUTPUT = r"""
import json, sys, logging
logging.disable(logging.WARNING)
import numpy as np, torch
from deepmd.utils.data import DeepmdData
from deepmd.pt.utils.stat import compute_output_stats
out = []
for case in json.loads(sys.argv[1])["cases"]:
    ntypes = len(case["type_map"])
    merged = []
    for path in case["systems"]:
        data = DeepmdData(path, type_map=case["type_map"])
        data.add("energy", 1, atomic=False, must=False, high_prec=True)
        frames = [data._load_set(d) for d in data.dirs]
        energy = np.concatenate([f["energy"] for f in frames]).reshape(-1, 1)
        nf = energy.shape[0]
        item = {"energy": torch.tensor(energy), "find_energy": 1.0,
                "natoms": torch.tensor(np.tile(data.get_natoms_vec(ntypes), (nf, 1)))}
        # DeePMD-kit reads real_natoms_vec from every system when the first has it (a mix of
        # mixed-type and plain systems fails there); for a plain system it equals natoms
        item["real_natoms_vec"] = torch.tensor(
            np.concatenate([f["real_natoms_vec"] for f in frames]) if data.mixed_type
            else np.tile(data.get_natoms_vec(ntypes), (nf, 1)))
        merged.append(item)
    preset = None if case["preset"] is None else {"energy": case["preset"]}
    bias, std = compute_output_stats(merged, ntypes, keys=["energy"], rcond=case["rcond"],
                                     preset_bias=preset)
    out.append({"bias": np.asarray(bias["energy"]).tolist(),
                "std": np.asarray(std["energy"]).tolist()})
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


SAVED_STATISTICS = ("min_nbor_dist", ".mean", ".stddev", "davg", "dstd", "out_bias", "out_std")


def saved_statistics(checkpoint: Path) -> dict[str, list]:
    """The statistics a DeePMD-kit checkpoint saved, by parameter name (tensors only: read with
    the tests' own torch, no launch of DeePMD-kit's interpreter)."""
    state = torch.load(checkpoint, weights_only=True, map_location="cpu")["model"]
    return {k: np.asarray(v.double()).tolist() for k, v in state.items()
            if any(w in k for w in SAVED_STATISTICS)}


def assert_statistics_equal(theirs: dict, ours: dict, *, neighbours: bool = True) -> None:
    """Two :func:`saved_statistics`: the same names, ``min_nbor_dist`` bit for bit (present
    unless ``neighbours`` is false), every other statistic within 1e-10 relative."""
    assert theirs.keys() == ours.keys()
    assert any("min_nbor_dist" in k for k in theirs) or not neighbours
    for key in theirs:
        x, y = np.asarray(theirs[key]), np.asarray(ours[key])
        if "min_nbor_dist" in key:
            assert x == y, key
        else:
            np.testing.assert_allclose(y, x, rtol=1e-10, atol=1e-12, err_msg=key)
