"""Main-process cost per batch, side by side in one run: mdloader as ``mdloader train`` and
``mdloader dp`` read it, DeePMD-kit 3.2.0's own loader, and plain numpy.

One command::

    python -m benchmarks.main_cost.run            # 192 and 1536 atoms, npy/HDF5/LMDB (~3 min)

The data: water systems of the example's frames (:func:`benchmarks.data.ensure_water`; 192 atoms,
and with ``--cells 1,2`` also a 2×2×2 supercell of 1536 atoms), each also as one HDF5 file and
one LMDB database (:func:`benchmarks.data.ensure_formats`). Each repetition launches, per system
one interpreter per loader (:mod:`benchmarks.main_cost.measure`; DeePMD-kit's in its own
environment), the loaders' order flipping every repetition; each measures every size, format and
workers count, ``batch_size: auto`` (one frame per batch at these sizes). Then one profile
(:mod:`benchmarks.main_cost.profile`) of the 192-atom npy stream with 2 workers. The records go
to a JSON-lines file; :mod:`benchmarks.main_cost.report` prints the table and writes the section
of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks import REPO, RESULTS
from benchmarks.data import DEFAULT_BASE, NATOMS, ensure_formats, ensure_water
from benchmarks.launch import last_json, python_for, rank_env, run_job

DEFAULT = os.path.join(RESULTS, "main_cost", "main_cost.jsonl")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nsys", type=int, default=32, help="systems per data set")
    p.add_argument("--nframes", type=int, default=8, help="frames per system")
    p.add_argument("--cells", default="1,2", help="supercells: 1 = 192 atoms, 2 = 1536 atoms")
    p.add_argument("--formats", default="npy,hdf5,lmdb")
    p.add_argument("--workers", default="0,2")
    p.add_argument("--impls", default="mdloader,deepmd")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.5, help="timed window")
    p.add_argument("--warmup", type=int, default=20, help="untimed batches before a window")
    p.add_argument("--profile-batches", type=int, default=1000,
                   help="batches profiled per path (0: no profile)")
    p.add_argument("--profile-calls", type=int, default=2000,
                   help="calls per piece timed alone")
    p.add_argument("--deepmd-python", default=os.environ.get("MDLOADER_DEEPMD_PYTHON") or
                   os.path.join(REPO, ".venv-deepmd", "bin", "python"),
                   help="an interpreter that imports DeePMD-kit 3.2.0 "
                   "(default: $MDLOADER_DEEPMD_PYTHON, else .venv-deepmd)")
    p.add_argument("--data-base", default=DEFAULT_BASE)
    p.add_argument("--timeout", type=float, default=300, help="per launch")
    p.add_argument("--out", default=DEFAULT)
    p.add_argument("--no-report", action="store_true",
                   help="print the table only; leave docs/benchmarks.md as it is")
    return p.parse_args(argv)


def _list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def launch(python: str, module: str, args: list[str], timeout: float) -> dict[str, Any]:
    """``python -m module args``, this checkout importable; the JSON of its last line."""
    out = run_job([python, "-m", module, *args], timeout=timeout, env=rank_env(),
                  what=f"{module} {' '.join(args[:2])}")
    return last_json(out)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cells = [int(c) for c in _list(args.cells)]
    formats = _list(args.formats)
    data = {}
    for c in cells:
        root = ensure_water(args.nsys, base=args.data_base, nframes=args.nframes, cells=c)
        data[NATOMS * c ** 3] = ensure_formats(root, tuple(formats))
    pythons = {impl: python_for(impl, args.deepmd_python) for impl in _list(args.impls)}
    impls = [i for i, py in pythons.items() if py is not None]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t_start = time.monotonic()
    with open(args.out, "w") as fh:
        def write(rec: dict[str, Any]) -> None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()

        write({"kind": "meta", "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "cpus": os.cpu_count(), "reps": args.reps, "seconds": args.seconds,
               "warmup": args.warmup, "nsys": args.nsys, "nframes": args.nframes,
               "sizes": sorted(data), "formats": formats, "workers": args.workers,
               "impls": impls, "skipped": [i for i in pythons if i not in impls],
               "batch_size": "auto"})
        sets = [f"--data={n}:{f}={p}" for n, paths in data.items() for f, p in paths.items()]
        for rep in range(args.reps):
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                worker_args = ["--impl", impl, "--workers", args.workers, "--seconds",
                               str(args.seconds), "--warmup", str(args.warmup), *sets]
                try:
                    out = launch(pythons[impl], "benchmarks.main_cost.measure", worker_args,
                                 args.timeout)
                except RuntimeError as exc:
                    write({"kind": "error", "impl": impl, "rep": rep, "error": str(exc)[-2000:]})
                    print(f"  {impl:8s} rep={rep} FAILED", flush=True)
                    continue
                for rec in out["records"]:
                    write({"kind": "window", "rep": rep, **rec})
                print(f"  {impl:8s} rep={rep} ok ({time.monotonic() - t_start:.0f} s)",
                      flush=True)
        smallest = min(data)
        if args.profile_batches and "npy" in data[smallest] and "mdloader" in impls:
            out = launch(sys.executable, "benchmarks.main_cost.profile",
                         ["--data", data[smallest]["npy"], "--batches",
                          str(args.profile_batches), "--calls", str(args.profile_calls),
                          "--seconds", str(args.seconds), "--reps", str(args.reps)],
                         args.timeout)
            write({"kind": "profile", "natoms": smallest, **out})
            print(f"  profile ok ({time.monotonic() - t_start:.0f} s)", flush=True)
    from benchmarks.main_cost import report

    print("\n".join(report.table(report.load(args.out)[1])))
    print(f"results: {args.out}")
    if not args.no_report:
        report.main([args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
