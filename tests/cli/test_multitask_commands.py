"""``check``, ``stat``, ``index`` and ``bench`` on a multi-task input: two tasks, one shared and
one distinct system each; ``train`` refuses it and points to ``mdloader dp``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.inputs import write_input

from mdloader.cli.main import main
from mdloader.testing import make_system


def _job(tmp_path: Path, *, broken_b: bool = False) -> Path:
    data = tmp_path / "data"
    for name, natoms in (("shared", 5), ("only_a", 6), ("only_b", 4)):
        make_system(data, name, natoms=natoms, nframes=4, seed=natoms,
                    keys=("energy", "force"),
                    broken="frame_mismatch" if broken_b and name == "only_b" else None)
    descriptor = {"type": "se_e2_a", "rcut": 3.0, "rcut_smth": 0.5, "sel": "auto"}
    return write_input(tmp_path, {
        "model": {"shared_dict": {"tm": ["O", "H"], "desc": descriptor},
                  "model_dict": {t: {"type_map": "tm", "descriptor": "desc", "fitting_net": {}}
                                 for t in ("a", "b")}},
        "training": {"data_dict": {
            "a": {"training_data": {"systems": ["data/shared", "data/only_a"],
                                    "batch_size": 1},
                  "validation_data": {"systems": ["data/shared"], "batch_size": 1}},
            "b": {"training_data": {"systems": ["data/shared", "data/only_b"],
                                    "batch_size": 2}}},
            "numb_steps": 2, "seed": 1}})


def test_check_reports_every_task_and_the_weights(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = _job(tmp_path)
    assert main(["check", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["weights"] == {"a": 0.5, "b": 0.5}  # no model_prob: systems per task
    assert report["weights_rule"].startswith("systems per task")
    assert report["shared_descriptors"] == {"desc": ["a", "b"]}
    a, b = report["tasks"]["a"], report["tasks"]["b"]
    assert [r["system"] for r in a["sections"]["training_data"]["systems"]] == [
        str(tmp_path / "data" / "shared"), str(tmp_path / "data" / "only_a")]
    assert set(a["sections"]) == {"training_data", "validation_data"}
    assert set(b["sections"]) == {"training_data"}
    assert b["sections"]["training_data"]["totals"]["batches"] == 4  # 2 systems x 4/2
    assert a["sections"]["training_data"]["totals"]["batches"] == 8
    assert [s["block"] for s in a["statistics"]] == ["model.model_dict.a.descriptor"]
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "=== task a" in out and "=== task b" in out and "weight 0.500" in out
    assert out.rstrip().endswith("OK: no problem found in 2 task(s)")


def test_check_names_the_task_of_a_broken_system(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(_job(tmp_path, broken_b=True)), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["tasks"]["a"]["ok"] and not report["tasks"]["b"]["ok"]
    (problem,) = report["tasks"]["b"]["problems"]
    assert problem["system"] == str(tmp_path / "data" / "only_b")


def test_stat_per_task_computes_a_shared_system_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    path = _job(tmp_path)
    assert main(["stat", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    counts = [line for line in captured.err.splitlines() if "cached" in line]
    assert len(counts) == 2, counts
    # task b reuses the entry task a just wrote for the shared system
    assert "cached 0, computed 2" in counts[0] and "cached 1, computed 1" in counts[1]
    assert list(out["tasks"]) == ["a", "b"]
    a, b = out["tasks"]["a"]["blocks"][0], out["tasks"]["b"]["blocks"][0]
    assert a["block"] == "model.model_dict.a.descriptor" and out["tasks"]["b"]["systems"] == 2
    assert a["sel_given"] == b["sel_given"] == "auto"


def test_index_builds_each_section_once_and_inspect_reads_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MDLOADER_INDEX_SETTLE", "0")  # the systems were written just now
    path = _job(tmp_path)
    assert main(["index", "build", str(path), "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert [r["section"] for r in built] == ["training.data_dict.a.training_data",
                                             "training.data_dict.a.validation_data",
                                             "training.data_dict.b.training_data"]
    assert [r["systems"] for r in built] == [2, 1, 2]
    assert main(["index", "inspect", str(path), "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert [r["state"] for r in inspected] == ["unchanged"] * 3


def test_bench_runs_each_task(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["bench", str(_job(tmp_path)), "--batches", "2", "--num-workers", "0",
                 "--json"]) == 0
    tasks = json.loads(capsys.readouterr().out)
    assert list(tasks) == ["a", "b"]
    assert [rows[0]["nsys"] for rows in tasks.values()] == [2, 2]


def test_train_refuses_a_multitask_input_and_points_to_dp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(_job(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "mdloader train trains one task" in err and "mdloader dp --pt train" in err
