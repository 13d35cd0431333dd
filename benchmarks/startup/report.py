"""Tables of the start-up runs (:mod:`benchmarks.startup.run`) for ``docs/benchmarks.md``.

Per (systems, W, condition, loader): medians over repetitions of the set-up time (barrier before
discovery to barrier after ``DpLoaderSet(...)`` on every rank), of rank 0's phases, and of the
bytes rank 0 read from disk during the set-up (``/proc/<pid>/io`` ``read_bytes``; spawned
build processes are not included, a cold build does not use them).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from benchmarks.aggregate import met, number, ratio

MD, DP = "mdloader", "deepmd"
ORDER = ("warm", "cold", "index", "trust", "slow", "slow-index", "synthetic")
LABEL = {"warm": "warm cache, no index", "cold": "cold cache, no index",
         "index": "warm index (checked)", "trust": "warm index (trusted)",
         "slow": "slow FS, no index", "slow-index": "slow FS, index (checked)",
         "synthetic": "synthetic index (trusted)"}
PEER = {"index": "warm", "trust": "warm", "slow-index": "slow"}  # DeePMD-kit has no index


def medians(rows: list[dict[str, Any]]) -> dict[tuple[str, int, int, str], dict[str, float]]:
    """Per (loader, systems, W, condition): medians of the latest run that has it; ``run`` is
    that run's start (runs are told apart by their ``startup-meta`` line)."""
    runs: dict[tuple, list[dict]] = defaultdict(list)
    started = ""
    for r in rows:
        if r.get("kind") == "startup-meta":
            started = r.get("started", "")
        elif r.get("kind") == "startup" and "build" in r:
            runs[(started, r["condition"], r["nsys"], r["world"], r["impl"], r["rep"])].append(r)
    per: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    for (run, cond, nsys, world, impl, _), ranks in sorted(runs.items()):
        if len(ranks) == world:
            per[(impl, nsys, world, cond, run)].append(
                _figures(sorted(ranks, key=lambda r: r["rank"])))
    out: dict[tuple[str, int, int, str], dict[str, Any]] = {}
    for (impl, nsys, world, cond, run), figs in sorted(per.items(), key=lambda kv: kv[0][4]):
        names = set().union(*figs)
        out[(impl, nsys, world, cond)] = {
            **{n: statistics.median([f[n] for f in figs if n in f]) for n in names},
            "reps": len(figs), "run": run}
    return out


def _figures(ranks: list[dict[str, Any]]) -> dict[str, float]:
    b0 = ranks[0]["build"]
    rep = b0.get("impl_report") or {}
    out = {"setup_s": max(r["build"]["total_s"] for r in ranks),
           "discovery_s": rep.get("discovery_s", max(r["build"]["discovery_s"] for r in ranks)),
           "build_s": rep.get("build_s", b0["constructor_s"]), "index_s": rep.get("index_s", 0.0),
           "payload": float(b0.get("bcast_bytes", 0)), "load": ranks[0].get("loadavg_1min", 0)}
    if b0.get("read_bytes") is not None:
        out["read_r0_mb"] = b0["read_bytes"] / 1e6
        out["read_all_mb"] = sum(r["build"].get("read_bytes") or 0 for r in ranks) / 1e6
    first, ends = b0.get("bcast_first_start"), [r["build"].get("bcast_last_end") for r in ranks]
    if first is not None and None not in ends:
        out["broadcast_s"] = max(ends) - first
    return out


def fs_calls(rows: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[int, float]]:
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r.get("kind") == "startup-fs" and r.get("fs_calls") is not None:
            out[(r["impl"], r["nsys"], r["condition"])][r["rank"]] = r["fs_calls"] / r["nsys"]
    return out




