"""The "Shared file system during training" section of ``docs/benchmarks.md``, from a results
file of :mod:`benchmarks.fs_traffic.run`.

:mod:`benchmarks.report` calls :func:`section` when it rewrites the page;
``python -m benchmarks.fs_traffic.report`` rewrites the page (plots kept) from every results
file, this family's included.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any

from benchmarks import REPO, RESULTS
from benchmarks.aggregate import number, ratio

DEFAULT = os.path.join(RESULTS, "fs_traffic", "fs_traffic.jsonl")
MD, DP = "mdloader", "deepmd"
#: mdloader with MDLOADER_DIRECT_READS=1 (``run --direct``), and how its rows name the format.
DIRECT, DIRECT_ROW = "mdloader-direct", "{}, direct reads"
WINDOWS = {"cold": "cold once", "per-pass": "cold every pass"}
Key = tuple[str, str, int, str]  # (format, nofile asked, workers, window)


def load(path: str) -> tuple[dict[str, Any], dict[tuple[str, Key], dict[str, Any]]]:
    """The run's header and its records by (loader, key); failed launches and the warm case's
    records (:mod:`benchmarks.fs_traffic.warm`) in the header."""
    meta: dict[str, Any] = {"failed": [], "warm": []}
    recs = {}
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("kind") == "meta":
                meta.update(rec)
            elif rec.get("kind") == "error":
                meta["failed"].append(f"{rec['impl']} {rec['format']} ulimit -n "
                                      f"{rec['nofile_asked']}")
            elif rec.get("kind") == "warm":
                meta["warm"].append(rec)
            elif rec.get("kind") == "fs_traffic":
                key = (rec["format"], rec["nofile_asked"], rec["workers"], rec["window"])
                recs[(rec["impl"], key)] = rec
    return meta, recs


def _keys(recs: dict[tuple[str, Key], dict[str, Any]]) -> list[Key]:
    fmts, wins = ["npy", "hdf5", "lmdb"], list(WINDOWS)
    return sorted({k for _i, k in recs}, key=lambda k: (
        fmts.index(k[0]) if k[0] in fmts else 9, k[1] != "1024", k[1], k[2],
        wins.index(k[3]) if k[3] in wins else 9))


def _nofile(rec: dict[str, Any]) -> str:
    """The soft limit the process started with, and the one it read under when it raised it."""
    text = f"{rec['nofile']:,}" if rec["nofile_asked"] != "high" else f"high ({rec['nofile']:,})"
    raised = rec.get("nofile_in_run")
    return text if raised in (None, rec["nofile"]) else f"{text} → {raised:,}"


def _both(md: dict[str, Any] | None, dp: dict[str, Any] | None, name: str,
          scale: float = 1.0) -> str:
    def one(rec: dict[str, Any] | None) -> str:
        value = None if rec is None else rec["per_batch"].get(name)
        return number(None if value is None else value / scale)
    return f"{one(md)} / {one(dp)}"


def _evicted(rec: dict[str, Any]) -> bool:
    """Whether the eviction emptied most of the tree (else its bytes from storage say little)."""
    left = rec.get("resident_after_evict_bytes")
    return left is None or left < 0.9 * max(rec["tree_bytes"], 1)


def _over_payload(rec: dict[str, Any] | None) -> str:
    if rec is None or not _evicted(rec):
        return "–"
    return ratio(rec["per_batch"]["bytes_from_storage"], rec["payload_bytes_per_batch"])


def _opens(rec: dict[str, Any] | None) -> str:
    """Opens per batch, with those of a file the process had opened before in brackets."""
    if rec is None or rec["per_batch"].get("opens") is None:
        return "–"
    again = rec["per_batch"].get("reopens")
    return number(rec["per_batch"]["opens"]) + ("" if again is None else f" ({number(again)})")


def _over_pages(rec: dict[str, Any] | None) -> str:
    if rec is None or not rec["per_batch"].get("bytes_of_pages_spanned") or not _evicted(rec):
        return "–"
    return ratio(rec["per_batch"]["bytes_from_storage"],
                 rec["per_batch"]["bytes_of_pages_spanned"])


def _left(rec: dict[str, Any] | None) -> str:
    if rec is None or rec.get("resident_after_evict_bytes") is None:
        return "–"
    return f"{100 * rec['resident_after_evict_bytes'] / max(rec['tree_bytes'], 1):.0f} %"


def _rows(recs: dict[tuple[str, Key], dict[str, Any]]
          ) -> list[tuple[Key, str, dict[str, Any] | None, dict[str, Any] | None]]:
    """(key, format as the row names it, mdloader's record, DeePMD-kit's) of each row: a key's
    row, then its row of mdloader with direct reads beside the same DeePMD-kit record."""
    out = []
    for key in _keys(recs):
        md, dp, direct = recs.get((MD, key)), recs.get((DP, key)), recs.get((DIRECT, key))
        if md is not None or dp is not None:
            out.append((key, key[0], md, dp))
        if direct is not None:
            out.append((key, DIRECT_ROW.format(key[0]), direct, dp))
    return out


def table(recs: dict[tuple[str, Key], dict[str, Any]]) -> list[str]:
    """Per batch, mdloader / DeePMD-kit: calls under the tree, bytes requested by reads, bytes
    from storage and their ratio to the frames' bytes, and the tree left cached by an eviction."""
    lines = ["| format | ulimit -n | workers | page cache | path lookups | opens (of a file "
             "opened before) | fstats | read calls | KiB requested by reads | KiB from storage | "
             "storage ÷ payload | storage ÷ pages the rows span (mdloader) | tree left cached "
             "after eviction |",
             "|---|---|---:|---|---|---|---|---|---|---|---|---|---|"]
    for key, fmt, md, dp in _rows(recs):
        any_rec = next(r for r in (md, dp) if r is not None)  # every row has a record
        lines.append(
            f"| {fmt} | {_nofile(any_rec)} | {key[2]} | {WINDOWS.get(key[3], key[3])} | "
            f"{_both(md, dp, 'lookups')} | {_opens(md)} / {_opens(dp)} | "
            f"{_both(md, dp, 'fstats')} | {_both(md, dp, 'reads')} | "
            f"{_both(md, dp, 'bytes_requested', 1024)} | "
            f"{_both(md, dp, 'bytes_from_storage', 1024)} | "
            f"{_over_payload(md)} / {_over_payload(dp)} | {_over_pages(md)} | "
            f"{_left(md)} / {_left(dp)} |")
    return lines


