"""The "Time to first step" section of ``docs/benchmarks.md``, from
:mod:`benchmarks.first_step.run`.

:mod:`benchmarks.report` calls :func:`section` when it rewrites the page; the latest record of
every (loader, systems, W, start) is shown, DeePMD-kit, ``mdloader dp`` and ``mdloader train``
side by side.
"""

from __future__ import annotations

import json
import os
from typing import Any

from benchmarks import REPO, RESULTS
from benchmarks.aggregate import met, number, ratio
from benchmarks.first_step.phases import PHASES

DEFAULT = os.path.join(RESULTS, "first_step", "first_step.jsonl")
MD, DP, TRAIN = "mdloader", "deepmd", "mdloader-train"
NAMES = {MD: "mdloader dp", TRAIN: "mdloader train"}
# the targets for mdloader: (systems, start) -> seconds to first step
TARGETS = {(200, "first"): 30.0, (200, "restart"): 5.0, (2000, "first"): 180.0}
Key = tuple[str, int, int, str]  # (impl, systems, W, start)


def load(path: str) -> tuple[list[dict[str, Any]], dict[Key, dict[str, Any]]]:
    """The runs' headers and the latest record per (loader, systems, W, start)."""
    metas, latest = [], {}
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("kind") == "first_step-meta":
                metas.append(rec)
            elif rec.get("kind") == "first_step":
                latest[(rec["impl"], rec["nsys"], rec["world"], rec["start"])] = rec
    return metas, latest


def ready(rec: dict[str, Any] | None) -> str:
    """Time to first step, ``> T s (stopped)`` for a stopped launch, the status otherwise."""
    if rec is None:
        return "–"
    if rec.get("ready_s") is not None:
        return number(rec["ready_s"])
    if rec.get("status") == "stopped":
        return f"> {number(rec['timeout_s'])} (stopped)"
    return rec.get("status", "–")


def _seconds(rec: dict[str, Any] | None) -> float | None:
    return None if rec is None else rec.get("ready_s")


def _phase(rec: dict[str, Any] | None, name: str) -> str:
    if rec is None:
        return "–"
    value = number(rec.get("phases", {}).get(name))
    stopped = rec.get("ready_s") is None and rec.get("status") == "stopped"
    last = list(rec.get("phases", {}))[-1:] == [name]
    return value + (" (stopped)" if stopped and last else "")


def _configs(latest: dict[Key, dict[str, Any]]) -> list[tuple[int, int, str]]:
    order = {"first": 0, "restart": 1}
    return sorted({(n, w, s) for (_i, n, w, s) in latest}, key=lambda k: (k[0], k[1],
                                                                        order.get(k[2], 2)))


def ready_table(latest: dict[Key, dict[str, Any]]) -> list[str]:
    head = " | ".join(f"{p} s (md / dp)" for p in PHASES)
    lines = [f"| systems | W | start | to first step s, mdloader dp | DeePMD-kit | DeePMD ÷ md | "
             f"mdloader train | {head} | load |",
             "|---:|---:|---|---:|---:|---:|---:|" + "---|" * len(PHASES) + "---:|"]
    for n, w, s in _configs(latest):
        md, dp = latest.get((MD, n, w, s)), latest.get((DP, n, w, s))
        tr = latest.get((TRAIN, n, w, s))
        phases = " | ".join(f"{_phase(md, p)} / {_phase(dp, p)}" for p in PHASES)
        loads = [r["loadavg_1min"] for r in (md, dp, tr) if r and "loadavg_1min" in r]
        lines.append(f"| {n:,} | {w} | {s} | {ready(md)} | {ready(dp)} | "
                     f"{ratio(_seconds(dp), _seconds(md))} | {ready(tr)} | {phases} | "
                     f"{' / '.join(f'{x:.1f}' for x in loads) or '–'} |")
    return lines