def setup_table(med: dict) -> list[str]:
    lines = ["| systems | W | condition | mdloader s | DeePMD-kit s | DeePMD ÷ md | mdloader "
             "discovery / build / index / broadcast s | MB read rank 0 (md / dp) | reps | load "
             "| run |", "|---:|---:|---|---:|---:|---:|---|---|---:|---:|---|"]
    keys = sorted({(n, w, c) for (_i, n, w, c) in med},
                  key=lambda k: (k[0], k[1], ORDER.index(k[2])))
    for n, w, cond in keys:
        md = med.get((MD, n, w, cond), {})
        peer = PEER.get(cond, cond)
        dp = med.get((DP, n, w, peer), {})
        dp_text = number(dp.get("setup_s")) + ("" if peer == cond or not dp else f" ({peer})")
        phases = " / ".join(number(md.get(k)) for k in ("discovery_s", "build_s", "index_s",
                                                     "broadcast_s"))
        lines.append(
            f"| {n:,} | {w} | {LABEL[cond]} | {number(md.get('setup_s'))} | {dp_text} | "
            f"{ratio(dp.get('setup_s'), md.get('setup_s'))} | {phases} | "
            f"{number(md.get('read_r0_mb'))} / "
            f"{number(dp.get('read_r0_mb') if peer == cond else None)} | "
            f"{int(md.get('reps', dp.get('reps', 0)))} | {number(md.get('load', 0), 2)} | "
            f"{md.get('run', dp.get('run', ''))[5:16]} |")
    return lines


def fs_table(rows: list[dict[str, Any]]) -> list[str]:
    calls, med = fs_calls(rows), medians(rows)
    lines = ["| systems | first start, rank 0 (md / dp) | from the index, rank 0 (md) | "
             "other ranks (md / dp) | bytes broadcast, first start (md / dp) |",
             "|---:|---|---|---|---|"]
    for n in sorted({k[1] for k in calls}):
        md, dp, ix = calls.get((MD, n, "warm"), {}), calls.get((DP, n, "warm"), {}), calls.get(
            (MD, n, "index"), {})
        rest = lambda c: max((v for r, v in c.items() if r), default=None)  # noqa: E731
        sent = [med.get((i, n, 2, "warm"), {}).get("payload") for i in (MD, DP)]
        lines.append(f"| {n:,} | {number(md.get(0))} / {number(dp.get(0))} | {number(ix.get(0))} | "
                     f"{number(rest(md))} / {number(rest(dp))} | "
                     f"{number(sent[0])} / {number(sent[1])} |")
    return lines


