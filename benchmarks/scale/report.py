"""The scale section of ``docs/benchmarks.md``, from a results file of :mod:`benchmarks.scale.run`.

:mod:`benchmarks.report` calls :func:`section` when it rewrites the whole page.
"""

from __future__ import annotations

import os

from benchmarks import REPO
from benchmarks.aggregate import load
from benchmarks.scale.run import DEFAULT, table


def section(path: str = DEFAULT) -> str:
    """The markdown of the section (a note when there are no results yet)."""
    if not os.path.isfile(path):
        return "*No scale results yet: run `python -m benchmarks.scale.run`.*"
    meta, rows = load(path)
    kind = "`--quick` run (N = 10³, W ≤ 512)" if meta.get("quick") else "full run"
    head = (f"A {kind}, started {meta.get('started')}, {meta.get('cpus')} CPUs, machine load "
            f"{meta.get('loadavg_1min', 0):.1f}, {meta.get('budget_s')} s budget per cell. "
            f"Raw results: `{os.path.relpath(path, REPO)}`. Each cell: time, then peak "
            "traced memory, of the larger of rank 0 and rank W − 1; the state row adds its "
            "JSON size.")
    return "\n".join([head, "", *table(rows)])
