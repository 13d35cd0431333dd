"""Write ``docs/benchmarks.md`` (tables, targets), ``docs/img/bench_*.png`` and the README's
figures from results files.

Usage: ``python -m benchmarks.report benchmarks/results/quick.jsonl [--docs docs/benchmarks.md]``
(:mod:`benchmarks.throughput.run` calls it at the end of a run).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Any

from benchmarks import REPO
from benchmarks import aggregate as agg
from benchmarks.aggregate import met, number, ratio
from benchmarks.first_step.report import section as first_step_section
from benchmarks.startup.report import readme_figures
from benchmarks.startup.report import section as startup_section

MD, DP = "mdloader", "deepmd"
TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report_text.md")



def _fs(calls: float | None, opens: float | None) -> str:
    """File-system calls with the opens among them in brackets (``openat`` is what a remote
    file system pays a metadata round trip for)."""
    if calls is None or math.isnan(calls):
        return "–"
    return number(calls) + ("" if opens is None or math.isnan(opens) else f" ({number(opens)})")



def _configs(med: dict[agg.Key, dict[str, float]]) -> list[tuple[int, int]]:
    return sorted({(n, w) for (_i, n, w) in med})


def _get(med: dict, impl: str, n: int, w: int, name: str) -> float | None:
    return med.get((impl, n, w), {}).get(name)


def setup_table(med: dict) -> list[str]:
    lines = ["| systems | W | mdloader set-up s | DeePMD-kit set-up s | DeePMD ÷ mdloader | "
             "discovery s (md / dp) | build s (md / dp) | broadcast s (md / dp) |",
             "|---:|---:|---:|---:|---:|---|---|---|"]
    for n, w in _configs(med):
        g = lambda i, k: _get(med, i, n, w, k)  # noqa: E731,B023 - used in this iteration
        lines.append(
            f"| {n:,} | {w} | {number(g(MD, 'setup_s'))} | {number(g(DP, 'setup_s'))} | "
            f"{ratio(g(DP, 'setup_s'), g(MD, 'setup_s'))} | "
            f"{number(g(MD, 'discovery_s'))} / {number(g(DP, 'discovery_s'))} | "
            f"{number(g(MD, 'build_s'))} / {number(g(DP, 'build_s'))} | "
            f"{number(g(MD, 'broadcast_s'))} / {number(g(DP, 'broadcast_s'))} |")
    return lines


def cost_table(med: dict) -> list[str]:
    lines = ["| systems | W | bytes broadcast (md / dp) | B per system (md / dp) | "
             "DeePMD ÷ mdloader | RSS growth MiB rank 0 (md / dp) | other ranks (md / dp) | "
             "DeePMD ÷ mdloader (rank 0) | FS calls (opens) rank 0 (md / dp) | FS calls (opens) "
             "other ranks (md / dp) |", "|---:|---:|---|---|---:|---|---|---:|---|---|"]
    for n, w in _configs(med):
        g = lambda i, k: _get(med, i, n, w, k)  # noqa: E731,B023 - used in this iteration
        lines.append(
            f"| {n:,} | {w} | {number(g(MD, 'bytes'))} / {number(g(DP, 'bytes'))} | "
            f"{number(g(MD, 'bytes_per_sys'))} / {number(g(DP, 'bytes_per_sys'))} | "
            f"{ratio(g(DP, 'bytes'), g(MD, 'bytes'))} | "
            f"{number(g(MD, 'rss_growth_r0_mib'))} / {number(g(DP, 'rss_growth_r0_mib'))} | "
            f"{number(g(MD, 'rss_growth_rn_mib'))} / {number(g(DP, 'rss_growth_rn_mib'))} | "
            f"{ratio(g(DP, 'rss_growth_r0_mib'), g(MD, 'rss_growth_r0_mib'))} | "
            f"{_fs(g(MD, 'fs_r0'), g(MD, 'fs_open_r0'))} / "
            f"{_fs(g(DP, 'fs_r0'), g(DP, 'fs_open_r0'))} | "
            f"{_fs(g(MD, 'fs_rn'), g(MD, 'fs_open_rn'))} / "
            f"{_fs(g(DP, 'fs_rn'), g(DP, 'fs_open_rn'))} |")
    return lines


def throughput_table(med: dict) -> list[str]:
    lines = ["| systems | W | workers | batches/s per rank (md / dp) | mdloader ÷ DeePMD | "
             "frames/s (md / dp) | atoms/s (md / dp) | plain-numpy reads batches/s | "
             "÷ plain numpy (md / dp) |", "|---:|---:|---:|---|---:|---|---|---:|---|"]
    for n, w in _configs(med):
        g = lambda i, k: _get(med, i, n, w, k)  # noqa: E731,B023 - used in this iteration
        for nw in ("nw0", "nw2"):
            if g(MD, f"{nw}_batches_ps") is None and g(DP, f"{nw}_batches_ps") is None:
                continue

            def pct(i: str) -> str:
                frac = g(i, f"{nw}_raw_frac")  # noqa: B023 - used in this iteration
                return f"{frac:.2f}×" if frac else "–"
            lines.append(
                f"| {n:,} | {w} | {nw[2:]} | {number(g(MD, f'{nw}_batches_ps'))} / "
                f"{number(g(DP, f'{nw}_batches_ps'))} | "
                f"{ratio(g(MD, f'{nw}_batches_ps'), g(DP, f'{nw}_batches_ps'))} | "
                f"{number(g(MD, f'{nw}_frames_ps'))} / {number(g(DP, f'{nw}_frames_ps'))} | "
                f"{number(g(MD, f'{nw}_atoms_ps'))} / {number(g(DP, f'{nw}_atoms_ps'))} | "
                f"{number(g(MD, 'raw_bps'))} | {pct(MD)} / {pct(DP)} |")
    return lines


def targets(med: dict) -> list[str]:
    """The design targets at 10 000 systems, W = 2 (or the largest W = 2 configuration run)."""
    cands = sorted(n for (i, n, w) in med if w == 2 and i == MD and (DP, n, w) in med)
    if not cands:
        return ["No W = 2 configuration with both loaders in this run."]
    n = 10000 if 10000 in cands else cands[-1]
    g = lambda i, k: _get(med, i, n, 2, k)  # noqa: E731
    rows = [
        ("set-up (discovery + build + broadcast) ≥ 10× faster (DeePMD ÷ md)", g(DP, "setup_s"),
         g(MD, "setup_s"), 10, "ratio"),
        ("bytes broadcast ≥ 10× fewer (DeePMD ÷ md)", g(DP, "bytes"), g(MD, "bytes"), 10, "ratio"),
        ("RSS growth ≤ 1/4 of DeePMD-kit's, rank 0 (need ≥ 4×)", g(DP, "rss_growth_r0_mib"),
         g(MD, "rss_growth_r0_mib"), 4, "ratio"),
        ("RSS growth ≤ 1/4 of DeePMD-kit's, other ranks (need ≥ 4×)", g(DP, "rss_growth_rn_mib"),
         g(MD, "rss_growth_rn_mib"), 4, "ratio"),
        ("batches/s ≥ 3× DeePMD-kit's, workers 0 (md ÷ DeePMD)", g(MD, "nw0_batches_ps"),
         g(DP, "nw0_batches_ps"), 3, "ratio"),
        ("batches/s ≥ 3× DeePMD-kit's, workers 2 (md ÷ DeePMD)", g(MD, "nw2_batches_ps"),
         g(DP, "nw2_batches_ps"), 3, "ratio"),
    ]
    out = [f"Measured at **{n:,} systems, W = 2**"
           + ("" if n == 10000 else " (10 000 was not part of this run)") + ".", "",
           "| target | measured | met? |", "|---|---:|:---:|"]
    for label, num, den, need, _ in rows:
        ok = None if num is None or den is None or den == 0 else num / den >= need
        out.append(f"| {label} | {ratio(num, den)} | {met(ok)} |")
    fs = g(MD, "fs_rn")
    out.append(f"| zero FS calls under the data tree from rank 1 | {number(fs)} "
               f"(DeePMD-kit: {number(g(DP, 'fs_rn'))}) | {met(None if fs is None else fs == 0)} |")
    for nw in ("nw0", "nw2"):
        frac = g(MD, f"{nw}_raw_frac")
        out.append(f"| ≥ 0.5× the plain-numpy read rate (workers {nw[2:]}) | "
                   f"{'–' if frac is None else f'{frac:.2f}×'} | "
                   f"{met(None if frac is None else frac >= 0.5)} |")
    big = _get(med, MD, 100000, 2, "setup_s") or _get(med, MD, 100000, 1, "setup_s")
    out.append(f"| 100 000 systems, warm, earlier code: whole build < 30 s | {number(big)} s | "
               f"{met(None if big is None else big < 30)} |")
    return out



BENCH_MARK = re.compile(r"<!-- bench:([\w-]+) -->(.*?)<!-- /bench -->", re.S)


def fill_readme(text: str, figures: dict[str, str]) -> str:
    """``text`` with each ``<!-- bench:NAME -->...<!-- /bench -->`` holding ``figures[NAME]``
    (a marker without a figure is an error: the README would quote a number nobody made)."""
    unknown = sorted({m.group(1) for m in BENCH_MARK.finditer(text)} - set(figures))
    if unknown:
        raise KeyError(f"README markers without a figure: {unknown}")
    return BENCH_MARK.sub(lambda m: f"<!-- bench:{m.group(1)} -->{figures[m.group(1)]}"
                          "<!-- /bench -->", text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results", nargs="+", help="one or more JSON-lines files (merged)")
    p.add_argument("--docs", default=os.path.join(REPO, "docs", "benchmarks.md"))
    p.add_argument("--readme", default=os.path.join(REPO, "README.md"),
                   help="fill its <!-- bench:NAME --> figures from the same results")
    p.add_argument("--keep-plots", action="store_true",
                   help="link the plots already in docs/img instead of redrawing them "
                   "(no matplotlib needed)")
    args = p.parse_args(argv)
    _meta, rows = agg.load_many(args.results)
    with open(args.readme, encoding="utf-8") as fh:
        readme = fh.read()
    from benchmarks.fs_traffic import report as fs_traffic_report

    filled = fill_readme(readme, {**readme_figures(rows), **fs_traffic_report.readme_figures()})
    if filled != readme:
        with open(args.readme, "w", encoding="utf-8") as fh:
            fh.write(filled)
        print(f"wrote {args.readme}")
    body = page(args.results, os.path.join(os.path.dirname(args.docs), "img"),
                redraw=not args.keep_plots)
    os.makedirs(os.path.dirname(args.docs), exist_ok=True)
    with open(args.docs, "w") as fh:
        fh.write(body)
    print(f"wrote {args.docs}")
    return 0


def page(results: list[str], img_dir: str, *, redraw: bool = True) -> str:
    """The text of ``docs/benchmarks.md`` from ``results`` (merged), its plots in ``img_dir``
    drawn again or, with ``redraw`` false, those already there."""
    from benchmarks import plots

    meta, rows = agg.load_many(results)
    med = agg.medians(rows)
    images = plots.write_all(med, img_dir) if redraw else plots.existing(img_dir)
    return render(meta, med, agg.errors(rows), images,
                  ", ".join(os.path.relpath(r, REPO) for r in results), rows)


def render(meta: dict[str, Any], med: dict, errs: list[dict], images: list[str],
           results: str, rows: list[dict[str, Any]] | None = None) -> str:
    with open(TEXT) as fh:
        text = fh.read()
    cfg = meta.get("cfg", {})
    run = (f"Mode `{meta.get('mode')}`, started {meta.get('started')}, {meta.get('cpus')} CPUs; "
           f"systems {cfg.get('nsys')}, world sizes {cfg.get('worlds')}, "
           f"{cfg.get('reps')} repetitions (medians), {cfg.get('seconds')} s per throughput "
           f"window. Raw results: `{results}`.")
    loads = [v["loadavg_1min"] for v in med.values()
             if not math.isnan(v.get("loadavg_1min", float("nan")))]
    if loads:
        run += (f" Machine load (1-min load average at the start of each run, median per "
                f"configuration): {min(loads):.1f}–{max(loads):.1f} on {meta.get('cpus')} CPUs "
                "shared with other work, so absolute times are noisy; the two loaders alternate "
                "so that their ratios see the same conditions.")
    if meta.get("skipped"):
        run += f" Skipped (not installed): {meta['skipped']}."
    if errs:
        run += f" **{len(errs)} failed run(s)**: " + "; ".join(
            f"{e.get('impl')} nsys={e.get('nsys')} W={e.get('world')}" for e in errs)
    figs = "\n\n".join(f"![{os.path.basename(i)}](img/{os.path.basename(i)})" for i in images)
    from benchmarks.fs_traffic import report as fs_traffic_report
    from benchmarks.lmdb import report as lmdb_report
    from benchmarks.main_cost import report as main_cost_report
    from benchmarks.scale import report as scale_report
    from benchmarks.staging_scale import report as staging_scale_report

    return text.format(run=run, startup=startup_section(rows or []),
                       targets="\n".join(targets(med)),
                       setup="\n".join(setup_table(med)), costs="\n".join(cost_table(med)),
                       throughput="\n".join(throughput_table(med)), figures=figs,
                       lmdb=lmdb_report.section(), first_step=first_step_section(),
                       main_cost=main_cost_report.section(),
                       scale=scale_report.section(), fs_traffic=fs_traffic_report.section(),
                       staging_scale=staging_scale_report.section())


if __name__ == "__main__":
    sys.exit(main())