def memory_table(latest: dict[Key, dict[str, Any]]) -> list[str]:
    lines = ["| systems | W | start | peak RSS MiB per rank, mdloader | DeePMD-kit | "
             "with DataLoader workers, mdloader | DeePMD-kit | statistics CPU s per rank "
             "(neighbour + input), mdloader | DeePMD-kit |",
             "|---:|---:|---|---|---|---|---|---|---|"]

    def per_rank(rec: dict[str, Any] | None, key: str) -> str:
        return "–" if rec is None or key not in rec else " / ".join(number(v) for v in rec[key])

    def stats_cpu(rec: dict[str, Any] | None) -> str:
        if rec is None or "cpu_s" not in rec:
            return "–"
        parts = [rec["cpu_s"].get(p) for p in ("neighbour statistics", "input statistics")]
        parts = [p for p in parts if p]
        if not parts:
            return "–"
        return " / ".join(number(sum(vals)) for vals in zip(*parts))

    for n, w, s in _configs(latest):
        md, dp = latest.get((MD, n, w, s)), latest.get((DP, n, w, s))
        lines.append(f"| {n:,} | {w} | {s} | {per_rank(md, 'peak_rss_mib')} | "
                     f"{per_rank(dp, 'peak_rss_mib')} | {per_rank(md, 'peak_tree_rss_mib')} | "
                     f"{per_rank(dp, 'peak_tree_rss_mib')} | {stats_cpu(md)} | {stats_cpu(dp)} |")
    return lines


def targets(latest: dict[Key, dict[str, Any]]) -> list[str]:
    """The targets for mdloader (``dp`` and ``train``), at the largest W measured."""
    out = ["| target | measured | met? |", "|---|---:|:---:|"]
    for impl in (MD, TRAIN):
        for (n, s), limit in TARGETS.items():
            worlds = sorted(w for (i, nn, w, ss) in latest if i == impl and nn == n and ss == s)
            rec = latest.get((impl, n, worlds[-1], s)) if worlds else None
            value = _seconds(rec)
            verdict = None if rec is None else (value is not None and value <= limit)
            where = f", W = {worlds[-1]}" if worlds else ""
            label = "first start" if s == "first" else s
            shown = ready(rec) + (" s" if value is not None else "")
            out.append(f"| {NAMES[impl]}, {n:,} systems, {label}: ready to step ≤ "
                       f"{number(limit)} s{where} | {shown} | {met(verdict)} |")
    for n in sorted({nn for (i, nn, _w, _s) in latest if i == MD}):
        one, two = latest.get((MD, n, 1, "first")), latest.get((MD, n, 2, "first"))

        def busiest(rec: dict[str, Any] | None) -> float | None:
            if rec is None or "cpu_s" not in rec:
                return None
            per = [rec["cpu_s"].get(p) for p in ("neighbour statistics", "input statistics")]
            per = [p for p in per if p]
            return max(map(sum, zip(*per))) if per else None

        a, b = busiest(one), busiest(two)
        ok = None if a is None or b is None else b <= 0.6 * a
        out.append(f"| mdloader dp, {n:,} systems: statistics CPU per rank scales as 1/W "
                   f"(busiest rank, W = 1 ÷ W = 2 ≥ 1.67×) | {ratio(a, b)} | {met(ok)} |")
    return out


def section(path: str = DEFAULT) -> str:
    """The markdown of the section's results (a note when there are none yet)."""
    if not os.path.isfile(path):
        return "*No results yet: run `python -m benchmarks.first_step.run`.*"
    metas, latest = load(path)
    runs = ", ".join(sorted({m["run"] for m in metas}))
    head = (f"Runs started {runs} on {metas[-1].get('cpus') if metas else '?'} CPUs shared with "
            f"other work; \"load\" is the 1-minute load average at each launch (mdloader / "
            f"DeePMD-kit), so absolute times are noisy. Raw results: "
            f"`{os.path.relpath(path, REPO)}`.")
    return "\n".join([head, "", *targets(latest), "", *ready_table(latest), "",
                      *memory_table(latest)])
