"""The once-per-job staging section of ``docs/benchmarks.md``, from the results of
:mod:`benchmarks.staging_scale.run` (:mod:`benchmarks.report` calls :func:`section`)."""

from __future__ import annotations

import os

from benchmarks import REPO
from benchmarks.aggregate import load
from benchmarks.staging_scale.run import DEFAULT, table


def section(path: str = DEFAULT) -> str:
    """The markdown of the section (a note when there are no results yet)."""
    if not os.path.isfile(path):
        return "*No results yet: run `python -m benchmarks.staging_scale.run`.*"
    meta, rows = load(path)
    head = (f"Simulated {meta.get('started')} ({meta.get('ranks_per_node')} ranks per node, "
            f"{meta.get('steps')} steps drawn per size; raw results: "
            f"`{os.path.relpath(path, REPO)}`). Per job, in multiples of the data set's bytes; "
            "per step, in multiples of the step's payload (every rank's batch).")
    return "\n".join([head, "", *table(rows)])
