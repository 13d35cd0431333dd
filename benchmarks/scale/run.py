"""Per-rank cost of the pure sampling interfaces as the world size grows, in one process.

    python -m benchmarks.scale.run --quick       # a subset, under 2 minutes
    python -m benchmarks.scale.run               # W = 8 .. 16384, N = 1e3, 1e5, 1e6

Every rank computes its plan, keys and resume alone, so rank 0 and rank W - 1 are built alone
and the larger of their figures is reported. Each cell (row, mode, N, W, rank) runs in a fresh
subprocess (``--cell``; forked from this one with ``--quick`` or ``--inline``); its peak memory
is what ``tracemalloc`` sees Python and numpy allocate from the cell's start, in a second run
(its time is that of a run without ``tracemalloc``, which slows every allocation). A cell that runs
past ``--budget`` seconds is killed and the larger W of the same row, mode and N
are then skipped ("over budget"). Synthetic sizes: 3-200 atoms and
10-1000 frames per system, ``batch_size: auto``, probabilities by batch count
(``prob_sys_size``), ``balance_window: 32`` in the balanced mode. The table ends with the growth
exponent in W of every row: the least-squares slope of log(time) against log(W).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import pickle
import platform
import subprocess
import sys
import time
import tracemalloc
from typing import Any

import numpy as np

from benchmarks import RESULTS

ROWS = ("plan", "key", "chunk_step", "state", "resume", "elastic", "validation", "statistics",
        "table_decode")
WORLDS = (8, 64, 512, 4096, 16384)
SIZES = (1_000, 100_000, 1_000_000)
QUICK_WORLDS, QUICK_SIZES = (8, 64, 512), (1_000,)
RESUME_STEP = 100_000
WINDOW = 32
DEFAULT = os.path.join(RESULTS, "scale", "quick.jsonl")
FULL = os.path.join(RESULTS, "scale", "full.jsonl")


def sizes(nsys: int) -> tuple[np.ndarray, np.ndarray]:
    """(natoms, nframes) of the synthetic data set of ``nsys`` systems."""
    rng = np.random.default_rng(nsys)
    return rng.integers(3, 201, nsys), rng.integers(10, 1001, nsys)


def _sampler(natoms: np.ndarray, nframes: np.ndarray, world: int, rank: int, balanced: bool):
    from mdloader.sampling.plan import LoaderPlan
    from mdloader.sampling.samplers import WeightedSystemSampler
    from mdloader.sampling.spec import SamplingSpec

    plan = LoaderPlan.build(natoms, nframes, SamplingSpec(balance_window=WINDOW if balanced
                                                          else 0), seed=1, world_size=world)
    plan = plan.with_probabilities("prob_sys_size")
    return WeightedSystemSampler.of_plan(plan, plan.rule, rank=rank)


def _job_state(sampler: Any, world: int, steps: int) -> dict:
    """The merged state of a job that ran ``steps`` steps on ``world`` ranks."""
    state = sampler.state_dict()
    for key in ("history", "rank", "world_size", "steps"):
        state.pop(key)
    state["generations"] = [[world, *[steps] * world]]
    return state


def _table(natoms: np.ndarray, nframes: np.ndarray):
    from mdloader.catalog.table import SystemTable
    from mdloader.data.formats.base import SetMeta, SystemMeta

    keys = ("coord", "box", "energy", "force")
    metas = []
    for i, (n, f) in enumerate(zip(natoms.tolist(), nframes.tolist())):
        types = np.zeros(n, dtype=np.int32)
        types.flags.writeable = False
        metas.append(SystemMeta(address=f"data/group{i % 100}/sys{i}", backend="npy",
                                atom_types=types, type_map=("O", "H"), pbc=True, mixed_type=False,
                                sets=(SetMeta("set.000", f, keys, (3 * n, 9, 1, 3 * n)),)))
    return SystemTable.from_metas(metas)


def cell(row: str, nsys: int, world: int, rank: int, balanced: bool,
         trace: bool = True) -> dict[str, Any]:
    """Time (s) and peak traced memory (bytes) of one row on one rank; ``value`` where the row
    measures a size (the state). ``trace=False`` times it without ``tracemalloc``, which slows
    every allocation (the peak is then 0): :func:`run_cell` takes the time of such a run."""
    import mdloader.sampling.samplers  # noqa: F401  (imports are not part of any row)
    import mdloader.sampling.validation  # noqa: F401

    natoms, nframes = sizes(nsys)
    prepared: Any = None
    if row == "table_decode":
        prepared = pickle.dumps(_table(natoms, nframes))
    elif row in ("key", "chunk_step", "state", "resume", "elastic"):
        prepared = _sampler(natoms, nframes, world, rank, balanced)
        if row == "state":
            prepared.seek(RESUME_STEP)
    value = None
    if trace:
        tracemalloc.start()
    started = time.perf_counter()
    if row == "plan":
        _sampler(natoms, nframes, world, rank, balanced)
    elif row == "key":
        prepared.next_key()
    elif row == "chunk_step":
        prepared.seek(4095)
        prepared.next_key()
        started = time.perf_counter()
        tracemalloc.reset_peak()
        prepared.next_key()  # step 4096: the first of the next chunk
    elif row == "state":
        value = len(json.dumps(prepared.state_dict()))
    elif row == "resume":
        state = prepared.state_dict(consumed=RESUME_STEP)
        fresh = _sampler(natoms, nframes, world, rank, balanced)
        started = time.perf_counter()
        tracemalloc.reset_peak()
        fresh.load_state_dict(state)
        fresh.next_key()
    elif row == "elastic":
        job = _job_state(prepared, world, RESUME_STEP)
        new = _sampler(natoms, nframes, max(1, world // 2), min(rank, world // 2 - 1), balanced)
        started = time.perf_counter()
        tracemalloc.reset_peak()
        new.load_state_dict(job)
        new.next_key()
    elif row == "validation":
        from mdloader.sampling.validation import ShardedValidationSampler

        ShardedValidationSampler(nframes, np.ones_like(nframes), rank=rank, world_size=world)
    elif row == "statistics":
        from mdloader.sampling.plan import LoaderPlan
        from mdloader.sampling.spec import SamplingSpec

        plan = LoaderPlan.build(natoms, nframes, SamplingSpec(), seed=1, world_size=world)
        counts = plan.statistics_frame_counts(10)
        for sid in np.flatnonzero(counts)[rank::world]:
            plan.statistics_frames(int(sid), 10)
    elif row == "table_decode":
        pickle.loads(prepared)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    tracemalloc.stop()
    return {"seconds": seconds, "peak_bytes": peak, "value": value}


def _forked_cell(row: str, nsys: int, world: int, rank: int, balanced: bool,
                 budget: float, trace: bool = True) -> dict[str, Any] | None:
    """:func:`cell` in a forked child (modules already imported), killed past ``budget``."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=lambda: send.send(cell(row, nsys, world, rank, balanced, trace)))
    child.start()
    send.close()
    try:
        got = recv.recv() if recv.poll(budget) else None
    except EOFError:  # the cell raised: the child's traceback is on stderr
        got = {"error": f"the cell failed (exit code {child.exitcode})"}
    child.kill()
    child.join()
    return got


