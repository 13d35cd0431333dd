"""The scale section of ``docs/benchmarks.md``, from a results file of :mod:`benchmarks.scale.run`.

:mod:`benchmarks.report` calls :func:`section` when it rewrites the whole page.
"""

from __future__ import annotations

import os

from benchmarks import REPO
from benchmarks.aggregate import load
from benchmarks.scale.run import DEFAULT, FULL, table


def section(path: str | None = None) -> str:
    """The markdown of the section, from the full run's results where there are some, else the
    quick run's (a note when there are none yet)."""
    if path is None:
        path = FULL if os.path.isfile(FULL) else DEFAULT
    if not os.path.isfile(path):
        return "*No scale results yet: run `python -m benchmarks.scale.run`.*"
    meta, rows = load(path)
    kind = "`--quick` run (N = 10³, W ≤ 512)" if meta.get("quick") else "full run"
    head = (f"A {kind}, started {meta.get('started')}, {meta.get('cpus')} CPUs, machine load "
            f"{meta.get('loadavg_1min', 0):.1f}, {meta.get('budget_s')} s budget per cell, best of "
            f"{meta.get('repeat', 1)}. Raw results: `{os.path.relpath(path, REPO)}`. Each cell: "
            "time, then peak traced memory, of the larger of rank 0 and rank W − 1; the state "
            "row adds its JSON size." + (f" Note: {meta['note']}." if meta.get("note") else ""))
    return "\n".join([head, "", *table(rows)])
