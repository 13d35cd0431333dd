"""From a time-stamped training log to the phases of time to first step (pure functions).

``dp --pt train`` and ``mdloader dp --pt train`` print the same DeePMD-kit log lines (mdloader's
records go through DeePMD-kit's logger); ``mdloader train`` prints its own. Each phase starts at
the first line matching its marker and ends where the next phase found in the log starts, so a
phase that a run skips (input statistics at a restart) is absent rather than zero, and the phases
add up to the time to first step. ``MARKERS`` and ``TRAIN_MARKERS`` are the one place to adjust
when a loader's log lines change.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

# (phase, what its first line looks like), in DeePMD-kit's order; the "start-up" phase runs from
# the launch to the first marker found (imports, reading input.json).
MARKERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("neighbour statistics", re.compile(r"Calculate neighbou?r statistics")),
    # DeePMD-kit's last neighbour-statistics line; what follows is the process group and the build
    ("build", re.compile(r"Neighbou?r statistics: training data with maximum neighbou?r size")),
    # DeePMD-kit's make_stat_input, or mdloader's sharded input statistics under ``dp``
    ("input statistics", re.compile(r"Packing data for statistics|"
                                    r"input statistics: (all|\d+ of \d+) frames")),
    # the model, DDP and the data summary are done: the first batch and step follow
    ("first step", re.compile(r"Start to train \d+ steps")),
)
PHASES = ("start-up",) + tuple(name for name, _ in MARKERS)
# DeePMD-kit prints "Batch <step>: trn: ..." ("<task>_trn" per task) when a step completes
FIRST_STEP_DONE = re.compile(r"Batch\s+\d+: (\w+_)?trn")  # multi-task: "<task>_trn"

# ``mdloader train``'s log: no neighbour statistics (its reference model has no ``sel``)
TRAIN_MARKERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("build", re.compile(r"mdloader\.threads: torch threads")),  # its first line after imports
    ("input statistics", re.compile(r"Summary of DataSystem: training")),
    ("first step", re.compile(r"energy bias per type|restarted from \S+ at step")),
)
TRAIN_STEP_DONE = re.compile(r"mdloader\.train\.job: step \d+/\d+:")


def markers_of(impl: str) -> tuple[tuple[tuple[str, re.Pattern[str]], ...], re.Pattern[str]]:
    """The phase markers and the completed-step line of a loader's log."""
    if impl == "mdloader-train":
        return TRAIN_MARKERS, TRAIN_STEP_DONE
    return MARKERS, FIRST_STEP_DONE


def stamped_lines(text: str) -> list[tuple[float, str]]:
    """Lines ``"<seconds since launch> <line>"`` (what the harness writes) as (t, line)."""
    out = []
    for raw in text.splitlines():
        stamp, _, line = raw.partition(" ")
        try:
            out.append((float(stamp), line))
        except ValueError:
            continue
    return out


def find_markers(lines: Iterable[tuple[float, str]],
                 impl: str = "deepmd") -> dict[str, tuple[float, str]]:
    """The first (time, line) of every phase marker and of the first completed step."""
    markers, done = markers_of(impl)
    found: dict[str, tuple[float, str]] = {}
    for t, line in lines:
        for name, pattern in markers:
            if name not in found and pattern.search(line):
                found[name] = (t, line.strip())
        if "ready" not in found and done.search(line):
            found["ready"] = (t, line.strip())
    return found


def phases(found: dict[str, tuple[float, str]],
           end: float | None = None) -> tuple[dict[str, float], float | None]:
    """Seconds per phase and the time to first step (``None`` if no step completed).

    Without a completed step (a stopped run), the last phase found runs to ``end``.
    """
    starts = [(0.0, "start-up")]
    starts += sorted((found[name][0], name) for name in PHASES[1:] if name in found)
    ready = found["ready"][0] if "ready" in found else None
    stop = ready if ready is not None else end
    out: dict[str, float] = {}
    for (t0, name), nxt in zip(starts, starts[1:] + [(stop, "")]):
        if nxt[0] is not None:
            out[name] = round(max(nxt[0] - t0, 0.0), 3)
    return out, ready


def window_cpu(samples: Sequence[tuple[float, float]], t0: float, t1: float) -> float:
    """CPU seconds spent between ``t0`` and ``t1``, from cumulative (time, CPU s) samples
    (linear between samples; the first and last sample bound the window)."""
    if not samples:
        return float("nan")

    def at(t: float) -> float:
        if t <= samples[0][0]:
            return samples[0][1]
        for (ta, ca), (tb, cb) in zip(samples, samples[1:]):
            if t <= tb:
                return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else cb
        return samples[-1][1]

    return round(at(t1) - at(t0), 3)


def phase_windows(found: dict[str, tuple[float, str]],
                  end: float | None = None) -> dict[str, tuple[float, float]]:
    """(start, end) in seconds since launch of every phase present (see :func:`phases`)."""
    durations, _ready = phases(found, end)
    out = {}
    for name, seconds in durations.items():
        start = 0.0 if name == "start-up" else found[name][0]
        out[name] = (start, start + seconds)
    return out