def calls_table(recs: dict[tuple[str, Key], dict[str, Any]]) -> list[str]:
    """The calls per batch under the tree by name, in the cold-once window."""
    lines = ["| format | ulimit -n | workers | mdloader: calls per batch | "
             "DeePMD-kit: calls per batch |", "|---|---|---:|---|---|"]

    def named(rec: dict[str, Any] | None) -> str:
        if rec is None or rec.get("by_call") is None:
            return "–"
        n = rec["batches"]
        parts = [f"{name} {number(c / n)}" for name, c in
                 sorted(rec["by_call"].items(), key=lambda kv: -kv[1]) if c / n >= 0.005]
        return ", ".join(parts) or "none"

    for key, fmt, md, dp in _rows(recs):
        if key[3] != "cold":
            continue
        any_rec = next(r for r in (md, dp) if r is not None)  # every row has a record
        lines.append(f"| {fmt} | {_nofile(any_rec)} | {key[2]} | {named(md)} | {named(dp)} |")
    return lines


def warm_table(warm: list[dict[str, Any]]) -> list[str]:
    """The warm case, mdloader through the page cache and with direct reads: time per batch."""
    lines = ["| format | reads | ms per batch, median (range) | 1-minute load |",
             "|---|---|---|---:|"]
    for rec in warm:
        runs = sorted(rec["ms_per_batch"])
        median = runs[len(runs) // 2]
        lines.append(f"| {rec['format']} | "
                     f"{'direct (O_DIRECT)' if rec['direct_reads'] else 'page cache'} | "
                     f"{median:.3f} ({runs[0]:.3f}–{runs[-1]:.3f}) | {rec['loadavg_1min']:.1f} |")
    return lines


def section(path: str | None = None) -> str:
    """The markdown of the section's results: ``path``, else every results file of the family
    (:data:`DEFAULT` first), one after the other (a note when there are none yet)."""
    if path is None:
        found = sorted(glob.glob(os.path.join(os.path.dirname(DEFAULT), "*.jsonl")),
                       key=lambda p: (p != DEFAULT, p))
        if not found:
            return "*No results yet: run `python -m benchmarks.fs_traffic.run`.*"
        return "\n\n".join(section(p) for p in found)
    if not os.path.isfile(path):
        return "*No results yet: run `python -m benchmarks.fs_traffic.run`.*"
    meta, recs = load(path)
    loads = [r["loadavg_1min"] for r in recs.values() if "loadavg_1min" in r]
    head = (f"Run started {meta.get('started')} on a shared machine of {meta.get('cpus')} CPUs "
            f"(1-minute load {min(loads, default=0):.1f}–{max(loads, default=0):.1f}): "
            f"{meta.get('nsys'):,} water systems of {meta.get('natoms', 192):,} atoms and "
            f"{meta.get('nframes')} frames, "
            f"one frame per batch, {meta.get('payload_bytes_per_frame', 0) / 1024:.1f} KiB of "
            f"coord, box, energy and force per frame in storage; {meta.get('warmup')} batches of "
            f"warm-up, then two windows of {meta.get('batches')} batches (every "
            f"{meta.get('pass_batches')} batches a pass). Calls from `{meta.get('fs_tool')}`. "
            f"Each cell: mdloader / DeePMD-kit. Raw results: `{os.path.relpath(path, REPO)}`.")
    if meta.get("rerun"):
        head += (f" Rows of {', '.join(meta['rerun']['formats'])} from a run started "
                 f"{meta['rerun']['started']} with the same settings.")
    if meta.get("skipped"):
        head += f" Not run (not importable): {', '.join(meta['skipped'])}."
    if meta["failed"]:
        head += f" **Failed**: {'; '.join(meta['failed'])}."
    parts = [head, "", *table(recs), "", "Calls per batch under the data tree by name (cold "
             "once):", "", *calls_table(recs)]
    if meta["warm"]:
        first = meta["warm"][0]
        parts += ["", f"Warm case (`benchmarks.fs_traffic.warm`: the tree in the page cache, "
                  f"mdloader's feed without workers, {first['warmup']} batches of warm-up, then "
                  f"{first['repeats']} runs of {first['batches']} batches):", "",
                  *warm_table(meta["warm"])]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.parse_args(argv)
    from benchmarks import report

    return report.main([*sorted(glob.glob(os.path.join(RESULTS, "*.jsonl"))), "--keep-plots"])


if __name__ == "__main__":
    sys.exit(main())


#: The results file of frames of 1 536 atoms (a row larger than a page), and that of the npy
#: rows read with ``MDLOADER_DIRECT_READS=1``.
LARGE = os.path.join(os.path.dirname(DEFAULT), "atoms1536.jsonl")
DIRECT_RESULTS = os.path.join(os.path.dirname(DEFAULT), "npy_direct.jsonl")


def readme_figures() -> dict[str, str]:
    """The README's figures of this family: per batch at steady state, with 2 workers, the soft
    ``ulimit -n`` of 1024, the tree evicted every pass (no figure without results)."""
    figures: dict[str, str] = {}
    for name, path in (("small", DEFAULT), ("large", LARGE)):
        if not os.path.isfile(path):
            continue
        _meta, recs = load(path)
        for fmt in ("npy", "hdf5"):
            md, dp = (recs.get((impl, (fmt, "1024", 2, "per-pass"))) for impl in (MD, DP))
            if md is None or dp is None:
                continue
            if name == "small":
                figures[f"fs_{fmt}_lookups_dp"] = number(dp["per_batch"]["lookups"])
                figures[f"fs_{fmt}_lookups_md"] = number(md["per_batch"]["lookups"])
                figures[f"fs_{fmt}_opens_md"] = number(md["per_batch"]["opens"])
            figures[f"fs_{fmt}_payload_md_{name}"] = _over_payload(md)
            figures[f"fs_{fmt}_payload_dp_{name}"] = _over_payload(dp)
    if os.path.isfile(DIRECT_RESULTS):
        _meta, recs = load(DIRECT_RESULTS)
        direct = recs.get((DIRECT, ("npy", "1024", 2, "per-pass")))
        if direct is not None:
            figures["fs_npy_payload_direct_small"] = _over_payload(direct)
    return figures
