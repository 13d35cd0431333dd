"""From per-rank JSON lines to one row per (loader, number of systems, world size): medians.

Phase definitions (all clocks are the machine-wide monotonic clock, so ranks line up):

* ``setup_s``: barrier before discovery → barrier after ``DpLoaderSet(...)`` returned on every
  rank; the figure the targets call "build + broadcast" (it includes discovery);
* ``discovery_s``: DeePMD-kit: the slowest rank's ``process_systems`` (every rank walks);
  mdloader: rank 0's discovery from its own build report (only rank 0 walks);
* ``build_s``: rank 0 from the end of discovery to its first broadcast (mdloader: its report);
* ``broadcast_s``: rank 0's first broadcast call → the last rank leaving its last broadcast;
* ``bytes``: tensor bytes passed to ``torch.distributed.broadcast`` (for DeePMD-kit that is the
  pickled systems plus one int64 size per system, i.e. what ``broadcast_object_list`` sends).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

Key = tuple[str, int, int]  # (impl, nsys, world)


def load(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The meta line and the other lines of a results file."""
    meta: dict[str, Any] = {}
    rows = []
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("kind") == "meta":
                meta = rec
            else:
                rows.append(rec)
    return meta, rows


def load_many(paths: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Several results files as one: the metas are merged (lists of sizes and worlds joined)."""
    metas, rows = [], []
    for path in paths:
        meta, part = load(path)
        if meta:  # start-up results (benchmarks.startup.run) carry their own
            metas.append(meta)
        rows.extend(part)
    merged = dict(metas[0]) if metas else {}
    if len(metas) > 1:
        cfg = dict(merged.get("cfg", {}))
        for key in ("nsys", "worlds"):
            cfg[key] = sorted({v for m in metas for v in m.get("cfg", {}).get(key, [])})
        for key in ("reps", "seconds"):
            cfg[key] = sorted({m.get("cfg", {}).get(key) for m in metas} - {None})
        merged["started"] = min(m.get("started", "") for m in metas)
        merged["cfg"] = cfg
        merged["mode"] = " + ".join(m.get("mode", "?") for m in metas)
        merged["skipped"] = sorted({s for m in metas for s in m.get("skipped", [])})
    return merged, rows


def _runs(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, int, int, int], list[dict]]:
    runs: dict[tuple[str, int, int, int], list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("kind") == "timed" and "build" in r:
            runs[(r["impl"], r["nsys"], r["world"], r["rep"])].append(r)
    return runs


def run_figures(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Scalars of one run (all its ranks)."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    b0 = ranks[0]["build"]
    builds = [r["build"] for r in ranks]
    rep = b0.get("impl_report") or {}
    out: dict[str, float] = {"setup_s": max(b["total_s"] for b in builds)}
    out["discovery_s"] = rep.get("discovery_s", max(b["discovery_s"] for b in builds))
    first = b0.get("bcast_first_start")
    ends = [b["bcast_last_end"] for b in builds if b.get("bcast_last_end") is not None]
    out["broadcast_s"] = (max(ends) - first) if first is not None and ends else 0.0
    out["build_s"] = rep.get("build_s", (first - b0["t_discovered"]) if first is not None
                             else b0["constructor_s"])
    out["bytes"] = float(b0.get("bcast_bytes", 0))
    out["bytes_per_sys"] = out["bytes"] / max(b0["nsys"], 1)
    out["rss_growth_r0_mib"] = b0["rss_growth_kib"] / 1024
    out["peak_growth_r0_mib"] = b0["peak_growth_kib"] / 1024
    others = builds[1:] or builds
    out["rss_growth_rn_mib"] = max(b["rss_growth_kib"] for b in others) / 1024
    out["peak_growth_rn_mib"] = max(b["peak_growth_kib"] for b in others) / 1024
    out["loadavg_1min"] = ranks[0].get("loadavg_1min", float("nan"))
    out.update(_throughput(ranks))
    return out


def _throughput(ranks: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    tps = [r["throughput"] for r in ranks if "throughput" in r]
    if not tps:
        return out
    raw = [t["raw"]["batches_per_s"] for t in tps]
    out["raw_bps"] = statistics.mean(raw)
    for nw in sorted(k for k in tps[0] if k.startswith("nw")):
        for unit in ("batches", "frames", "atoms"):
            vals = [t[nw][f"{unit}_per_s"] for t in tps]
            out[f"{nw}_{unit}_ps"] = statistics.mean(vals)
            out[f"{nw}_{unit}_ps_sum"] = sum(vals)
        out[f"{nw}_raw_frac"] = statistics.mean(
            t[nw]["batches_per_s"] / t["raw"]["batches_per_s"] for t in tps
            if t["raw"]["batches_per_s"] > 0)
        out[f"{nw}_first_batch_s"] = max(t[nw]["first_batch_s"] for t in tps)
    return out


def medians(rows: list[dict[str, Any]]) -> dict[Key, dict[str, float]]:
    """Per (impl, nsys, world): the median over repetitions of every run figure, plus ``reps``."""
    per_key: dict[Key, list[dict[str, float]]] = defaultdict(list)
    for (impl, nsys, world, _rep), ranks in _runs(rows).items():
        if len(ranks) == world:
            per_key[(impl, nsys, world)].append(run_figures(ranks))
    out: dict[Key, dict[str, float]] = {}
    for key, runs in per_key.items():
        names = set().union(*runs)
        out[key] = {n: statistics.median([r[n] for r in runs if n in r]) for n in names}
        out[key]["reps"] = len(runs)
    for key, fs in fs_counts(rows).items():
        out.setdefault(key, {}).update(fs)
    return out


def fs_counts(rows: Iterable[dict[str, Any]]) -> dict[Key, dict[str, float]]:
    """File-system calls (and opens) under the data tree in the build: rank 0, the busiest other
    rank."""
    per: dict[Key, dict[int, tuple[int, int]]] = defaultdict(dict)
    for r in rows:
        if r.get("kind") == "fs" and r.get("fs_calls") is not None:
            by_call = r.get("by_call", {})
            opens = by_call.get("openat", 0) + by_call.get("open", 0)
            per[(r["impl"], r["nsys"], r["world"])][r["rank"]] = (r["fs_calls"], opens)
    out = {}
    for key, ranks in per.items():
        rest = max((v for k, v in ranks.items() if k != 0), default=None)
        nan = (float("nan"), float("nan"))
        r0 = ranks.get(0, nan)
        rn = rest or nan
        out[key] = {"fs_r0": float(r0[0]), "fs_rn": float(rn[0]),
                    "fs_open_r0": float(r0[1]), "fs_open_rn": float(rn[1])}
    return out


def errors(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "error" in r]


def number(x: float | None, digits: int = 3) -> str:
    """A figure of a results table: ``–`` when missing, thousands separated from 1000 up."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{digits}g}"


def ratio(num: float | None, den: float | None, decimals: int = 1) -> str:
    """``num / den`` as ``2.5×``; ``–`` when either is missing, ``∞`` over a zero."""
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return "–" if not (den == 0 and num) else "∞"
    return f"{num / den:.{decimals}f}×"


def met(ok: bool | None) -> str:
    """A target's verdict in a table: ``yes``, ``**no**``, or ``–`` when not measured."""
    return "–" if ok is None else ("yes" if ok else "**no**")
