"""Data stalls: how long the trainer waits for its data, on every rank, reported every few steps.

Each rank's :class:`StallMeter` times what the trainer spends in a stream's ``next`` (wall
seconds: the wait; this thread's CPU seconds: the loader's cost in the main process), step by
step, and counts what the rank reads: the bytes of the batches' arrays (the payload), the bytes
its processes, DataLoader workers included, fetched from storage (``read_bytes`` of
``/proc/<pid>/io``: page-cache misses, read-ahead included) and the files they opened for the
data (:func:`~mdloader.data.formats.handles.opened`). Every ``every`` steps the ranks' figures go to
rank 0 in one gather, none per step; rank 0 logs one line and appends a JSON line to
``stalls.jsonl`` beside ``lcurve.out`` (``mdloader report`` reads it). The end of the run logs a
summary: median and 99th-percentile wait per step, the share of the run spent waiting, the rank
that waited most.

The figures of a window are pure functions of the gathered matrix (:func:`window_figures`). A
rank sends at most :data:`DETAIL` per-step columns (longer windows sum consecutive steps into
buckets) and the run's percentiles come from a fixed log-spaced histogram, so rank 0 holds
O(ranks) numbers whatever the report interval and the length of the run, and the other ranks
send a few hundred bytes per report.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import get_worker_info

from mdloader.data.formats.handles import opened
from mdloader.distributed.collectives import gather_rows_to_main

log = logging.getLogger(__name__)

FILE_NAME = "stalls.jsonl"
#: The totals each rank sends after its per-step waits, in this order.
TOTALS = ("steps", "steps_per_bucket", "step_seconds", "wait_seconds", "main_seconds", "batches",
          "payload_bytes", "bytes_from_storage", "opens")
#: Most per-step columns a rank sends: a window of more steps sums consecutive steps into
#: buckets, so a report's row, and rank 0's matrix, do not grow with the report interval.
DETAIL = 64
#: Histogram edges for the run's wait percentiles: 1 µs to 1000 s, 20 bins per decade (12 %).
EDGES = np.logspace(-6, 3, 9 * 20 + 1)


def storage_bytes() -> int:
    """The bytes this process fetched from storage so far (``read_bytes`` of
    ``/proc/self/io``); 0 where the kernel does not say (not Linux, not permitted)."""
    try:
        with open("/proc/self/io", "rb") as fh:
            for line in fh:
                if line.startswith(b"read_bytes:"):
                    return int(line.split(b":", 1)[1])
    except (OSError, ValueError):
        pass
    return 0


def payload_bytes(batches: Sequence[Any]) -> int:
    """The bytes of the batches' arrays (numpy or torch)."""
    return sum(int(getattr(value, "nbytes", 0)) for batch in batches
               if isinstance(batch, Mapping) for value in batch.values())


_last_io: list[Any] = [None, 0.0, 0]  # pid, when, the bytes from storage then
IO_REFRESH = 0.25  # seconds between two reads of /proc/self/io in a worker (one costs ~30 µs)


def io_snapshot(batches: Sequence[Any]) -> tuple[int, int | None, int, int]:
    """``(bytes of the batches' arrays, pid, files opened, bytes from storage)``, what the
    process that read ``batches`` sends with them (:class:`WorkerIO`): a DataLoader worker its own
    counters, its bytes at most :data:`IO_REFRESH` old; the main process, which counts its
    own, no pid."""
    if get_worker_info() is None:
        return payload_bytes(batches), None, 0, 0
    now = time.monotonic()
    if _last_io[0] != os.getpid() or now - _last_io[1] > IO_REFRESH:
        _last_io[:] = [os.getpid(), now, storage_bytes()]
    return payload_bytes(batches), os.getpid(), opened(), _last_io[2]


