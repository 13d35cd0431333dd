"""What one run of the GPU check measured, from its time-stamped log and its stall report (pure
functions, tested on recorded text), and the table of every run.

**Steps per second**: the steps between the second and the last display line of the log over the
seconds between their arrival (:func:`benchmarks.launch.run_logged` stamps each line). The first
interval is left out: it holds the warm-up (CUDA context, kernels chosen on first use); the
checkpoint after the last line is left out too. Validation at each display is in, as in a job.

**Data wait**: the ``wait_share`` of the summary line that mdloader writes last in
``stalls.jsonl`` beside ``lcurve.out`` (the share of step time the trainer waited for its batch);
a run without that file has "no stall report". DeePMD-kit's own loader is measured by its step
rate only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

#: A display line of each trainer's log, with the step it ends.
DISPLAY = {
    "mdloader train": re.compile(r"mdloader\.train\.job: step (\d+)/\d+:"),
    # DeePMD-kit's (``dp`` and ``mdloader dp``): "Batch <step>: trn: rmse = ..."
    "deepmd": re.compile(r"Batch\s+(\d+): trn"),
}
STALLS = "stalls.jsonl"
NO_STALL_REPORT = "no stall report"


def display_pattern(trainer: str) -> re.Pattern[str]:
    """The display line of ``trainer``'s log."""
    return DISPLAY["mdloader train" if trainer == "mdloader train" else "deepmd"]


def step_rate(lines: Sequence[tuple[float, str]], pattern: re.Pattern[str]
              ) -> tuple[float | None, int]:
    """(steps per second between the second and the last display line, steps in that window);
    ``(None, 0)`` with fewer than three display lines (no interval after the warm-up)."""
    shown = [(t, int(m.group(1))) for t, line in lines if (m := pattern.search(line))]
    if len(shown) < 3:
        return None, 0
    (t0, s0), (t1, s1) = shown[1], shown[-1]
    steps = s1 - s0
    if steps <= 0 or t1 <= t0:
        return None, 0
    return steps / (t1 - t0), steps


def wait_share(folder: str) -> float | str:
    """The ``wait_share`` of the summary that ends ``folder/stalls.jsonl``, or why there is none
    (:data:`NO_STALL_REPORT` when the file is absent)."""
    path = os.path.join(folder, STALLS)
    if not os.path.isfile(path):
        return NO_STALL_REPORT
    with open(path) as fh:
        rows = [line for line in fh.read().splitlines() if line.strip()]
    if not rows:
        return "empty stall report"
    try:
        last = json.loads(rows[-1])
    except json.JSONDecodeError:
        return "unreadable stall report"
    share = last.get("wait_share") if isinstance(last, dict) else None
    if not isinstance(last, dict) or last.get("kind") != "summary" or share is None:
        return "stall report without a summary"
    return float(share)


def cell(value: Any, fmt: str) -> str:
    """A table cell: a number in ``fmt``, a note as it is, nothing as a dash."""
    if value is None:
        return "—"
    if isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)


COLUMNS = ("part", "trainer", "input", "workers", "device", "steps timed", "steps/s",
           "data wait", "status")


def table(records: Sequence[dict[str, Any]]) -> str:
    """The markdown table of the runs' records."""
    rows = ["| " + " | ".join(COLUMNS) + " |",
            "|" + "|".join("---:" if c in ("workers", "steps timed", "steps/s", "data wait")
                           else "---" for c in COLUMNS) + "|"]
    for rec in records:
        share = rec.get("wait_share")
        wait = f"{share:.1%}" if isinstance(share, float) else cell(share, "")
        rows.append("| " + " | ".join([
            f"({rec['part']})", rec["trainer"], rec["job"], str(rec["workers"]), rec["device"],
            cell(rec.get("steps_timed") or None, "d"), cell(rec.get("steps_per_s"), ".1f"),
            wait, rec["status"]]) + " |")
    return "\n".join(rows)
