"""The LMDB section of ``docs/benchmarks.md``, from a results file of :mod:`benchmarks.lmdb.run`.

Usage: ``python -m benchmarks.lmdb.report benchmarks/results/lmdb/lmdb_w2.jsonl`` rewrites the text
between the ``lmdb-results`` markers of the page; :mod:`benchmarks.report` calls
:func:`section` when it rewrites the whole page. Every figure is a median over repetitions of a
per-rank value (rank 0 and the other ranks apart where they differ).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from benchmarks import REPO, RESULTS
from benchmarks.aggregate import met, number, ratio

DOCS = os.path.join(REPO, "docs", "benchmarks.md")
DEFAULT = os.path.join(RESULTS, "lmdb", "lmdb_w2.jsonl")
BEGIN, END = "<!-- lmdb-results: begin -->", "<!-- lmdb-results: end -->"
NAMES = {"md-lmdb": "mdloader, LMDB", "dp-lmdb": "DeePMD-kit, LMDB",
         "md-npy": "mdloader, npy (same frames)", "md-no-nlocs": "mdloader, LMDB",
         "dp-no-nlocs": "DeePMD-kit, LMDB"}


def load(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's header and its rank records; failed launches are counted in the header."""
    meta: dict[str, Any] = {"failed": []}
    rows = []
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("kind") == "meta":
                meta.update(rec)
            elif "error" in rec:
                meta["failed"].append(f"{rec['case']} rep {rec['rep']}")
            else:
                rows.append(rec)
    return meta, rows


def _median(rows: list[dict[str, Any]], case: str, ranks: str, get: Any) -> float | None:
    """Median over repetitions of ``get(record)``, for rank 0 (``"0"``) or the others."""
    vals = []
    for r in rows:
        if r["case"] != case or (r["rank"] == 0) != (ranks == "0"):
            continue
        try:
            vals.append(float(get(r)))
        except (KeyError, TypeError, IndexError, ValueError):
            pass
    return statistics.median(vals) if vals else None




def ready_table(rows: list[dict[str, Any]], frames: int) -> list[str]:
    lines = ["| loader | `frame_nlocs` | ready s rank 0 / other | frames read for atom counts "
             "rank 0 / other | bytes broadcast | bytes per frame |",
             "|---|---|---|---|---:|---:|"]
    for case, nlocs in (("md-lmdb", "recorded"), ("dp-lmdb", "recorded"), ("md-npy", "–"),
                        ("md-no-nlocs", "missing"), ("dp-no-nlocs", "missing")):
        m = lambda ranks, get: _median(rows, case, ranks, get)  # noqa: E731,B023
        sent = m("0", lambda r: r["bcast_bytes"])
        lines.append(
            f"| {NAMES[case]} | {nlocs} | {number(m('0', lambda r: r['ready_s']))} / "
            f"{number(m('n', lambda r: r['ready_s']))} | "
            f"{number(m('0', lambda r: r['frames_scanned']))} / "
            f"{number(m('n', lambda r: r['frames_scanned']))} | {number(sent)} | "
            f"{number(None if sent is None else sent / frames)} |")
    return lines


def throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| loader | workers | batches/s per rank (rank 0 / other) | frames/s per rank "
             "(rank 0 / other) | CPU µs per batch, rank's own process (rank 0 / other) | "
             "mdloader ÷ DeePMD-kit (batches/s) |", "|---|---:|---|---|---|---:|"]
    for workers in (0, 2):
        def bps(case: str, ranks: str, w: int = workers) -> float | None:
            return _median(rows, case, ranks, lambda r: r["throughput"][f"nw{w}"]
                           ["batches_per_s"])

        def fps(case: str, ranks: str, w: int = workers) -> float | None:
            return _median(rows, case, ranks, lambda r: r["throughput"][f"nw{w}"]
                           ["frames_per_s"])

        def cpu(case: str, ranks: str, w: int = workers) -> float | None:
            return _median(rows, case, ranks, lambda r: r["throughput"][f"nw{w}"]
                           ["cpu_us_per_batch"])

        for case in ("md-lmdb", "dp-lmdb", "md-npy"):
            vs_dp = ratio(_mean(bps(case, "0"), bps(case, "n")),
                          _mean(bps("dp-lmdb", "0"), bps("dp-lmdb", "n")), 2) \
                if case != "dp-lmdb" else ""
            lines.append(f"| {NAMES[case]} | {workers} | {number(bps(case, '0'))} / "
                         f"{number(bps(case, 'n'))} | {number(fps(case, '0'))} / "
                         f"{number(fps(case, 'n'))} | {number(cpu(case, '0'))} / "
                         f"{number(cpu(case, 'n'))} | {vs_dp} |")
    return lines


