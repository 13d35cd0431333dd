"""The data-stall report: its figures as pure functions of the gathered matrix, one rank's meter
in a real feed (with and without workers), and a 2-rank ``mdloader train`` whose rank 1 reads
slowly on purpose, named by the report; ``mdloader report`` reads and draws what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.inputs import write_input

from mdloader.cli.report import read_records, run_report, text_summary
from mdloader.data.formats.handles import opened
from mdloader.errors import ConfigError, DataError
from mdloader.loading.build import Section
from mdloader.loading.feed import Feed, StreamSpec
from mdloader.loading.stalls import (
    EDGES,
    TOTALS,
    RunSummary,
    StallMeter,
    histogram_percentile,
    step_waits,
    window_figures,
)
from mdloader.sampling.loop import TrainingLoop
from mdloader.sampling.spec import SamplingSpec
from mdloader.testing import make_dataset
from mdloader.world import World

ROOT = Path(__file__).resolve().parents[2]


def _matrix(waits: list[list[float]], step_seconds: list[float],
            **totals: list[float]) -> np.ndarray:
    """Rows as every rank sends them: per-step waits, then :data:`TOTALS`."""
    rows = []
    for rank, per_step in enumerate(waits):
        values = {"steps": len(per_step), "steps_per_bucket": 1,
                  "step_seconds": step_seconds[rank],
                  "wait_seconds": sum(per_step), "main_seconds": 0.0, "batches": len(per_step),
                  "payload_bytes": 0.0, "bytes_from_storage": 0.0, "opens": 0.0}
        values.update({name: column[rank] for name, column in totals.items()})
        rows.append([*per_step, *(values[name] for name in TOTALS)])
    return np.array(rows, dtype=np.float64)


def test_a_window_names_the_slowest_rank_and_its_skew() -> None:
    waits = [[0.001, 0.001, 0.001, 0.001], [0.001, 0.002, 0.001, 0.002],
             [0.010, 0.001, 0.010, 0.001]]
    matrix = _matrix(waits, [0.1, 0.1, 0.1], main_seconds=[0.002, 0.002, 0.002],
                     payload_bytes=[4000, 4000, 4000], opens=[0, 4, 0],
                     bytes_from_storage=[0, 0, 12000])
    figures = window_figures(matrix, first_step=11)
    assert (figures.first_step, figures.last_step, figures.ranks) == (11, 14, 3)
    assert figures.slowest_rank == 2
    assert figures.slowest_rank_wait_share == pytest.approx(0.022 / 0.1)
    assert figures.wait_share == pytest.approx((0.004 + 0.006 + 0.022) / 0.3)
    # per step: the slowest rank's wait over the mean of the ranks', as sums over the window
    maxima, means = np.max(waits, axis=0), np.mean(waits, axis=0)
    assert figures.skew == pytest.approx(maxima.sum() / means.sum())
    assert figures.wait_ms_p50 == pytest.approx(1.0)
    assert figures.main_ms_per_batch == pytest.approx(0.006 / 12 * 1e3)
    assert figures.payload_bytes_per_step == pytest.approx(1000)
    assert figures.opens_per_step == pytest.approx(4 / 12)
    assert figures.storage_bytes_per_step == pytest.approx(1000)
    assert figures.rank_wait_ms == pytest.approx([1.0, 1.5, 5.5])
    assert "slowest rank 2" in figures.line() and "steps 11-14 (3 ranks)" in figures.line()


def test_a_long_window_sends_a_bounded_row_of_step_buckets() -> None:
    """Rank 0 gathers at most DETAIL columns per rank whatever the report interval: 200 steps
    are 50 buckets of 4, a bucket's wait counts as its steps' mean."""
    meter = StallMeter(200, None, is_main=True)
    assert (meter.bucket, meter.waits.shape) == (4, (50,))
    bucketed = np.array([[0.004, 0.008, 0.002, *_totals_row(steps=10, size=4, wait=0.014)],
                         [0.004, 0.004, 0.001, *_totals_row(steps=10, size=4, wait=0.009)]])
    waits, counts = step_waits(bucketed)
    assert counts.tolist() == [4, 4, 2] and waits.shape == (2, 3)
    figures = window_figures(bucketed, first_step=1)
    assert (figures.last_step, figures.slowest_rank) == (10, 0)
    assert figures.wait_ms_p50 == pytest.approx(1.0)  # means 1, 2, 1 and 1, 1, 0.5 ms
    assert figures.skew == pytest.approx((0.004 + 0.008 + 0.002) / (0.004 + 0.006 + 0.0015))


def _totals_row(*, steps: int, size: int, wait: float) -> list[float]:
    values = dict.fromkeys(TOTALS, 0.0) | {"steps": steps, "steps_per_bucket": size,
                                           "step_seconds": 1.0, "wait_seconds": wait,
                                           "batches": steps}
    return [values[name] for name in TOTALS]


def test_equal_ranks_have_no_skew() -> None:
    figures = window_figures(_matrix([[0.002] * 5] * 4, [1.0] * 4), first_step=1)
    assert figures.skew == pytest.approx(1.0)


def test_percentiles_of_the_run_come_from_the_histogram() -> None:
    rng = np.random.default_rng(3)
    values = rng.lognormal(mean=-7, sigma=1.5, size=20000)
    counts = np.histogram(np.clip(values, EDGES[0], EDGES[-1]), bins=EDGES)[0]
    for q in (50, 99):
        # within one bin (20 per decade: 12 %) of the exact percentile
        assert histogram_percentile(counts, q) == pytest.approx(np.percentile(values, q),
                                                                rel=0.13)
    assert histogram_percentile(np.zeros_like(counts), 50) == 0.0


def test_the_run_summary_adds_its_windows() -> None:
    summary = RunSummary()
    summary.add(_matrix([[0.001] * 3, [0.004] * 3], [0.1, 0.1]))
    summary.add(_matrix([[0.001] * 2, [0.004] * 2], [0.1, 0.1]))
    record = summary.record()
    assert (record["steps"], record["ranks"], record["worst_rank"]) == (5, 2, 1)
    assert record["worst_rank_wait_share"] == pytest.approx(0.02 / 0.2)
    assert record["wait_share"] == pytest.approx(0.025 / 0.4)


def _feed(tmp_path: Path, workers: int) -> Feed:
    paths = make_dataset(tmp_path / "data", 3, nframes=6, seed=1)
    spec = StreamSpec(Section.of(None, "training", paths), SamplingSpec(batch_size=2))
    return Feed.build([spec], seed=7, world=World(), labels=[], num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_one_rank_reports_every_few_steps_and_sums_up(tmp_path: Path, workers: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDLOADER_STALL_REPORT", "3")
    feed = _feed(tmp_path, workers)
    opened_here = opened()
    feed.start(0, TrainingLoop(displays=False), stall_dir=str(tmp_path))
    stream = feed.stream(None, "training")
    for _ in range(7):
        with feed.training_step():
            next(stream)
    feed.finish()
    feed.close()
    records = [json.loads(line) for line in (tmp_path / "stalls.jsonl").read_text().splitlines()]
    assert [(r["kind"], r.get("first_step"), r.get("last_step")) for r in records] == [
        ("window", 1, 3), ("window", 4, 6), ("window", 7, 7), ("summary", None, None)]
    assert records[-1]["steps"] == 7 and records[-1]["ranks"] == 1
    windows = records[:3]
    assert all(w["wait_share"] > 0 for w in windows)
    # counted as the batches arrive (a worker's item holds several): over the run, 7 batches
    payload = sum(w["payload_bytes_per_step"] * (w["last_step"] - w["first_step"] + 1)
                  for w in windows)
    assert payload >= 7 * 2 * 6 * 3 * 8  # at least 2 frames of 6 atoms' coordinates each
    # the files are opened where the batches are read: in the workers when there are workers
    opens = sum(w["opens_per_step"] * (w["last_step"] - w["first_step"] + 1) for w in windows)
    assert opens > 0
    assert (opened() - opened_here > 0) == (workers == 0)


def test_report_reads_and_refuses_clearly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="stalls.jsonl does not exist"):
        read_records(str(tmp_path))
    (tmp_path / "stalls.jsonl").write_text('{"kind": "window"\n')
    with pytest.raises(DataError, match="line 1 is not JSON"):
        read_records(str(tmp_path))
    (tmp_path / "stalls.jsonl").write_text('{"kind": "other"}\n')
    with pytest.raises(DataError, match="not a stall record"):
        read_records(str(tmp_path))


SLOW_RANK = """
import os, sys, time
from mdloader.loading.loader import DpLoaderSet

