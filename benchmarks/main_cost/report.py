"""The "Main-process cost per batch" section of ``docs/benchmarks.md``, from a results file of
:mod:`benchmarks.main_cost.run`.

Usage: ``python -m benchmarks.main_cost.report [RESULTS]`` rewrites the text between the
``main-cost`` markers of the page; :mod:`benchmarks.report` calls :func:`section` when it
rewrites the whole page. Every window figure is the median over the repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from benchmarks import REPO
from benchmarks.aggregate import met, number, ratio
from benchmarks.main_cost.run import DEFAULT

DOCS = os.path.join(REPO, "docs", "benchmarks.md")
BEGIN, END = "<!-- main-cost: begin -->", "<!-- main-cost: end -->"
#: The goal with workers: main-thread CPU per batch at most this, and at least the plain-numpy
#: reference's batches per second.
GOAL_US = 300.0
LOADERS = (("mdloader", "train"), ("mdloader", "dp"), ("deepmd", "deepmd"))
FORMATS = {"npy": "npy", "hdf5": "HDF5", "lmdb": "LMDB"}
Windows = dict[tuple[Any, ...], dict[str, float]]


def load(path: str) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None,
                             list[dict[str, Any]]]:
    """The run's header, its windows, its profile (``None`` without one) and its failures."""
    meta: dict[str, Any] = {}
    windows, errors = [], []
    profile = None
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.get("kind")
            if kind == "meta":
                meta = rec
            elif kind == "window":
                windows.append(rec)
            elif kind == "profile":
                profile = rec
            elif kind == "error":
                errors.append(rec)
    return meta, windows, profile, errors