def run_cell(row: str, nsys: int, world: int, balanced: bool, budget: float,
             inline: bool = False, repeat: int = 1) -> dict[str, Any]:
    """The row on rank 0 and rank W - 1, each in a fresh process (``inline``: forked from this
    one, which imported everything already), best of ``repeat``; the larger of the two ranks."""
    out: dict[str, Any] = {"row": row, "nsys": nsys, "world": world,
                           "mode": "balanced" if balanced else "unbalanced"}
    results = []
    for rank in sorted({0, world - 1}):
        tries = []
        for _ in range(max(1, repeat)):
            got = _one_try(row, nsys, world, rank, balanced, budget, inline)
            if "over_budget" in got or "error" in got:
                return {**out, **got}
            tries.append(got)
        results.append(min(tries, key=lambda r: r["seconds"]))
    out.update(seconds=max(r["seconds"] for r in results),
               peak_MiB=max(r["peak_bytes"] for r in results) / 2**20,
               value=results[0]["value"])
    if out["seconds"] > budget:
        out["over_budget"] = True
    return out


def _one_try(row: str, nsys: int, world: int, rank: int, balanced: bool, budget: float,
             inline: bool) -> dict[str, Any]:
    """One cell on one rank, run twice: timed without ``tracemalloc``, then traced for its peak
    memory; its figures, or ``over_budget`` / ``error``."""
    timed = _run_once(row, nsys, world, rank, balanced, budget, inline, trace=False)
    if "over_budget" in timed or "error" in timed:
        return timed
    traced = _run_once(row, nsys, world, rank, balanced, budget, inline, trace=True)
    if "over_budget" in traced or "error" in traced:
        return traced
    return {**traced, "seconds": timed["seconds"]}


