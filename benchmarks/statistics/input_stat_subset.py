"""Input statistics on a subset of the frames: DeePMD-kit's path against mdloader's shares.

One command (defaults: 200 water systems of 40 frames, ``data_stat_nbatch`` 10, W = 1 and 2)::

    python -m benchmarks.statistics.input_stat_subset [--systems 200] [--frames 40]
                                    [--stat-nbatch 10] [--world 1 2] [--timeout S]
                                    [--every-frame]

``--every-frame`` adds both paths on every frame of every system (DeePMD-kit's with a
``data_stat_nbatch`` covering each system, mdloader's with ``MDLOADER_STAT_FRAMES=all``), the
cost of exact statistics beside DeePMD-kit's sampled pass.

``mdloader dp --pt train`` takes one step on :mod:`benchmarks.data` systems with the water
example's ``input.json`` (batch size 1 at 192 atoms, so ``data_stat_nbatch`` batches are a
subset of each system's frames), in fresh ``torchrun --standalone`` jobs (gloo, CPU, one OpenMP
thread per rank), twice per W: along **DeePMD-kit's path** (its ``make_stat_input`` and
``compute_or_load_stat`` on rank 0 over mdloader's per-system loaders, what ``mdloader dp`` ran
for a subset before; ``python -m benchmarks.statistics.input_stat_subset dp ...`` forces it)
and along **mdloader's shares** (every rank a share of the systems on a one-rank job's frames, one
all-gather). The neighbour statistics are computed once beforehand (``mdloader stat``) and their
cache copied into every job, so each launch computes only the input statistics. Printed side by
side: the input-statistics phase (its first line to "Start to train",
:mod:`benchmarks.first_step.phases`), each rank's CPU seconds in it and the time to the first
step, with the ratio of the two paths; records are appended to
``benchmarks/results/input_stat_subset/input_stat_subset.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import REPO, RESULTS
from benchmarks.data import DEFAULT_BASE, ensure_water
from benchmarks.first_step.run import job_input, record
from benchmarks.launch import rank_env, run_logged, torchrun

OUT = os.path.join(RESULTS, "input_stat_subset", "input_stat_subset.jsonl")
ENTRY = {"deepmd path": ["-m", "benchmarks.statistics.input_stat_subset", "dp"],
         "mdloader shares": ["-m", "mdloader", "dp"]}
#: ``--every-frame``: the same two paths on every frame of every system, DeePMD-kit's by a
#: ``data_stat_nbatch`` that covers each system (batches of one frame), mdloader's by
#: ``MDLOADER_STAT_FRAMES=all`` with the sample's ``data_stat_nbatch``.
EVERY_FRAME = {"deepmd path, every frame": "deepmd path",
               "mdloader shares, every frame": "mdloader shares"}
PASS_LINE = re.compile(r"(environment|output) statistics: \d+ systems in ([\d.]+) s")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--systems", type=int, default=200)
    p.add_argument("--frames", type=int, default=40, help="frames per system")
    p.add_argument("--stat-nbatch", type=int, default=10, help="model.data_stat_nbatch")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2])
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    p.add_argument("--python", default=os.environ.get("MDLOADER_DEEPMD_PYTHON")
                   or os.path.join(REPO, ".venv-deepmd", "bin", "python"),
                   help="the interpreter with DeePMD-kit 3.2 (scripts/deepmd-env.sh)")
    p.add_argument("--data-base", default=DEFAULT_BASE)
    p.add_argument("--out", default=OUT)
    p.add_argument("--every-frame", action="store_true",
                   help="also both paths on every frame (MDLOADER_STAT_FRAMES=all for mdloader)")
    return p.parse_args(argv)


def dp_with_deepmd_statistics(argv: list[str]) -> int:
    """``mdloader dp`` whose input statistics take DeePMD-kit's own path (its fall-back)."""
    import mdloader.integrations.deepmd as md

    md.InputStatTakeover.of = classmethod(lambda cls, *args: None)  # type: ignore[assignment]
    return md.run_dp(argv)


def _env(cache: str, **extra: str) -> dict[str, str]:
    return rank_env(MDLOADER_CACHE_DIR=cache, **extra)


def neighbour_cache(python: str, config: dict[str, Any], timeout: float) -> str:
    """A cache folder holding the neighbour statistics (and system index) of the job's data."""
    folder = tempfile.mkdtemp(prefix="mdl-input-stat-template-")
    with open(os.path.join(folder, "input.json"), "w") as out:
        json.dump(config, out, indent=1)
    subprocess.run([python, "-m", "mdloader", "stat", "input.json"], cwd=folder, check=True,
                   env=_env(os.path.join(folder, "cache")), timeout=timeout,
                   capture_output=True)
    return folder