def medians(windows: list[dict[str, Any]]) -> Windows:
    """``(natoms, format, workers, impl, path)`` -> the median of each figure over repetitions."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for w in windows:
        groups.setdefault((w["natoms"], w["format"], w["workers"], w["impl"], w["path"]),
                          []).append(w)
    return {k: {f: statistics.median(r[f] for r in rs)
                for f in ("cpu_us_per_batch", "batches_per_s", "process_cpu_us_per_batch",
                          "step_cpu_us_per_batch") if all(f in r for r in rs)}
            for k, rs in groups.items()}


def goal(cpu: float | None, bps: float | None, reference: float | None) -> bool | None:
    """Whether a window with workers meets the goal (``None``: not measured)."""
    if cpu is None or bps is None or reference is None:
        return None
    return cpu <= GOAL_US and bps >= reference


def table(windows: list[dict[str, Any]]) -> list[str]:
    """One row per (atoms, data, workers): the three loaders and the plain-numpy reference side
    by side, with the goal's verdict for mdloader's two paths (workers only)."""
    med = medians(windows)
    lines = ["| atoms | data | workers | main-thread CPU µs per batch (train / dp / DeePMD-kit) | "
             "batches/s per rank (train / dp / DeePMD-kit) | plain numpy (µs / batches/s) | "
             "÷ plain numpy, batches/s (train / dp) | DeePMD-kit ÷ train, µs | goal met "
             "(train / dp) |", "|---:|---|---:|---|---|---|---|---:|---|"]
    for natoms, fmt, workers in sorted({k[:3] for k in med if k[3] != "numpy"},
                                       key=lambda k: (k[0], list(FORMATS).index(k[1]), k[2])):
        def get(impl: str, path: str, figure: str, f: str = fmt, w: int = workers,
                n: int = natoms) -> float | None:
            return med.get((n, f, w, impl, path), {}).get(figure)

        cpu = [get(i, p, "cpu_us_per_batch") for i, p in LOADERS]
        bps = [get(i, p, "batches_per_s") for i, p in LOADERS]
        ref = med.get((natoms, "npy", 0, "numpy", "reference"), {})
        ref_cpu, ref_bps = ref.get("cpu_us_per_batch"), ref.get("batches_per_s")
        verdict = ("–" if not workers else
                   " / ".join(met(goal(c, b, ref_bps)) for c, b in zip(cpu[:2], bps[:2])))
        lines.append(
            f"| {natoms:,} | {FORMATS.get(fmt, fmt)} | {workers} | "
            f"{' / '.join(number(c) for c in cpu)} | {' / '.join(number(b) for b in bps)} | "
            f"{number(ref_cpu)} / {number(ref_bps)} | "
            f"{ratio(bps[0], ref_bps, 2)} / {ratio(bps[1], ref_bps, 2)} | "
            f"{ratio(cpu[2], cpu[0], 1)} | {verdict} |")
    return lines


def process_table(windows: list[dict[str, Any]]) -> list[str]:
    """The same windows: the main process's CPU in all its threads, and the trainer thread's
    over the whole loop (the step's bookkeeping included)."""
    med = medians(windows)
    lines = ["| atoms | data | workers | main process, all threads, µs per batch (train / dp / "
             "DeePMD-kit) | trainer thread, whole step, µs per batch (train / dp) |",
             "|---:|---|---:|---|---|"]
    for natoms, fmt, workers in sorted({k[:3] for k in med if k[3] != "numpy"},
                                       key=lambda k: (k[0], list(FORMATS).index(k[1]), k[2])):
        row = [med.get((natoms, fmt, workers, i, p), {}) for i, p in LOADERS]
        lines.append(
            f"| {natoms:,} | {FORMATS.get(fmt, fmt)} | {workers} | "
            f"{' / '.join(number(r.get('process_cpu_us_per_batch')) for r in row)} | "
            f"{' / '.join(number(r.get('step_cpu_us_per_batch')) for r in row[:2])} |")
    return lines


def profile_table(profile: dict[str, Any]) -> list[str]:
    """The profile's parts of a ``next()``, both paths side by side (µs under the profiler and
    share of the profiled total)."""
    paths = profile["paths"]
    train, dp = paths["train"], paths["dp"]
    lines = ["| part of a `next()` | `mdloader train`: µs (share) | `mdloader dp`: µs (share) |",
             "|---|---:|---:|"]
    for a, b in zip(train["parts"], dp["parts"]):
        lines.append(f"| {a['part']} | {_share(a)} | {_share(b)} |")
    lines.append(f"| **total under the profiler** (unprofiled) | "
                 f"{number(train['profiled_us_per_batch'])} "
                 f"({number(train['unprofiled_us_per_batch'])}) | "
                 f"{number(dp['profiled_us_per_batch'])} "
                 f"({number(dp['unprofiled_us_per_batch'])}) |")
    return lines


def _share(part: dict[str, Any]) -> str:
    share = part.get("share")
    return f"{number(part['us_per_batch'])} ({'–' if share is None else f'{100 * share:.0f} %'})"


def alone_table(profile: dict[str, Any]) -> list[str]:
    lines = ["| piece, timed alone (no profiler) | µs per call |", "|---|---:|"]
    lines += [f"| {row['piece']} | {number(row['us'])} |" for row in profile["alone"]]
    return lines


def grouped_table(profile: dict[str, Any]) -> list[str]:
    rows = profile.get("grouped") or []
    lines = ["| batches per DataLoader item | main-thread CPU µs per batch | batches/s |",
             "|---:|---:|---:|"]
    lines += [f"| {r['batches_per_item']} | {number(r['cpu_us_per_batch'])} | "
              f"{number(r['batches_per_s'])} |" for r in rows]
    return lines


def verdicts(windows: list[dict[str, Any]]) -> list[str]:
    """One line per mdloader path: its main-thread CPU with workers, and in how many rows it
    meets the goal."""
    med = medians(windows)
    out = []
    for path, name in (("train", "`mdloader train`"), ("dp", "`mdloader dp`")):
        mine = [(k, v) for k, v in med.items() if k[2] and k[3] == "mdloader" and k[4] == path]
        if not mine:
            continue
        refs = [med.get((k[0], "npy", 0, "numpy", "reference"), {}).get("batches_per_s")
                for k, _ in mine]
        ok = [goal(v.get("cpu_us_per_batch"), v.get("batches_per_s"), r)
              for (_, v), r in zip(mine, refs)]
        cpus = sorted(v["cpu_us_per_batch"] for _, v in mine)
        cheap = sum(v["cpu_us_per_batch"] <= GOAL_US for _, v in mine)
        fast = sum(r is not None and v["batches_per_s"] >= r for (_, v), r in zip(mine, refs))
        out.append(f"- {name} with workers: {number(cpus[0])}–{number(cpus[-1])} µs of the "
                   f"trainer thread per batch; at most {GOAL_US:.0f} µs in {cheap} of "
                   f"{len(mine)} rows, at least the plain-numpy rate in {fast}, both (the goal) "
                   f"in {sum(bool(o) for o in ok)}.")
    return out


def breakdown(profile: dict[str, Any]) -> list[str]:
    """The trainer thread's time per batch in the profiling run (unprofiled), split by the
    pieces timed alone; what they leave is the cost of the waits."""
    alone = {row["id"]: row["us"] for row in profile["alone"]}
    train = profile["paths"]["train"]["unprofiled_us_per_batch"]
    dp = profile["paths"]["dp"]["unprofiled_us_per_batch"]
    rows = [
        ("torch's DataLoader, per item, with nothing to read: the index put, the queue get, "
         f"`record_function` ({number(alone['record_function'])} µs), its bookkeeping "
         "(the floor)", alone["floor"]),
        ("unpickling the batch (`pickle.loads`, its `torch.from_numpy` apart)",
         alone["unpickle"] - alone["from_numpy"]),
        ("mdloader's own pieces: the next key, `torch.from_numpy`, the stall meter's "
         "`payload_bytes`", alone["next_key"] + alone["from_numpy"] + alone["payload_bytes"]),
    ]
    rest = train - sum(us for _, us in rows)
    rows.append(("the rest: waiting for the workers (blocking in the queue's poll and waking "
                 "up on busy cores, caches cold after each switch), the stream's and the "
                 "pool's own lines", rest))
    lines = [f"| `mdloader train`, {number(train)} µs per batch | µs | share |", "|---|---:|---:|"]
    lines += [f"| {name} | {number(us)} | {100 * us / train:.0f} % |" for name, us in rows]
    lines.append(f"| `mdloader dp` adds `NonFiniteBatches` ({number(alone['nonfinite'])} µs "
                 f"alone) | {number(dp - train)} | +{100 * (dp - train) / train:.0f} % |")
    return lines


def section(path: str = DEFAULT) -> str:
    """The markdown of the section (a note when there are no results yet)."""
    if not os.path.isfile(path):
        return (f"{BEGIN}\n*No results yet: run `python -m benchmarks.main_cost.run`.*\n{END}")
    meta, windows, profile, errors = load(path)
    loads = sorted(w["loadavg_1min"] for w in windows if "loadavg_1min" in w)
    head = (f"Run started {meta.get('started')} on a shared machine with {meta.get('cpus')} "
            f"CPUs, other work running (1-minute load "
            f"{loads[0]:.1f}–{loads[-1]:.1f} at the end of the launches)" if loads else
            f"Run started {meta.get('started')}, {meta.get('cpus')} CPUs")
    head += (f"; {meta.get('nsys')} systems × {meta.get('nframes')} frames per size, "
             f"`batch_size: {meta.get('batch_size')}` (one frame per batch), medians of "
             f"{meta.get('reps')} repetitions of a {meta.get('seconds')} s window after "
             f"{meta.get('warmup')} untimed batches. Raw results: "
             f"`{os.path.relpath(path, REPO)}`.")
    if meta.get("skipped"):
        head += f" Not installed, left out: {', '.join(meta['skipped'])}."
    if errors:
        head += " Failed launches: " + ", ".join(
            f"{e['impl']} rep {e['rep']}" for e in errors) + "."
    parts = [BEGIN, head, "", *table(windows), "", *verdicts(windows), "",
             "The same windows, what the main process spends in all its threads (the queues' "
             "feeder threads pickle the indices sent to the workers) and what the trainer "
             "thread spends over the whole step (`Feed.training_step` included):", "",
             *process_table(windows)]
    if profile is not None:
        paths = profile["paths"]
        parts += ["", "**Where the time goes** (the profiling run below; each piece timed alone, "
                  "without the profiler):", "", *breakdown(profile),
                  "", f"**The profile** ({profile['natoms']} atoms, npy, {profile['workers']} "
                  f"workers, {profile['batches']} batches per path under cProfile with the "
                  "thread's CPU clock; the profiler multiplies the cost of each Python call, so "
                  f"{number(paths['train']['unprofiled_us_per_batch'])} µs become "
                  f"{number(paths['train']['profiled_us_per_batch'])}):", "",
                  *profile_table(profile), "", *alone_table(profile)]
        if profile.get("grouped"):
            parts += ["", "The stream's dataset and sampler read through a bare DataLoader "
                      "with 2 workers whose item is several batches (outside mdloader's pool; "
                      f"medians of {meta.get('reps')} windows):",
                      "", *grouped_table(profile)]
    parts.append(END)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results", nargs="?", default=DEFAULT)
    p.add_argument("--docs", default=DOCS)
    args = p.parse_args(argv)
    with open(args.docs, encoding="utf-8") as fh:
        page = fh.read()
    start, end = page.index(BEGIN), page.index(END) + len(END)
    with open(args.docs, "w", encoding="utf-8") as fh:
        fh.write(page[:start] + section(args.results) + page[end:])
    print(f"wrote the main-process cost section of {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