if os.environ["RANK"] == "1":  # rank 1's reads are slow on purpose
    read = DpLoaderSet.__getitem__

    def slow(self, key):
        time.sleep(0.02)
        return read(self, key)

    DpLoaderSet.__getitem__ = slow
from mdloader.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_ranks_name_the_rank_that_reads_slowly(tmp_path: Path) -> None:
    make_dataset(tmp_path / "data", 3, nframes=8, seed=2)
    write_input(tmp_path, {"model": {"type_map": ["O", "H"]},
                           "training": {"training_data": {"systems": ["data"], "batch_size": 2},
                                        "numb_steps": 24, "seed": 3, "disp_freq": 8,
                                        "save_freq": 1000}})
    (tmp_path / "slow_rank.py").write_text(SLOW_RANK)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "slow_rank.py", "train", "input.json",
                           "--rcut", "2.5", "--num-workers", "0", "-o", "out"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = [line for line in out.splitlines() if "mdloader.loading.stalls" in line]
    assert len(lines) == 4, out[-4000:]  # every disp_freq steps, then the summary
    assert all("slowest rank 1" in line for line in lines[:3]), lines
    assert "data stalls over the run (24 steps, 2 ranks)" in lines[3]
    assert "rank 1 waited most" in lines[3]
    windows, summaries = read_records(str(tmp_path / "out"))
    assert [(w["first_step"], w["last_step"]) for w in windows] == [(1, 8), (9, 16), (17, 24)]
    assert all(w["slowest_rank"] == 1 and w["skew"] > 1.5 for w in windows), windows
    assert summaries[-1]["worst_rank"] == 1
    assert "rank 1 waited most" in text_summary(windows, summaries)
    assert run_report(str(tmp_path / "out")) == 0
    picture = tmp_path / "out" / "stalls.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