def readme_figures(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The figures the README quotes, by the name of their ``<!-- bench:NAME -->`` marker: all
    from the start-up runs at W = 2 (the tables above), so README and page cannot disagree."""
    med = medians(rows)
    g = lambda i, n, c, k="setup_s": med.get((i, n, 2, c), {}).get(k)  # noqa: E731
    calls = fs_calls(rows)
    n_fs = min((n for (i, n, c) in calls if c == "warm"), default=None)
    synth = max((n for (i, n, w, c) in med if c == "synthetic"), default=None)
    md_bytes, dp_bytes = g(MD, 2000, "warm", "payload"), g(DP, 2000, "warm", "payload")
    figures = {
        "fs_systems": number(n_fs),
        "dp_calls_rank1": number(calls.get((DP, n_fs, "warm"), {}).get(1, 0) * (n_fs or 0)),
        "md_calls_rank1": number(calls.get((MD, n_fs, "warm"), {}).get(1)),
        "md_calls_rank0_per_system": number(calls.get((MD, n_fs, "warm"), {}).get(0)),
        "dp_bytes_2000": number(dp_bytes), "md_bytes_2000": number(md_bytes),
        "md_bytes_per_system_2000": number(None if md_bytes is None else md_bytes / 2000, 2),
        "bytes_ratio_2000": ratio(dp_bytes, md_bytes, 0),
        "synthetic_systems": number(synth),
        "synthetic_s": _prose(g(MD, synth, "synthetic") if synth else None),
    }
    for n in (10000, 100000):
        for cond in ("warm", "cold"):
            figures[f"md_{cond}_{n}"] = _prose(g(MD, n, cond))
            figures[f"dp_{cond}_{n}"] = _prose(g(DP, n, cond))
        for cond in ("index", "trust"):
            figures[f"md_{cond}_{n}"] = _prose(g(MD, n, cond))
    for cond in ("slow", "slow-index"):
        figures[f"md_{cond}_10000"] = _prose(g(MD, 10000, cond))
    figures["dp_slow_10000"] = _prose(g(DP, 10000, "slow"))
    return figures


def _prose(seconds: float | None) -> str:
    """A time for a sentence: two significant digits, whole seconds from 10 s up."""
    if seconds is None:
        return "–"
    return f"{seconds:,.0f}" if seconds >= 10 else f"{seconds:.2g}"


def targets(med: dict, rows: list[dict[str, Any]]) -> list[str]:
    g = lambda i, n, c, k="setup_s": med.get((i, n, 2, c), {}).get(k)  # noqa: E731
    calls = fs_calls(rows)
    synth = max((n for (i, n, w, c) in med if c == "synthetic"), default=None)
    items = [
        ("warm index, 10 000 systems ready < 0.3 s", g(MD, 10000, "index"), lambda v: v < 0.3),
        ("warm index, 100 000 systems ready < 1 s", g(MD, 100000, "index"), lambda v: v < 1),
        ("same, trusted index, 100 000 systems", g(MD, 100000, "trust"), lambda v: v < 1),
        (f"index of {number(synth)} systems loads and broadcasts < 5 s",
         g(MD, synth, "synthetic") if synth else None, lambda v: v < 5),
        ("slow FS (1 ms per call), 2 000 systems ≤ 2 s", g(MD, 2000, "slow"), lambda v: v <= 2),
        ("slow FS (1 ms per call), 10 000 systems ≤ 8 s", g(MD, 10000, "slow"), lambda v: v <= 8),
        ("cold, 100 000 systems ready < 30 s", g(MD, 100000, "cold"), lambda v: v < 30),
    ]
    out = ["| target (W = 2) | measured | met? |", "|---|---:|:---:|"]
    for label, value, ok in items:
        out.append(f"| {label} | {number(value)} s | {met(None if value is None else ok(value))} |")
    for n in (10000,):
        md, dp = g(MD, n, "cold"), g(DP, n, "cold")
        out.append(f"| cold, {n:,} systems ≥ 10× DeePMD-kit | {ratio(dp, md)} | "
                   f"{met(None if not md or not dp else dp / md >= 10)} |")
    worst = max((v.get(0, 0) for (i, _n, c), v in calls.items() if i == MD and c == "warm"),
                default=None)
    out.append(f"| rank 0 ≤ 12 file-system calls per system (first start) | {number(worst)} | "
               f"{met(None if worst is None else worst <= 12)} |")
    return out



def section(rows: list[dict[str, Any]]) -> str:
    """The start-up section of the benchmarks page (empty when there are no start-up runs)."""
    med = medians(rows)
    if not med:
        return "No start-up runs in these results (`python -m benchmarks.startup.run`)."
    evictions = sorted({r["eviction"] for r in rows if r.get("eviction")})
    latency = sorted({r["latency_us"] for r in rows if r.get("latency_us")})
    started = sorted({r["started"] for r in rows if r.get("kind") == "startup-meta"})
    head = (f"Runs started {', '.join(started)}; where a configuration ran more than once, the "
            "latest run is shown (column \"run\"). Cold: "
            f"{'; '.join(evictions) or '–'}. Slow FS: "
            f"{', '.join(f'{u / 1000:g} ms' for u in latency) or '–'} added to every metadata "
            "call under the data tree.")
    return "\n".join([head, "", "### Targets (reported, not asserted)", "", *targets(med, rows),
                      "", "### Set-up by condition", "", *setup_table(med), "",
                      "### File-system calls per system under the data tree", "",
                      *fs_table(rows)])
