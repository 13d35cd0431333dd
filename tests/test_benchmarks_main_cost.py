"""The main-process cost benchmark at a tiny size: the records it writes and the section it makes
of them (fields and verdicts, never its timings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.main_cost import report
from benchmarks.main_cost import run as main_cost

WINDOW_FIELDS = {"kind", "rep", "natoms", "impl", "path", "format", "workers", "batches",
                 "wall_s", "batches_per_s", "cpu_us_per_batch", "loadavg_1min"}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("main_cost")
    out = tmp / "main_cost.jsonl"
    assert main_cost.main(["--nsys", "2", "--cells", "1", "--formats", "npy",
                           "--impls", "mdloader", "--reps", "1", "--seconds", "0.05",
                           "--warmup", "2", "--profile-batches", "10", "--profile-calls", "10",
                           "--data-base", str(tmp / "data"), "--out", str(out),
                           "--no-report"]) == 0
    return out


def test_every_window_has_its_figures(results: Path) -> None:
    meta, windows, profile, errors = report.load(str(results))
    assert errors == [] and meta["sizes"] == [192] and meta["reps"] == 1
    seen = {(w["impl"], w["path"], w["format"], w["workers"]) for w in windows}
    assert seen == {("mdloader", path, fmt, nw) for path in ("train", "dp")
                    for fmt in ("npy",) for nw in (0, 2)} | {
        ("numpy", "reference", "npy", 0)}
    for w in windows:
        assert WINDOW_FIELDS <= set(w), w
        assert w["batches"] > 0 and w["cpu_us_per_batch"] > 0
        if w["impl"] == "mdloader":
            assert {"process_cpu_us_per_batch", "step_cpu_us_per_batch"} <= set(w)


def test_the_profile_splits_both_paths(results: Path) -> None:
    profile = report.load(str(results))[2]
    assert profile is not None and profile["natoms"] == 192 and profile["workers"] == 2
    for path in ("train", "dp"):
        figures = profile["paths"][path]
        assert figures["profiled_us_per_batch"] > 0 and figures["unprofiled_us_per_batch"] > 0
        names = [p["part"] for p in figures["parts"]]
        assert any("record_function" in n for n in names)
        assert any("NonFiniteBatches" in n for n in names)
    assert {p["part"]: p["us_per_batch"] for p in profile["paths"]["train"]["parts"]}[
        "mdloader: `NonFiniteBatches` (the `mdloader dp` check)"] == 0  # not on train's path
    assert [r["batches_per_item"] for r in profile["grouped"]] == [1, 2, 4]
    assert all(r["us"] > 0 for r in profile["alone"])


def test_the_section_shows_each_row_and_the_profile(results: Path) -> None:
    text = report.section(str(results))
    assert text.startswith(report.BEGIN) and text.endswith(report.END)
    rows = [line for line in text.splitlines() if line.startswith("| 192 |")]
    assert len(rows) == 2 * 2  # 0 and 2 workers, in the two tables
    assert "**The profile**" in text and "(the floor)" in text
    assert "DeePMD-kit" in text.splitlines()[3]  # its columns stay, empty without it


def test_the_goal_needs_both_the_cpu_and_the_rate() -> None:
    def window(impl: str, path: str, workers: int, cpu: float, bps: float) -> dict:
        return {"natoms": 192, "format": "npy", "workers": workers, "impl": impl,
                "path": path, "cpu_us_per_batch": cpu, "batches_per_s": bps}

    windows = [window("numpy", "reference", 0, 100.0, 1000.0),
               window("mdloader", "train", 2, 250.0, 1200.0),
               window("mdloader", "dp", 2, 350.0, 1200.0),
               window("mdloader", "train", 0, 900.0, 800.0)]
    lines = report.table(windows)
    assert lines[2].endswith("| – |")  # no goal without workers
    assert lines[3].endswith("| yes / **no** |")
    assert report.goal(250.0, 900.0, 1000.0) is False  # slower than plain numpy
    assert report.goal(None, 900.0, 1000.0) is None