class WorkerIO:
    """What a pool's batches came with (:func:`io_snapshot`): the bytes of their arrays, and the
    latest counters of each worker process, whose sum is what the workers read so far (a worker
    that ends keeps its last counters)."""

    def __init__(self) -> None:
        self.payload = 0
        self.latest: dict[int, tuple[int, int]] = {}

    def note(self, snapshot: tuple[int, int | None, int, int]) -> None:
        payload, pid, opens, storage = snapshot
        self.payload += payload
        if pid is not None:  # None: read in this process, which counts its own
            self.latest[pid] = (opens, storage)

    def totals(self) -> tuple[int, int, int]:
        """``(files opened, bytes from storage, bytes of arrays)`` of the pool so far: the
        workers' files and storage bytes, every batch's arrays."""
        rows = list(self.latest.values())
        return sum(r[0] for r in rows), sum(r[1] for r in rows), self.payload


@dataclass
class WindowFigures:
    """What one report says of a window of steps (every rank's figures on rank 0)."""

    first_step: int
    last_step: int
    ranks: int
    wait_share: float
    wait_ms_p50: float
    wait_ms_p99: float
    main_ms_per_batch: float
    payload_bytes_per_step: float
    storage_bytes_per_step: float
    opens_per_step: float
    slowest_rank: int
    slowest_rank_wait_share: float
    skew: float
    rank_wait_ms: list[float] = field(default_factory=list)

    def line(self) -> str:
        return (f"data stalls, steps {self.first_step}-{self.last_step} ({self.ranks} "
                f"rank{'s' if self.ranks > 1 else ''}): waited {self.wait_share:.1%} of step "
                f"time, {self.wait_ms_p50:.3g} ms median and {self.wait_ms_p99:.3g} ms p99 per "
                f"step; main process {self.main_ms_per_batch:.3g} ms per batch; per step and "
                f"rank {_size(self.payload_bytes_per_step)} of arrays, "
                f"{_size(self.storage_bytes_per_step)} from storage, "
                f"{self.opens_per_step:.2g} files opened; slowest rank "
                f"{self.slowest_rank} (waited {self.slowest_rank_wait_share:.1%}), its batch "
                f"cost {self.skew:.2f}x the mean")

    def record(self) -> dict[str, Any]:
        return {"kind": "window", "time": time.time(), **self.__dict__}


