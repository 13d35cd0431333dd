"""What check and index print, as a user reads it: large tables, LMDB systems, index reports."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mdloader.cli.check import CheckReport, SectionReport, SystemRow, format_check_report
from mdloader.cli.main import main
from mdloader.testing import make_lmdb, make_system


def test_a_large_check_table_is_short_and_its_probabilities_are_readable() -> None:
    rows = [SystemRow(f"/d/sys{i}", 4, 5, True, 1, 5, 1 / 5000) for i in range(5000)]
    report = CheckReport([SectionReport("training_data", rows)], [])
    text = format_check_report(report)
    table = [line for line in text.splitlines() if line.startswith("/d/sys")]
    assert len(table) == 20 and table[0].split()[-2] == "2.0e-04"
    assert "... 4980 more system(s): --all lists every one" in text
    assert "0.000" not in text and text.splitlines()[-4].split()[-1] == "1.000"
    assert len(format_check_report(report, rows=None).splitlines()) > 5000


def _lmdb_input(tmp_path: Path) -> Path:
    systems = [make_system(tmp_path / "src", f"s{i}", natoms=3 + i, nframes=4,
                           keys=("energy", "force")) for i in range(3)]
    make_lmdb(tmp_path / "d.lmdb", systems, type_map=["O", "H"])
    path = tmp_path / "lmdb.json"
    path.write_text(json.dumps({"model": {"type_map": ["O", "H"]}, "training": {
        "training_data": {"systems": str(tmp_path / "d.lmdb")}, "numb_steps": 1}}))
    return path


@pytest.mark.timeout(300)
def test_check_explains_the_pbc_of_lmdb_groups(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(_lmdb_input(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert out.count("  ?\n") == 3
    assert "(pbc ?: an LMDB database stores periodicity with each frame" in out


@pytest.mark.timeout(300)
def test_the_index_report_of_an_lmdb_input_agrees_with_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """LMDB groups are read from the database at every start and kept in no index: build says
    so every time, and inspect right after does not call the index changed."""
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MDLOADER_INDEX_SETTLE", "0")
    path = str(_lmdb_input(tmp_path))
    for state in ("built", "unchanged"):
        assert main(["index", "build", path, "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert (row["state"], row["systems"], row["described"], row["reused"],
                row["unindexed"]) == (state, 3, 0, 0, 3)
        time.sleep(0.05)
    assert main(["index", "inspect", path, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["state"], row["systems"], row["frames"], row["unindexed"], row["changed"]) == (
        "unchanged", 3, 12, 3, 0)
    assert main(["index", "inspect", path]) == 0
    assert "not kept in the index (LMDB groups" in capsys.readouterr().out


def test_bench_rates_leave_the_start_up_of_workers_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first batch that waits (worker start-up) counts in first_s, not in the rates."""
    from mdloader.cli import bench

    class Atype:
        shape = (2, 3)

    class SlowStart:
        def __iter__(self):
            for i in range(5):
                time.sleep(0.5 if i == 0 else 0.01)
                yield {"fid": [0, 1], "atype": Atype()}

    pulled = bench._pull(SlowStart(), 5)  # type: ignore[arg-type]
    assert pulled.first >= 0.5 and pulled.batches == 4 and pulled.frames == 8
    assert pulled.atoms == 24 and pulled.rate(pulled.batches) > 4 / 0.5
