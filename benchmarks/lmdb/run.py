"""LMDB side by side: mdloader and DeePMD-kit 3.2.0's LMDB path on one database, in one run.

One command::

    python -m benchmarks.lmdb.run              # 10 000 systems x 100 frames = 10⁶ frames, W = 2

The database is packed once from the npy dataset of the same frames (:mod:`benchmarks.data`,
under the benchmark data base). Every repetition launches, with ``torchrun --standalone
--nproc_per_node=W`` and gloo, in an order that flips each repetition:

* ``md-lmdb``, ``dp-lmdb``: ready time, then batches/s with 0 and 2 workers;
* ``md-npy``: mdloader on the npy tree the database was packed from (the same frames);
* ``md-no-nlocs``, ``dp-no-nlocs``: ready time and frames read per rank for atom counts, on a
  copy of the database without ``frame_nlocs``.

Each rank's record goes to a JSON-lines file; :mod:`benchmarks.lmdb.report` writes the LMDB
section of ``docs/benchmarks.md`` from it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks import REPO, RESULTS
from benchmarks.data import DEFAULT_BASE, ensure_lmdb
from benchmarks.launch import run_ranks

#: label -> (implementation, data, build only)
CASES: dict[str, tuple[str, str, bool]] = {
    "md-lmdb": ("mdloader", "lmdb", False), "dp-lmdb": ("deepmd", "lmdb", False),
    "md-npy": ("mdloader", "npy", False),
    "md-no-nlocs": ("mdloader", "lmdb_no_nlocs", True),
    "dp-no-nlocs": ("deepmd", "lmdb_no_nlocs", True),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nsys", type=int, default=10000)
    p.add_argument("--nframes", type=int, default=100, help="frames per system")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0, help="throughput window")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--peer-python", default=os.environ.get("MDLOADER_DEEPMD_PYTHON") or
                   os.path.join(REPO, ".venv-deepmd", "bin", "python"))
    p.add_argument("--data-base", default=DEFAULT_BASE)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=os.path.join(RESULTS, "lmdb", "lmdb_w2.jsonl"),
                   help="JSON-lines output (a folder of its own: benchmarks.report merges "
                   "results/*.jsonl)")
    p.add_argument("--no-report", action="store_true")
    return p.parse_args(argv)


def launch(python: str, impl: str, data: str, args: argparse.Namespace,
           build_only: bool) -> tuple[list[dict[str, Any]], str]:
    """One torchrun job; the ranks' records and, on failure, the tail of its output."""
    worker_args = ["lmdb", "--impl", impl, "--data", data, "--seconds", str(args.seconds)]
    if build_only:
        worker_args.append("--build-only")
    return run_ranks(python, worker_args, args.world, timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    paths = ensure_lmdb(args.nsys, args.nframes, base=args.data_base)
    with open(paths["npy"] + ".lmdb.json") as fh:
        data_info = json.load(fh)
    pythons = {"mdloader": sys.executable, "deepmd": args.peer_python}
    cases = [c for c in args.cases.split(",") if c]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write(json.dumps({"kind": "meta", "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "cpus": os.cpu_count(), "world": args.world, "reps": args.reps,
                             "seconds": args.seconds, "data": data_info}) + "\n")
        for rep in range(args.reps):
            for case in cases if rep % 2 == 0 else cases[::-1]:
                impl, data, build_only = CASES[case]
                t0 = time.monotonic()
                recs, tail = launch(pythons[impl], impl, paths[data], args, build_only)
                base = {"kind": "timed", "case": case, "rep": rep,
                        "wall_s": round(time.monotonic() - t0, 1)}
                if len(recs) != args.world:
                    fh.write(json.dumps({**base, "error": tail or "missing records"}) + "\n")
                for rec in recs:
                    fh.write(json.dumps({**rec, **base}) + "\n")
                fh.flush()
                print(f"  {case:12s} rep={rep} {'ok' if len(recs) == args.world else 'FAILED'} "
                      f"({base['wall_s']} s)", flush=True)
    print(f"results: {args.out}", flush=True)
    if not args.no_report:
        from benchmarks.lmdb import report as lmdb_report

        lmdb_report.main([args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