def step_waits(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The waits of a gathered ``matrix`` (a row per rank: waits summed per bucket of
    ``steps_per_bucket`` steps, then :data:`TOTALS`) as ``(bucket sums, steps per bucket)``: the
    buckets the window's steps filled (the last one may hold fewer steps)."""
    totals = matrix[:, -len(TOTALS):]
    steps = int(totals[:, TOTALS.index("steps")].min())
    size = int(totals[0, TOTALS.index("steps_per_bucket")])
    used = -(-steps // size)
    counts = np.full(used, size, dtype=np.float64)
    if used:
        counts[-1] = steps - size * (used - 1)
    return matrix[:, :used], counts


def window_figures(matrix: np.ndarray, first_step: int) -> WindowFigures:
    """The figures of one window from the gathered ``matrix`` (rows as :func:`step_waits`
    reads them): percentiles of the wait per step over the ranks and buckets (a bucket counts
    as its steps' mean), and the slowest rank's cost against the mean per bucket."""
    ranks = matrix.shape[0]
    totals = matrix[:, -len(TOTALS):]
    col = {name: totals[:, i] for i, name in enumerate(TOTALS)}
    steps = int(col["steps"].min())
    waits, counts = step_waits(matrix)
    step_seconds = np.maximum(col["step_seconds"], 1e-12)
    rank_share = col["wait_seconds"] / step_seconds
    slowest = int(np.argmax(col["wait_seconds"]))
    per_step_max, per_step_mean = waits.max(axis=0), waits.mean(axis=0)
    skew = float(per_step_max.sum() / per_step_mean.sum()) if per_step_mean.sum() > 0 else 1.0
    batches = max(float(col["batches"].sum()), 1.0)
    done = max(steps, 1) * ranks
    p50, p99 = (np.percentile(waits / counts, [50, 99]) * 1e3 if waits.size else (0.0, 0.0))
    return WindowFigures(
        first_step=first_step, last_step=first_step + steps - 1, ranks=ranks,
        wait_share=float(col["wait_seconds"].sum() / step_seconds.sum()),
        wait_ms_p50=float(p50), wait_ms_p99=float(p99),
        main_ms_per_batch=float(col["main_seconds"].sum() / batches * 1e3),
        payload_bytes_per_step=float(col["payload_bytes"].sum() / done),
        storage_bytes_per_step=float(col["bytes_from_storage"].sum() / done),
        opens_per_step=float(col["opens"].sum() / done), slowest_rank=slowest,
        slowest_rank_wait_share=float(rank_share[slowest]), skew=skew,
        rank_wait_ms=[float(w) for w in col["wait_seconds"] / max(steps, 1) * 1e3])


def histogram_percentile(counts: np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0..100) of values binned on :data:`EDGES`: the geometric middle
    of the bin it falls in (0 when nothing was counted)."""
    total = counts.sum()
    if total == 0:
        return 0.0
    index = int(np.searchsorted(np.cumsum(counts), q / 100 * total, side="left"))
    index = min(index, len(counts) - 1)
    return float(math.sqrt(EDGES[index] * EDGES[index + 1]))


class RunSummary:
    """Rank 0's account of the whole run: a wait histogram, and each rank's wait and step time."""

    def __init__(self) -> None:
        self.counts = np.zeros(len(EDGES) - 1, dtype=np.int64)
        self.wait = self.step = np.zeros(0)
        self.steps = 0

    def add(self, matrix: np.ndarray) -> None:
        """Count a window's gathered matrix (rows as :func:`window_figures` takes them)."""
        totals = matrix[:, -len(TOTALS):]
        steps = int(totals[:, TOTALS.index("steps")].min())
        waits, counts = step_waits(matrix)
        means = np.clip((waits / counts).ravel(), EDGES[0], EDGES[-1])
        weights = np.broadcast_to(counts, waits.shape).ravel()
        self.counts += np.histogram(means, bins=EDGES, weights=weights)[0].astype(np.int64)
        if self.wait.shape != (matrix.shape[0],):
            self.wait, self.step = np.zeros(matrix.shape[0]), np.zeros(matrix.shape[0])
        self.wait = self.wait + totals[:, TOTALS.index("wait_seconds")]
        self.step = self.step + totals[:, TOTALS.index("step_seconds")]
        self.steps += steps

    def record(self) -> dict[str, Any]:
        worst = int(np.argmax(self.wait)) if self.wait.size else 0
        share = self.wait / np.maximum(self.step, 1e-12) if self.wait.size else np.zeros(1)
        return {"kind": "summary", "time": time.time(), "steps": self.steps,
                "ranks": int(self.wait.size),
                "wait_share": float(self.wait.sum() / max(self.step.sum(), 1e-12)),
                "wait_ms_p50": histogram_percentile(self.counts, 50) * 1e3,
                "wait_ms_p99": histogram_percentile(self.counts, 99) * 1e3,
                "worst_rank": worst, "worst_rank_wait_share": float(share[worst])}


def summary_line(record: dict[str, Any]) -> str:
    return (f"data stalls over the run ({record['steps']} steps, {record['ranks']} ranks): "
            f"waited {record['wait_share']:.1%} of step time, {record['wait_ms_p50']:.3g} ms "
            f"median and {record['wait_ms_p99']:.3g} ms p99 per step; rank "
            f"{record['worst_rank']} waited most ({record['worst_rank_wait_share']:.1%})")


class StallMeter:
    """One rank's stall accounting of a feed (see the module).

    Parameters
    ----------
    every
        Steps per report (one gather to rank 0 each).
    directory
        Where rank 0 appends ``stalls.jsonl`` (``None``: log lines only, as in the tests).
    is_main
        Whether this rank logs and writes.
    workers
        The worker counters of the feed's pools, read at each report.
    """

    def __init__(self, every: int, directory: str | None, *, is_main: bool,
                 workers: Sequence[WorkerIO] = ()) -> None:
        self.every = max(1, int(every))
        self.directory, self.is_main = directory, bool(is_main)
        self.workers = list(workers)
        self.bucket = -(-self.every // DETAIL)  # steps summed per column sent
        self.waits = np.zeros(-(-self.every // self.bucket))
        self.steps = 0
        self.first_step: int | None = None
        self.step_started: float | None = None
        self.totals = dict.fromkeys(TOTALS, 0.0)
        self.io_mark = self._io()
        self.summary = RunSummary() if is_main else None

    def start_wait(self) -> tuple[float, float]:
        """The trainer starts waiting for a batch: the clocks, for :meth:`end_wait`."""
        return time.perf_counter(), time.thread_time()

    def end_wait(self, started: tuple[float, float]) -> None:
        """The batch came: the wait's wall and main-thread CPU seconds."""
        spent = time.perf_counter() - started[0]
        self.totals["wait_seconds"] += spent
        self.totals["main_seconds"] += time.thread_time() - started[1]
        self.totals["batches"] += 1
        if self.steps < self.every and self.step_started is not None:
            self.waits[self.steps // self.bucket] += spent

    def step(self, step: int) -> None:
        """The training step ``step`` (0-based) starts: the previous one ends; a report every
        :attr:`every` steps (a collective: every rank calls this at the same steps)."""
        now = time.perf_counter()
        if self.step_started is not None:
            self.totals["step_seconds"] += now - self.step_started
            self.steps += 1
            if self.steps == self.every:
                self.report()
        if self.first_step is None:
            self.first_step = step + 1
        self.step_started = time.perf_counter()

    def report(self) -> None:
        """Send this window's figures to rank 0 (a collective), which logs and writes them."""
        if self.first_step is None or self.steps == 0:
            return
        self.totals["steps"] = self.steps
        self.totals["steps_per_bucket"] = self.bucket
        io = self._io()
        for i, name in enumerate(("opens", "bytes_from_storage", "payload_bytes")):
            self.totals[name] = io[i] - self.io_mark[i]
        row = np.concatenate([self.waits, [self.totals[n] for n in TOTALS]])
        matrix = gather_rows_to_main(row, activity="gathering the data-stall figures")
        if matrix is not None and self.is_main:
            figures = window_figures(matrix, self.first_step)
            self.summary.add(matrix)  # type: ignore[union-attr]
            log.info("%s", figures.line())
            self._write(figures.record())
        self.first_step += self.steps
        self.steps = 0
        self.waits[:] = 0.0
        self.totals = dict.fromkeys(TOTALS, 0.0)
        self.io_mark = io

    def finish(self) -> None:
        """The run ended on every rank together: the last step ends, the last window is
        reported (a collective), then rank 0 logs and writes the summary."""
        if self.step_started is not None:
            self.totals["step_seconds"] += time.perf_counter() - self.step_started
            self.steps += 1
            self.step_started = None
        self.report()
        self.close()

    def close(self) -> None:
        """Rank 0 logs and writes the summary of what was reported (no collective: also on the
        way out of a failed run)."""
        if self.summary is None or self.summary.steps == 0:
            return
        record = self.summary.record()
        log.info("%s", summary_line(record))
        self._write(record)
        self.summary = RunSummary()

    def _io(self) -> tuple[int, int, int]:
        """``(files opened, bytes from storage, bytes of arrays)`` of this rank so far."""
        opens, storage, payload = opened(), storage_bytes(), 0
        for pool in self.workers:
            w_opens, w_storage, w_payload = pool.totals()
            opens, storage, payload = opens + w_opens, storage + w_storage, payload + w_payload
        return opens, storage, payload

    def _write(self, record: dict[str, Any]) -> None:
        if self.directory is None:
            return
        with open(os.path.join(self.directory, FILE_NAME), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")


def _size(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.3g} {unit}"
        count /= 1000
    return f"{count:.3g} GB"  # pragma: no cover


__all__ = ["FILE_NAME", "RunSummary", "StallMeter", "WindowFigures", "WorkerIO", "io_snapshot",
           "payload_bytes", "storage_bytes", "window_figures"]
