"""Start-up of both loaders by condition: warm or cold page cache, with or without an index, on
a slow file system; and a synthetic index of many systems. Writes JSON lines of kind
``startup`` (one per rank per launch) and ``startup-fs`` (file-system calls from strace).

Conditions (``--conditions``):

* ``warm``: the page cache holds the tree (an untimed launch of each loader first, and the
  headers read again just before every launch: :func:`benchmarks.startup.evict.warm`); mdloader
  has no index yet (a fresh cache folder per launch, so it builds and saves one, as at a first
  start);
* ``cold``: the tree is evicted from the page cache before every launch
  (:mod:`benchmarks.startup.evict`, ``--evict``); no index;
* ``index``: mdloader starts from the index an untimed launch saved, checking it (warm cache);
* ``trust``: the same index, unchecked (``MDLOADER_INDEX=trust``);
* ``slow``: every metadata call under the tree waits ``--latency-us``
  (:mod:`benchmarks.startup.slowfs`); warm cache, no index;
* ``slow-index``: ``index`` on the slow file system.

DeePMD-kit has no index: it runs in ``warm``, ``cold`` and ``slow``. The loaders alternate
within a condition, the order flipping at every repetition. ``--synthetic N`` also times
loading and broadcasting a synthetic index of N systems (:func:`benchmarks.data.synthesize_index`).

Usage: ``python -m benchmarks.startup.run --nsys 10000 --conditions warm cold index --reps 3``
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

from benchmarks import REPO, RESULTS, fsaudit, probes
from benchmarks.data import DEFAULT_BASE, ensure_dataset, synthesize_index
from benchmarks.launch import python_for, run_build
from benchmarks.startup.evict import evict, warm
from benchmarks.startup.slowfs import build_shim, shim_env

CONDITIONS = ("warm", "cold", "index", "trust", "slow", "slow-index")
MDLOADER_ONLY = {"index", "trust", "slow-index"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nsys", type=int, nargs="*", default=[10000])
    p.add_argument("--worlds", type=int, nargs="+", default=[2])
    p.add_argument("--conditions", nargs="+", default=["warm", "cold", "index"],
                   choices=CONDITIONS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--evict", choices=("fadvise", "drop"), default="fadvise")
    p.add_argument("--latency-us", type=int, default=1000, help="slow file system: per call")
    p.add_argument("--synthetic", type=int, nargs="*", default=[],
                   help="also time a synthetic index of these many systems (mdloader, trust)")
    p.add_argument("--strace", action="store_true", help="count file-system calls (warm, index)")
    p.add_argument("--impls", default="mdloader,deepmd")
    p.add_argument("--peer-python", default=os.environ.get("MDLOADER_DEEPMD_PYTHON")
                   or os.path.join(REPO, ".venv-deepmd", "bin", "python"))
    p.add_argument("--data-base", default=DEFAULT_BASE)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=os.path.join(RESULTS, "startup.jsonl"))
    return p.parse_args(argv)


class Runner:
    """Launches one configuration's runs and writes their records."""

    def __init__(self, args: argparse.Namespace, fh: Any) -> None:
        self.args, self.fh = args, fh
        self.pythons = {i: p for i in args.impls.split(",")
                        if (p := python_for(i, args.peer_python))}
        self.scratch = tempfile.mkdtemp(prefix="mdl-startup-")

    def launch(self, impl: str, root: str, world: int, env: dict[str, str],
               strace_to: str | None = None) -> tuple[list[dict[str, Any]], str]:
        return run_build(self.pythons[impl], impl, root, world, seconds=0.0, build_only=True,
                      strace_to=strace_to, timeout=self.args.timeout, env=env)

    def condition(self, root: str, nsys: int, world: int, cond: str) -> None:
        impls = [i for i in self.pythons if i == "mdloader" or cond not in MDLOADER_ONLY]
        index_dir = os.path.join(self.scratch, f"index-{nsys}")
        env = self._env(cond, root)
        if cond != "cold":  # warm-up (and, for the index conditions, the index)
            for impl in impls:
                self.launch(impl, root, world, {"MDLOADER_CACHE_DIR": index_dir})
        for rep in range(self.args.reps):
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                fresh = tempfile.mkdtemp(dir=self.scratch)
                cache = index_dir if cond in MDLOADER_ONLY else fresh
                how = evict(root, self.args.evict) if cond == "cold" else warm(root)
                start = time.monotonic()
                recs, tail = self.launch(impl, root, world, {"MDLOADER_CACHE_DIR": cache, **env})
                shutil.rmtree(fresh, ignore_errors=True)
                self.emit({"kind": "startup", "condition": cond, "impl": impl, "nsys": nsys,
                           "world": world, "rep": rep, "eviction": how,
                           "latency_us": self.args.latency_us if "slow" in cond else 0,
                           "wall_s": round(time.monotonic() - start, 2)}, recs, tail)
                print(f"  {cond:10s} {impl:8s} nsys={nsys:<7d} W={world} rep={rep} "
                      f"{'ok' if len(recs) == world else 'FAILED'}", flush=True)

    def _env(self, cond: str, root: str) -> dict[str, str]:
        env: dict[str, str] = {}
        if "slow" in cond:
            shim = build_shim(os.path.join(self.args.data_base, ".tools"))
            env.update(shim_env(shim, root, self.args.latency_us))
        if cond == "trust":
            env["MDLOADER_INDEX"] = "trust"
        return env

    def strace(self, root: str, nsys: int, world: int) -> None:
        """File-system calls of a first start (no index) and of a start from the index."""
        index_dir = os.path.join(self.scratch, f"index-{nsys}")
        for cond, impls in (("warm", list(self.pythons)), ("index", ["mdloader"])):
            for impl in impls:
                cache = index_dir if cond == "index" else tempfile.mkdtemp(dir=self.scratch)
                if cond == "index":
                    self.launch(impl, root, world, {"MDLOADER_CACHE_DIR": cache})
                trace = os.path.join(self.scratch, "trace.txt")
                recs, tail = self.launch(impl, root, world, {"MDLOADER_CACHE_DIR": cache},
                                         strace_to=trace)
                base = {"kind": "startup-fs", "condition": cond, "impl": impl, "nsys": nsys,
                        "world": world}
                if len(recs) == world and os.path.isfile(trace):
                    counts = fsaudit.parse_trace(trace, {r["rank"]: r["pid"] for r in recs},
                                                 root)
                    for r in range(world):
                        self.fh.write(json.dumps({**base, "rank": r, **counts[r]}) + "\n")
                else:
                    self.emit(base, [], tail or "strace run failed")
                if os.path.exists(trace):
                    os.remove(trace)
                print(f"  strace {cond:6s} {impl:8s} nsys={nsys} done", flush=True)

    def synthetic(self, nsys: int, world: int) -> None:
        root = os.path.join(self.args.data_base, f"synthetic{nsys}")  # never created
        cache = os.path.join(self.scratch, f"synthetic-{nsys}")
        synthesize_index(root, nsys, cache)
        for rep in range(self.args.reps):
            recs, tail = self.launch("mdloader", root, world,
                                     {"MDLOADER_CACHE_DIR": cache, "MDLOADER_INDEX": "trust"})
            self.emit({"kind": "startup", "condition": "synthetic", "impl": "mdloader",
                       "nsys": nsys, "world": world, "rep": rep}, recs, tail)
            print(f"  synthetic nsys={nsys} rep={rep} {'ok' if recs else 'FAILED'}", flush=True)

    def emit(self, base: dict[str, Any], recs: list[dict[str, Any]], tail: str) -> None:
        if len(recs) != base["world"]:
            self.fh.write(json.dumps({**base, "error": tail or "missing rank records"}) + "\n")
        for rec in recs:
            self.fh.write(json.dumps({**rec, **base}) + "\n")
        self.fh.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as fh:
        runner = Runner(args, fh)
        argv = [probes.shown(a) for a in sys.argv[1:]]
        fh.write(json.dumps({"kind": "startup-meta", "started": time.strftime(
            "%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "argv": argv,
            "impls": sorted(runner.pythons)}) + "\n")
        try:
            for nsys in args.nsys:
                root = ensure_dataset(nsys, base=args.data_base)
                for world in args.worlds:
                    for cond in args.conditions:
                        runner.condition(root, nsys, world, cond)
                    if args.strace and shutil.which("strace"):
                        runner.strace(root, nsys, world)
            for nsys in args.synthetic:
                for world in args.worlds:
                    runner.synthetic(nsys, world)
        finally:
            shutil.rmtree(runner.scratch, ignore_errors=True)
    print(f"results: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
