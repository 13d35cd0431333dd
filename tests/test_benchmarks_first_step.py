"""The time-to-first-step benchmark's log parsing and report, on recorded log text (no run)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.data import NATOMS, ensure_water, min_distance
from benchmarks.data import WATER_NFRAMES as NFRAMES
from benchmarks.first_step import phases as fsp
from benchmarks.first_step import report as first_step_report

PREFIX = "[2026-12-01 12:24:23,918] DEEPMD INFO    "
# abridged from a `torchrun --nproc_per_node=2 -m benchmarks.first_step.dp_cpu --pt train` log
# (4 systems)
FIRST_START = """\
0.513 To get the best performance, it is recommended to adjust the number of threads
2.610 {I}DeePMD version: 3.2.0
2.686 {I}Calculate neighbor statistics... (add --skip-neighbor-stat ...)
2.928 {I}Calculate neighbor statistics... (add --skip-neighbor-stat ...)
6.900 {I}Neighbor statistics: training data with minimal neighbor distance: 0.88
6.910 {I}Neighbor statistics: training data with maximum neighbor size: [37 70]
7.264 {I}Constructing DataLoaders from 4 systems
7.449 {I}Packing data for statistics from 4 systems
11.030 {I}RMSE of energy per atom after linear regression is: 0.002
12.883 {I}Start to train 1 steps.
12.895 {I}Start to train 1 steps.
14.791 {I}Batch       1: trn: rmse = 2.66e+01, lr = 3.00e-03
14.800 {I}Batch       1: total wall time = 1.93 s
14.836 {I}Saved model to model.ckpt-1.pt
""".replace("{I}", PREFIX)

# a restart (`mdloader dp ... --restart model.ckpt.pt`): no input statistics
RESTART = """\
10.431 {I}DeePMD version: 3.2.0
10.704 {I}Calculate neighbor statistics... (add --skip-neighbor-stat ...)
19.500 {I}Neighbor statistics: training data with maximum neighbor size: [37 70]
20.252 {I}loaded 4 systems (32 frames)
20.578 {I}Resuming from model.ckpt.pt.
20.855 {I}Start to train 2 steps.
23.263 {I}Batch       1: trn: rmse = 3.35e+01, lr = 3.00e-03
24.908 {I}Batch       2: trn: rmse = 1.33e+01, lr = 5.48e-04
""".replace("{I}", PREFIX)


def test_first_start_phases_from_the_first_marker_lines() -> None:
    found = fsp.find_markers(fsp.stamped_lines(FIRST_START))
    durations, ready = fsp.phases(found)
    assert ready == 14.791
    assert durations == pytest.approx({"start-up": 2.686, "neighbour statistics": 6.91 - 2.686,
                                       "build": 7.449 - 6.91, "input statistics": 12.883 - 7.449,
                                       "first step": 14.791 - 12.883})
    assert sum(durations.values()) == pytest.approx(ready)
    assert found["ready"][1].endswith("lr = 3.00e-03")


def test_restart_has_no_input_statistics_and_ends_at_its_first_step() -> None:
    durations, ready = fsp.phases(fsp.find_markers(fsp.stamped_lines(RESTART)))
    assert ready == 23.263  # the first "Batch N: trn" line, not the last
    assert list(durations) == ["start-up", "neighbour statistics", "build", "first step"]
    assert durations["build"] == pytest.approx(20.855 - 19.5)


def test_stopped_run_ends_its_last_phase_at_the_stop() -> None:
    cut = "\n".join(FIRST_START.splitlines()[:5])  # stopped inside the neighbour statistics
    found = fsp.find_markers(fsp.stamped_lines(cut))
    durations, ready = fsp.phases(found, end=600.0)
    assert ready is None
    assert durations == pytest.approx({"start-up": 2.686, "neighbour statistics": 600 - 2.686})
    assert fsp.phase_windows(found, end=600.0)["neighbour statistics"] == (2.686, 600.0)


# abridged from a `torchrun --nproc_per_node=2 -m mdloader train input.json` log, and its restart
TRAIN_FIRST = """\
2.950 2026-12-01 14:47:19 INFO    mdloader.threads: torch threads per rank: 1 (2 core(s) ...)
3.010 2026-12-01 14:47:19 INFO    mdloader.loading.build: built 3 systems (320 frames), ...
3.020 2026-12-01 14:47:19 INFO    mdloader.loading.loader: ---Summary of DataSystem: training ...
3.400 2026-12-01 14:47:19 INFO    mdloader.train.statistics: energy bias per type from 30 frames
4.100 2026-12-01 14:47:20 INFO    mdloader.train.job: step 1/1: rmse_f_trn 0.916, lr 3.0e-03
"""
TRAIN_RESTART = """\
2.900 2026-12-01 14:47:29 INFO    mdloader.threads: torch threads per rank: 1 (2 core(s) ...)
3.000 2026-12-01 14:47:29 INFO    mdloader.loading.loader: ---Summary of DataSystem: training ...
3.200 2026-12-01 14:47:29 INFO    mdloader.train.job: restarted from model.ckpt.pt at step 1
3.900 2026-12-01 14:47:30 INFO    mdloader.train.job: step 2/2: rmse_f_trn 0.8, lr 3.0e-03
"""


def test_mdloader_train_log_has_its_own_markers() -> None:
    durations, ready = fsp.phases(fsp.find_markers(fsp.stamped_lines(TRAIN_FIRST),
                                                   "mdloader-train"))
    assert ready == 4.1
    assert durations == pytest.approx({"start-up": 2.95, "build": 0.07,
                                       "input statistics": 0.38, "first step": 0.7})
    durations, ready = fsp.phases(fsp.find_markers(fsp.stamped_lines(TRAIN_RESTART),
                                                   "mdloader-train"))
    assert ready == 3.9 and "input statistics" in durations  # the summary line marks it
    assert durations["first step"] == pytest.approx(0.7)
    assert fsp.find_markers(fsp.stamped_lines(TRAIN_FIRST)) == {}  # DeePMD-kit's markers


def test_window_cpu_interpolates_cumulative_samples() -> None:
    samples = [(0.0, 0.0), (1.0, 1.0), (3.0, 2.0)]
    assert fsp.window_cpu(samples, 0.5, 2.0) == pytest.approx(1.0)
    assert fsp.window_cpu(samples, -1.0, 10.0) == pytest.approx(2.0)
    assert np.isnan(fsp.window_cpu([], 0.0, 1.0))


def test_report_section_side_by_side_with_stopped_rows(tmp_path: Path) -> None:
    base = {"kind": "first_step", "run": "r", "nsys": 200, "world": 2, "loadavg_1min": 3.0}
    recs = [{"kind": "first_step-meta", "run": "r", "cpus": 2},
            {**base, "impl": "mdloader", "start": "first", "status": "ok", "ready_s": 20.0,
             "timeout_s": 240, "phases": {"start-up": 5.0, "first step": 15.0},
             "cpu_s": {"neighbour statistics": [4.0, 4.0], "input statistics": [2.0, 1.0]},
             "peak_rss_mib": [800.0, 790.0], "peak_tree_rss_mib": [1600.0, 1500.0]},
            {**base, "impl": "deepmd", "start": "first", "status": "stopped", "ready_s": None,
             "timeout_s": 240, "phases": {"start-up": 5.0, "neighbour statistics": 235.0}},
            {**base, "impl": "mdloader-train", "start": "first", "status": "ok", "ready_s": 9.0,
             "timeout_s": 240, "phases": {"start-up": 3.0, "first step": 6.0}}]
    path = tmp_path / "fs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = first_step_report.section(str(path))
    row = next(line for line in text.splitlines() if line.startswith("| 200 | 2 | first"))
    assert "| 20 | > 240 (stopped) |" in row and "235 (stopped)" in row
    assert "| mdloader dp, 200 systems, first start: ready to step ≤ 30 s, W = 2 | 20 s | yes |" \
        in text
    assert "| mdloader dp, 200 systems, restart: ready to step ≤ 5 s | – | – |" in text
    assert "| mdloader train, 200 systems, first start: ready to step ≤ 30 s, W = 2 | 9 s | yes |" \
        in text
    assert "| 20 | > 240 (stopped) | – | 9 |" in row
    assert "6 / 5" in text  # statistics CPU per rank, neighbour + input


def test_water_systems_are_physical(tmp_path: Path) -> None:
    root = Path(ensure_water(3, base=str(tmp_path)))
    systems = sorted(root.iterdir())
    assert [s.name for s in systems] == ["sys.0", "sys.1", "sys.2"]
    coord = np.load(systems[1] / "set.000" / "coord.npy")
    box = np.load(systems[1] / "set.000" / "box.npy")
    assert coord.shape == (NFRAMES, NATOMS * 3)
    assert (np.loadtxt(systems[1] / "type.raw") == 0).sum() == 64
    for frame, cell in zip(coord, box):
        assert 0.8 < min_distance(frame.reshape(-1, 3).astype(float), float(cell[0])) < 1.2


def test_sharded_input_statistics_lines_start_the_phase() -> None:
    """mdloader's sharded pass starts the input-statistics phase, on every frame or a subset."""
    for line in ("input statistics: all frames of 4 systems, in shares on 2 ranks",
                 "input statistics: 8 of 32 frames of 4 systems (data_stat_nbatch=2, the frames "
                 "of a one-rank job), in shares on 2 ranks"):
        found = fsp.find_markers([(1.0, PREFIX + line)])
        assert found["input statistics"][0] == 1.0
    assert "input statistics" not in fsp.find_markers(
        [(1.0, PREFIX + "input statistics: DeePMD-kit's own (training.stat_file is set)")])


def test_water_systems_with_more_frames(tmp_path: Path) -> None:
    root = Path(ensure_water(2, base=str(tmp_path), nframes=12))
    assert root.name == "water192_n2_f12_seed0"
    assert np.load(root / "sys.1" / "set.000" / "coord.npy").shape == (12, NATOMS * 3)
    assert Path(ensure_water(2, base=str(tmp_path))).name == "water192_n2_seed0"
