"""Neighbour statistics: mdloader's (vesin) against DeePMD-kit's (all pairs), same data, one run.

Generates water-like systems (192 atoms, O:H 1:2, density of water, unwrapped coordinates) into
a temporary folder, times ``system_neighbour_stats`` over them here, and DeePMD-kit's
``UpdateSel().get_nbor_stat`` in DeePMD-kit's interpreter (``--deepmd-python``, default:
``$MDLOADER_DEEPMD_PYTHON`` or ``.venv-deepmd``), checks both give the same numbers and prints
both times and their ratio.

    python benchmarks/statistics/neighbours.py --systems 20 --frames 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import REPO
from benchmarks.data import water_like

DEEPMD = r"""
import json, sys, time, logging
logging.disable(logging.WARNING)
import torch
torch.set_num_threads(int(sys.argv[2]))
from deepmd.utils.data_system import DeepmdDataSystem
from deepmd.pt.utils.update_sel import UpdateSel
args = json.loads(sys.argv[1])
start = time.perf_counter()
data = DeepmdDataSystem(args["systems"], 1, 1, rcut=None, type_map=["O", "H"])
dist, size = UpdateSel().get_nbor_stat(data, ["O", "H"], args["rcut"], args["mixed"])
print("RESULT " + json.dumps({"seconds": time.perf_counter() - start,
                              "min_nbor_dist": float(dist).hex(),
                              "max": [int(v) for v in size]}))
"""


def ours(systems: list[str], rcut: float, mixed: bool, threads: int) -> dict:
    from mdloader.data.dataset import DeepmdDataSetForLoader
    from mdloader.stats.merging import merge_all
    from mdloader.stats.neighbours import min_nbor_dist, system_neighbour_stats

    start = time.perf_counter()
    stats = merge_all(system_neighbour_stats(DeepmdDataSetForLoader(s, ["O", "H"]), rcut, 2,
                                             mixed_type=mixed, threads=threads)
                      for s in systems)
    return {"seconds": time.perf_counter() - start, "min_nbor_dist": min_nbor_dist(stats).hex(),
            "max": list(stats.max_neighbours)}


def deepmd_python(given: str | None) -> str:
    for cand in (given, os.environ.get("MDLOADER_DEEPMD_PYTHON"),
                 os.path.join(REPO, ".venv-deepmd", "bin", "python")):
        if cand and os.path.exists(cand):
            return cand
    sys.exit("DeePMD-kit's interpreter is not found: pass --deepmd-python")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", type=int, default=20)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--rcut", type=float, default=6.0)
    parser.add_argument("--mixed", action="store_true", help="one total count (DPA-1/2/3)")
    parser.add_argument("--threads", type=int, default=1, help="threads of each side")
    parser.add_argument("--deepmd-python", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stats-bench-") as tmp:
        systems = water_like(Path(tmp), args.systems, args.frames)
        mine = ours(systems, args.rcut, args.mixed, args.threads)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=str(REPO))
        proc = subprocess.run(
            [deepmd_python(args.deepmd_python), "-c", DEEPMD,
             json.dumps({"systems": systems, "rcut": args.rcut, "mixed": args.mixed}),
             str(args.threads)], env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(proc.stdout + proc.stderr)
        theirs = json.loads(lines[-1][len("RESULT "):])
    same = (mine["min_nbor_dist"], mine["max"]) == (theirs["min_nbor_dist"], theirs["max"])
    print(f"{args.systems} systems x 192 atoms x {args.frames} frames, rcut {args.rcut}, "
          f"{'mixed' if args.mixed else 'per type'}, {args.threads} thread(s)")
    print(f"{'':12}{'seconds':>10}  min_nbor_dist        max neighbours")
    print(f"{'DeePMD-kit':12}{theirs['seconds']:10.2f}  "
          f"{float.fromhex(theirs['min_nbor_dist']):<20.15g} {theirs['max']}")
    print(f"{'mdloader':12}{mine['seconds']:10.2f}  "
          f"{float.fromhex(mine['min_nbor_dist']):<20.15g} {mine['max']}")
    print(f"speed-up {theirs['seconds'] / mine['seconds']:.1f}x; identical results: {same}")


if __name__ == "__main__":
    main()
