"""Run the side-by-side benchmark: mdloader and DeePMD-kit on the same data, in the same run.

One command::

    python -m benchmarks.throughput.run --quick  # < 5 minutes: 100 and 2 000 systems, W = 2
    python -m benchmarks.throughput.run --full   # 100 … 100 000 systems, W = 1, 2, 4

For every (number of systems, world size) the two loaders run alternately (the order flips on
every repetition) with ``torchrun --standalone --nproc_per_node=W`` and gloo; each repetition is a
fresh set of processes. A separate, untimed pass per configuration runs the build under strace to
count file-system calls. Raw results go to a JSON-lines file, one line per rank per run; the
report (:mod:`benchmarks.report`) turns them into ``docs/benchmarks.md`` with medians, ratios and
plots. The DeePMD-kit side runs with ``--peer-python`` (the venv of ``scripts/deepmd-env.sh``) and
is skipped with a note when that interpreter cannot import it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from benchmarks import REPO, RESULTS, fsaudit
from benchmarks.data import DEFAULT_BASE, ensure_dataset
from benchmarks.launch import python_for, run_build

MODES: dict[str, dict[str, Any]] = {
    "quick": {"nsys": [100, 2000], "worlds": [2], "reps": 2, "seconds": 1.0,
              "strace_worlds": [2], "timeout": 300},
    "full": {"nsys": [100, 2000, 10000, 100000], "worlds": [1, 2, 4], "reps": 3, "seconds": 4.0,
             "strace_worlds": [2, 4], "timeout": 3600, "reps_at": {100000: 1},
             "strace_max_nsys": 10000},
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick")
    g.add_argument("--full", dest="mode", action="store_const", const="full")
    p.add_argument("--nsys", type=int, nargs="+", help="override the mode's system counts")
    p.add_argument("--worlds", type=int, nargs="+", help="override the mode's world sizes")
    p.add_argument("--reps", type=int, help="override the mode's repetitions")
    p.add_argument("--seconds", type=float, help="timed window per throughput measurement")
    p.add_argument("--impls", default="mdloader,deepmd")
    p.add_argument("--peer-python", default=os.environ.get("MDLOADER_DEEPMD_PYTHON")
                   or os.path.join(REPO, ".venv-deepmd", "bin", "python"))
    p.add_argument("--data-base", default=DEFAULT_BASE)
    p.add_argument("--no-strace", action="store_true")
    p.add_argument("--timeout", type=float, help="seconds per launch (default: the mode's, "
                   "raised to 10 ms per system so that 100 000 systems get 1000 s)")
    p.add_argument("--out", help="JSON-lines output (default benchmarks/results/<mode>.jsonl)")
    p.add_argument("--no-report", action="store_true", help="do not rewrite docs/benchmarks.md")
    p.add_argument("--merge", nargs="*", help="earlier results files to report together with "
                   "this run (e.g. a quick run plus one 100 000-system configuration)")
    p.set_defaults(mode="quick")
    return p.parse_args(argv)


def _emit(fh: Any, base: dict[str, Any], recs: list[dict[str, Any]], tail: str) -> None:
    if len(recs) != base["world"]:
        fh.write(json.dumps({**base, "error": tail or "missing rank records"}) + "\n")
    for rec in recs:
        fh.write(json.dumps({**rec, **base}) + "\n")
    fh.flush()


def timed_runs(fh: Any, pythons: dict[str, str], root: str, nsys: int, world: int,
               reps: int, args: argparse.Namespace, cfg: dict[str, Any]) -> None:
    order = list(pythons)
    for rep in range(reps):
        for impl in (order if rep % 2 == 0 else order[::-1]):
            t0 = time.monotonic()
            recs, tail = run_build(pythons[impl], impl, root, world, seconds=cfg["seconds"],
                                build_only=False, strace_to=None, timeout=cfg["timeout"],
                                rep=rep)
            base = {"kind": "timed", "mode": args.mode, "impl": impl, "nsys": nsys,
                    "world": world, "rep": rep, "wall_s": round(time.monotonic() - t0, 2)}
            _emit(fh, base, recs, tail)
            print(f"  {impl:8s} nsys={nsys:<6d} W={world} rep={rep} "
                  f"{'ok' if len(recs) == world else 'FAILED'} ({base['wall_s']} s)", flush=True)


def strace_runs(fh: Any, pythons: dict[str, str], root: str, nsys: int, world: int,
                cfg: dict[str, Any]) -> None:
    for impl, python in pythons.items():
        trace = tempfile.mktemp(prefix="mdl-strace-", suffix=".txt")
        recs, tail = run_build(python, impl, root, world, seconds=0.0, build_only=True,
                            strace_to=trace, timeout=cfg["timeout"] * 3)
        base = {"kind": "fs", "impl": impl, "nsys": nsys, "world": world,
                "fs_tool": "strace -f -e trace=%file"}
        if len(recs) == world and os.path.isfile(trace):
            counts = fsaudit.parse_trace(trace, {r["rank"]: r["pid"] for r in recs}, root)
            for r in range(world):
                fh.write(json.dumps({**base, "rank": r, **counts[r]}) + "\n")
        else:
            _emit(fh, {**base, "world": world}, [], tail or "strace run failed")
        fh.flush()
        if os.path.exists(trace):
            os.remove(trace)
        print(f"  strace {impl:8s} nsys={nsys:<6d} W={world} done", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = dict(MODES[args.mode])
    cfg.update({k: v for k, v in (("nsys", args.nsys), ("worlds", args.worlds),
                                  ("reps", args.reps), ("seconds", args.seconds)) if v})
    pythons = {i: p for i in args.impls.split(",") if (p := python_for(i, args.peer_python))}
    skipped = sorted(set(args.impls.split(",")) - set(pythons))
    if skipped:
        print(f"skipping {skipped}: not importable (run bash scripts/deepmd-env.sh)", flush=True)
    out = args.out or os.path.join(RESULTS, f"{args.mode}.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    strace_ok = not args.no_strace and shutil.which("strace") is not None
    with open(out, "w") as fh:
        custom = any(v for v in (args.nsys, args.worlds, args.reps, args.seconds))
        fh.write(json.dumps({"kind": "meta", "mode": "custom" if custom else args.mode,
                             "cfg": cfg, "skipped": skipped,
                             "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "cpus": os.cpu_count(), "strace": strace_ok}) + "\n")
        for nsys in cfg["nsys"]:
            root = ensure_dataset(nsys, base=args.data_base)
            reps = cfg.get("reps_at", {}).get(nsys, cfg["reps"]) if not args.reps else args.reps
            cfg["timeout"] = args.timeout or max(MODES[args.mode]["timeout"], 0.01 * nsys)
            for world in cfg["worlds"]:
                timed_runs(fh, pythons, root, nsys, world, reps, args, cfg)
                if (strace_ok and world in cfg["strace_worlds"]
                        and nsys <= cfg.get("strace_max_nsys", nsys)):
                    strace_runs(fh, pythons, root, nsys, world, cfg)
    print(f"results: {out}", flush=True)
    if not args.no_report:
        from benchmarks import report

        report.main([out] + list(args.merge or []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