def _mean(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (a + b) / 2


def memory_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| loader | rank RSS MiB at ready (anonymous) | rank RSS MiB after 0-worker run "
             "(anonymous) | per worker RSS MiB, 2 workers (anonymous) |",
             "|---|---|---|---|"]
    for case in ("md-lmdb", "dp-lmdb", "md-npy"):
        def mem(get: Any, c: str = case) -> float | None:
            return _median(rows, c, "0", get)

        ready = mem(lambda r: r["memory_ready_mib"]["VmRSS"])
        ready_anon = mem(lambda r: r["memory_ready_mib"]["RssAnon"])
        after = mem(lambda r: r["throughput"]["nw0"]["memory_mib"]["VmRSS"])
        after_anon = mem(lambda r: r["throughput"]["nw0"]["memory_mib"]["RssAnon"])
        worker = mem(lambda r: max(w["VmRSS"] for w in r["throughput"]["nw2"]
                                   ["workers_memory_mib"]))
        worker_anon = mem(lambda r: max(w["RssAnon"] for w in r["throughput"]["nw2"]
                                        ["workers_memory_mib"]))
        lines.append(f"| {NAMES[case]} | {number(ready)} ({number(ready_anon)}) | {number(after)} "
                     f"({number(after_anon)}) | {number(worker)} ({number(worker_anon)}) |")
    return lines


def targets(rows: list[dict[str, Any]]) -> list[str]:
    def both(case: str, get: Any) -> float | None:
        return _mean(_median(rows, case, "0", get), _median(rows, case, "n", get))

    ready_md, ready_dp = (both(c, lambda r: r["ready_s"]) for c in ("md-lmdb", "dp-lmdb"))
    scans = _median(rows, "md-no-nlocs", "n", lambda r: r["frames_scanned"])
    dp_scans = _median(rows, "dp-no-nlocs", "n", lambda r: r["frames_scanned"])
    lines = ["| target | measured | met? |", "|---|---:|:---:|",
             f"| time to ready within 2× of DeePMD-kit's (md ÷ DeePMD) | "
             f"{ratio(ready_md, ready_dp, 2)} | {_met(ready_md, ready_dp, 2.0, below=True)} |",
             f"| zero frame reads on ranks ≥ 1 without `frame_nlocs` | {number(scans)} "
             f"(DeePMD-kit: {number(dp_scans)}) | {met(None if scans is None else scans == 0)} |"]
    for w in (0, 2):
        md, dp = (both(c, lambda r, w=w: r["throughput"][f"nw{w}"]["batches_per_s"])
                  for c in ("md-lmdb", "dp-lmdb"))
        lines.append(f"| batches/s ≥ 1.5× DeePMD-kit's LMDB loader, {w} workers | "
                     f"{ratio(md, dp, 2)} | {_met(md, dp, 1.5)} |")
    return lines


def _met(a: float | None, b: float | None, factor: float, below: bool = False) -> str:
    if a is None or b is None:
        return met(None)
    return met(a <= factor * b if below else a >= factor * b)


def section(path: str = DEFAULT) -> str:
    """The markdown of the section (a note when there are no results yet)."""
    if not os.path.isfile(path):
        return f"{BEGIN}\n*No LMDB results yet: run `python -m benchmarks.lmdb.run`.*\n{END}"
    meta, rows = load(path)
    data = meta.get("data", {})
    frames = data.get("frames") or 1
    loads = sorted(r["loadavg_1min"] for r in rows if "loadavg_1min" in r)
    head = (f"Run started {meta.get('started')}, {meta.get('cpus')} CPUs, W = "
            f"{meta.get('world')}, {meta.get('reps')} repetitions (medians), "
            f"{meta.get('seconds')} s per throughput window; database: {data.get('nsys'):,} "
            f"systems × {data.get('nframes_per_system')} frames = {frames:,} frames, "
            f"{data.get('bytes', 0) / 2**20:,.0f} MiB, packed in {data.get('pack_s')} s. "
            f"Raw results: `{os.path.relpath(path, REPO)}`.")
    if loads:
        head += (f" Machine load at the start of each launch: {loads[0]:.1f}–{loads[-1]:.1f} on "
                 f"{meta.get('cpus')} CPUs shared with other work: absolute figures are noisy, "
                 "the loaders alternate so that their ratios see the same conditions.")
    if meta["failed"]:
        head += (f" Failed launches (killed from outside; their repetitions are left out): "
                 f"{', '.join(meta['failed'])}.")
    parts = [BEGIN, head, "", *targets(rows), "", *ready_table(rows, frames), "",
             *throughput_table(rows), "", *memory_table(rows), END]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results", nargs="?", default=DEFAULT)
    p.add_argument("--docs", default=DOCS)
    args = p.parse_args(argv)
    with open(args.docs) as fh:
        page = fh.read()
    start, end = page.index(BEGIN), page.index(END) + len(END)
    with open(args.docs, "w") as fh:
        fh.write(page[:start] + section(args.results) + page[end:])
    print(f"wrote the LMDB section of {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