def run_one(python: str, path: str, world: int, config: dict[str, Any], template: str,
            timeout: float, frames: int = 0) -> dict[str, Any]:
    """One launch along ``path`` (a key of :data:`ENTRY` or :data:`EVERY_FRAME`; ``frames``:
    the frames per system, the ``data_stat_nbatch`` that covers them on DeePMD-kit's path)."""
    job = tempfile.mkdtemp(prefix="mdl-input-stat-")
    extra = {}
    if path in EVERY_FRAME:
        path = EVERY_FRAME[path]
        if path == "mdloader shares":
            extra["MDLOADER_STAT_FRAMES"] = "all"
        else:
            config = {**config, "model": {**config["model"], "data_stat_nbatch": frames}}
    try:
        shutil.copytree(os.path.join(template, "cache"), os.path.join(job, "cache"))
        with open(os.path.join(job, "input.json"), "w") as out:
            json.dump(config, out, indent=1)
        load = os.getloadavg()[0]
        cmd = torchrun(python, world, [*ENTRY[path], "--pt", "train", "input.json"])
        run = run_logged(cmd, job, _env(os.path.join(job, "cache"), **extra), timeout)
        rec = record(run, world, "mdloader")  # both paths run mdloader dp: its log markers
        passes = {m.group(1): float(m.group(2)) for _t, line in run["lines"]
                  for m in [PASS_LINE.search(line)] if m}
        return {**rec, "passes_s": passes, "loadavg_1min": round(load, 2)}
    finally:
        shutil.rmtree(job, ignore_errors=True)


def _cell(value: Any) -> str:
    return "–" if value is None else f"{value:.3g}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The two paths side by side per W, with the ratio DeePMD-kit's path ÷ mdloader's."""
    lines = ["| W | path | input statistics s | CPU s per rank | first step done s | load |",
             "|---:|---|---:|---|---:|---:|"]
    by = {(r["world"], r["path"]): r for r in rows}
    for world in sorted({r["world"] for r in rows}):
        for path in (*ENTRY, *EVERY_FRAME):
            r = by.get((world, path))
            if r is None:
                continue
            cpu = " / ".join(_cell(c) for c in r.get("cpu_s", {}).get("input statistics", []))
            lines.append(f"| {world} | {path} | {_cell(r['phases'].get('input statistics'))} | "
                         f"{cpu or '–'} | {_cell(r.get('ready_s'))} | {r['loadavg_1min']:.1f} |")
        for label, (x, y) in (("ratio", ("deepmd path", "mdloader shares")),
                              ("ratio, every frame", tuple(EVERY_FRAME)),
                              ("mdloader every frame ÷ deepmd sample",
                               ("mdloader shares, every frame", "deepmd path"))):
            old, new = by.get((world, x)), by.get((world, y))
            a = old["phases"].get("input statistics") if old else None
            b = new["phases"].get("input statistics") if new else None
            if a and b:
                lines.append(f"| {world} | {label} | {a / b:.2f}× | | | |")
    return lines


def plot(results: str, path: str) -> str:
    """A bar chart of the input-statistics phase of each path and W of the runs in ``results``
    on the last run's data (``python -m benchmarks.statistics.input_stat_subset plot RESULTS
    PNG``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(results) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    shape = [rows[-1][k] for k in ("nsys", "frames", "stat_nbatch")]
    last = sorted((r for r in rows if r["status"] == "ok"
                   and [r[k] for k in ("nsys", "frames", "stat_nbatch")] == shape),
                  key=lambda r: (r["world"], "every frame" in r["path"], r["path"]))
    labels = [f"{r['path']}\nW={r['world']}"
              + (" (rank 0's shard)" if r["path"].startswith("deepmd") and r["world"] > 1 else "")
              for r in last]
    seconds = [r["phases"].get("input statistics") or 0.0 for r in last]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * len(last)))
    bars = ax.barh(labels[::-1], seconds[::-1], color=["#4c72b0" if "mdloader" in r["path"]
                                                        else "#dd8452" for r in last][::-1])
    ax.bar_label(bars, fmt="%.1f s", padding=3)
    first = last[0]
    ax.set_xlabel("input statistics phase, s")
    ax.set_xlim(0, max(seconds) * 1.2)
    ax.set_title(f"{first['nsys']} water systems x {first['frames']} frames, "
                 f"data_stat_nbatch {first['stat_nbatch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dp"]:
        return dp_with_deepmd_statistics(argv[1:])
    if argv[:1] == ["plot"]:
        print(plot(*argv[1:3]))
        return 0
    args = parse(argv)
    root = ensure_water(args.systems, base=args.data_base, nframes=args.frames)
    config = job_input(root, 1, args.stat_nbatch)
    template = neighbour_cache(args.python, config, args.timeout)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    run_id = time.strftime("%Y-%m-%d %H:%M:%S")
    rows = []
    try:
        with open(args.out, "a") as fh:
            paths = [*ENTRY, *(EVERY_FRAME if args.every_frame else ())]
            for i, world in enumerate(args.world):
                for path in (paths if i % 2 == 0 else paths[::-1]):
                    rec = run_one(args.python, path, world, config, template, args.timeout,
                                  frames=args.frames)
                    row = {"kind": "input_stat_subset", "run": run_id, "path": path,
                           "world": world, "nsys": args.systems, "frames": args.frames,
                           "stat_nbatch": args.stat_nbatch, "cpus": os.cpu_count(), **rec}
                    rows.append(row)
                    fh.write(json.dumps(row) + "\n")
                    fh.flush()
                    print(f"  {path:15s} W={world} status {rec['status']}: input statistics "
                          f"{_cell(rec['phases'].get('input statistics'))} s, passes "
                          f"{rec['passes_s']}", flush=True)
    finally:
        shutil.rmtree(template, ignore_errors=True)
    print(f"{args.systems} systems x {args.frames} frames, data_stat_nbatch {args.stat_nbatch}")
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
