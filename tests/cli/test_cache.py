"""``mdloader cache``: what the cache holds, and pruning it by age and by the data sets in use."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from support.inputs import write_input

from mdloader.cli.main import main
from mdloader.persist import temporary_path
from mdloader.testing import make_dataset


def _input(tmp_path: Path, name: str, count: int) -> Path:
    systems = make_dataset(tmp_path / name, count, nframes=4, seed=count)
    return write_input(tmp_path, {
        "model": {"type_map": ["O", "H"], "fitting_net": {},
                  "descriptor": {"type": "se_e2_a", "sel": "auto", "rcut": 4.0,
                                 "rcut_smth": 0.5}},
        "training": {"training_data": {"systems": systems, "batch_size": 1},
                     "numb_steps": 1}}, f"{name}.json")


def _cache(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    assert main(["cache", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _counts(capsys: pytest.CaptureFixture[str]) -> dict[str, int]:
    return {row["kind"]: row["entries"] for row in _cache(capsys, "show")}


def _stat(capsys: pytest.CaptureFixture[str], path: Path) -> str:
    assert main(["stat", str(path)]) == 0
    return capsys.readouterr().err


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(folder))
    return folder


def test_show_lists_each_kind_with_its_entries_and_bytes(
        tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _counts(capsys) == {"index": 0, "statistics": 0}
    _stat(capsys, _input(tmp_path, "a", 3))
    rows = {row["kind"]: row for row in _cache(capsys, "show")}
    assert rows["index"]["entries"] == 1 and rows["statistics"]["entries"] == 3
    assert rows["index"]["folder"] == str(cache / "index")
    assert rows["statistics"]["folder"] == str(cache / "statistics")
    on_disk = {kind: sum(p.stat().st_size for p in (cache / kind).rglob(f"*.{suffix}"))
               for kind, suffix in (("index", "mdlidx"), ("statistics", "mdlstat"))}
    assert {kind: row["bytes"] for kind, row in rows.items()} == on_disk
    assert all(row["bytes"] > 0 and time.time() - row["last_use"] < 600
               for row in rows.values())
    assert main(["cache", "show"]) == 0
    text = capsys.readouterr().out
    assert "index: 1 entries" in text and "statistics: 3 entries" in text


def test_prune_keeps_what_the_given_data_sets_use_and_removes_the_rest(
        tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kept, other = _input(tmp_path, "a", 3), _input(tmp_path, "b", 2)
    _stat(capsys, kept)
    _stat(capsys, other)
    assert _counts(capsys) == {"index": 2, "statistics": 5}
    would = _cache(capsys, "prune", "--unmatched", str(kept), "--dry-run")
    assert sorted(e["kind"] for e in would) == ["index", "statistics", "statistics"]
    assert _counts(capsys) == {"index": 2, "statistics": 5}  # a dry run removes nothing
    removed = _cache(capsys, "prune", "--unmatched", str(kept))
    assert sorted(e["path"] for e in removed) == sorted(e["path"] for e in would)
    assert not any(Path(e["path"]).exists() for e in removed)
    assert _counts(capsys) == {"index": 1, "statistics": 3}
    assert "cached 3, computed 0" in _stat(capsys, kept)  # what is kept still serves
    # a system rewritten: its old entry matches no data set any more, the new one does
    energy = next((tmp_path / "a").rglob("energy.npy"))
    np.save(energy, np.load(energy) + 1.0)
    assert "cached 2, computed 1" in _stat(capsys, kept)
    assert _counts(capsys) == {"index": 1, "statistics": 4}
    (gone,) = _cache(capsys, "prune", "--unmatched", str(kept))
    assert gone["kind"] == "statistics" and _counts(capsys)["statistics"] == 3


def test_prune_by_the_data_sets_in_use_writes_nothing_to_the_cache(
        tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kept, other = _input(tmp_path, "a", 2), _input(tmp_path, "b", 2)
    _stat(capsys, other)
    assert _counts(capsys) == {"index": 1, "statistics": 2}
    # ``a`` has no index yet: finding what it uses describes it, and saves no index for it
    would = _cache(capsys, "prune", "--unmatched", str(kept), "--dry-run")
    assert sorted(e["kind"] for e in would) == ["index", "statistics", "statistics"]
    assert _counts(capsys) == {"index": 1, "statistics": 2}
    assert _cache(capsys, "prune", "--unmatched", str(kept)) != []
    assert _counts(capsys) == {"index": 0, "statistics": 0}


def test_prune_refuses_an_age_that_is_not_a_finite_number_of_days(
        cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for days in ("nan", "inf", "-1"):
        assert main(["cache", "prune", "--older-than", days]) == 2
        assert "expected a finite number of days of at least 0" in capsys.readouterr().err


def test_prune_by_age_removes_only_old_entries_and_never_a_writers_file(
        tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _input(tmp_path, "a", 3)
    _stat(capsys, path)
    entries = sorted((cache / "statistics").rglob("*.mdlstat"))
    old = time.time() - 10 * 86400
    os.utime(entries[0], (old, old))
    writing = Path(temporary_path(str(entries[0])))  # a live writer's file in the same folder
    writing.write_bytes(b"half")
    os.utime(writing, (old, old))
    (removed,) = _cache(capsys, "prune", "--older-than", "5")
    assert removed["path"] == str(entries[0]) and not entries[0].exists()
    assert writing.exists() and all(e.exists() for e in entries[1:])
    assert _cache(capsys, "prune", "--older-than", "5") == []
    assert "cached 2, computed 1" in _stat(capsys, path)


def test_prune_says_what_to_prune(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "prune"]) == 2
    assert "--older-than DAYS, --unmatched INPUT_JSON" in capsys.readouterr().err
    assert main(["cache", "show", "--older-than", "1"]) == 2