def _run_once(row: str, nsys: int, world: int, rank: int, balanced: bool, budget: float,
              inline: bool, trace: bool) -> dict[str, Any]:
    if inline:
        got = _forked_cell(row, nsys, world, rank, balanced, budget, trace)
        return {"over_budget": True} if got is None else got
    cmd = [sys.executable, "-m", "benchmarks.scale.run", "--cell",
           json.dumps([row, nsys, world, rank, balanced, trace])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        return {"over_budget": True}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(cost) against log(W); None under two points."""
    pts = [(math.log(w), math.log(max(c, 1e-7))) for w, c in points]
    if len(pts) < 2:
        return None
    xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    return float(np.polyfit(xs, ys, 1)[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N = 1e3, W = 8, 64, 512")
    p.add_argument("--worlds", type=int, nargs="+")
    p.add_argument("--nsys", type=int, nargs="+")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--budget", type=float, default=60.0, help="seconds per cell")
    p.add_argument("--out", default=None, help="results file (jsonl)")
    p.add_argument("--inline", action="store_true",
                   help="cells forked from this process (the default of --quick): no start-up per "
                        "cell, but memory that this process holds is shared")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of every cell; the fastest counts (noisy, shared machines)")
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import mdloader.sampling.samplers  # noqa: F401  (imported once, before the forks)
    import mdloader.sampling.validation  # noqa: F401

    if args.cell:
        row, nsys, world, rank, balanced, trace = json.loads(args.cell)
        print(json.dumps(cell(row, nsys, world, rank, balanced, trace)))
        return 0
    worlds = args.worlds or (QUICK_WORLDS if args.quick else WORLDS)
    nsyss = args.nsys or (QUICK_SIZES if args.quick else SIZES)
    if args.quick and args.budget == 60.0:
        args.budget = 10.0
    out = args.out or (DEFAULT if args.quick else FULL)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    records: list[dict[str, Any]] = []
    with open(out, "w") as fh:
        fh.write(json.dumps({"kind": "meta", "quick": args.quick, "budget_s": args.budget,
                             "inline": args.inline or args.quick,
                             "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                             "cpus": os.cpu_count(), "python": platform.python_version(),
                             "loadavg_1min": os.getloadavg()[0], "resume_step": RESUME_STEP,
                             "balance_window": WINDOW, "repeat": args.repeat}) + "\n")
        for balanced in (False, True):
            for nsys in nsyss:
                for row in args.rows:
                    over = False
                    for world in worlds:
                        if over:
                            rec = {"row": row, "nsys": nsys, "world": world,
                                   "mode": "balanced" if balanced else "unbalanced",
                                   "over_budget": True, "skipped": True}
                        else:
                            rec = run_cell(row, nsys, world, balanced, args.budget,
                                           args.inline or args.quick, args.repeat)
                            over = bool(rec.get("over_budget"))
                        records.append(rec)
                        fh.write(json.dumps(rec) + "\n")
                        fh.flush()
                        print(format_record(rec), flush=True)
    print()
    print("\n".join(table(records)))
    return 0


def format_record(rec: dict[str, Any]) -> str:
    head = f"{rec['mode']:>10} N={rec['nsys']:<8} W={rec['world']:<6} {rec['row']:<13}"
    if rec.get("over_budget"):
        return head + " over budget"
    if "error" in rec:
        return head + f" error {rec['error']}"
    return head + f" {rec['seconds'] * 1e3:10.2f} ms {rec['peak_MiB']:9.2f} MiB"


def table(records: list[dict[str, Any]]) -> list[str]:
    """Markdown: one line per (mode, N, row), a column per W (ms / MiB), the growth exponent."""
    worlds = sorted({r["world"] for r in records})
    lines = ["| mode | N | row | " + " | ".join(f"W = {w}" for w in worlds)
             + " | exponent in W |", "|---|---:|---|" + "---:|" * len(worlds) + "---:|"]
    keys = sorted({(r["mode"], r["nsys"], r["row"]) for r in records},
                  key=lambda k: (k[0] != "unbalanced", k[1], ROWS.index(k[2])))
    for mode, nsys, row in keys:
        cells, points = [], []
        by_world = {r["world"]: r for r in records
                    if (r["mode"], r["nsys"], r["row"]) == (mode, nsys, row)}
        for w in worlds:
            r = by_world.get(w)
            if r is None:
                cells.append("–")
            elif r.get("over_budget"):
                cells.append("over budget")
            elif "error" in r:
                cells.append("error")
            else:
                text = f"{r['seconds'] * 1e3:.2f} ms, {r['peak_MiB']:.1f} MiB"
                if r.get("value") is not None:
                    text += f", {r['value']:,} B"
                cells.append(text)
                points.append((w, r["seconds"]))
        s = slope(points)
        lines.append(f"| {mode} | {nsys:,} | {row} | " + " | ".join(cells)
                     + f" | {'–' if s is None else f'{s:.2f}'} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
