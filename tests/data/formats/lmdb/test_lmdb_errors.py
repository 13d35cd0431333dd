"""Every defect of an LMDB database is a typed error naming the database and the entry or frame:
at build time what the metadata shows, at read time what only a frame shows, and ``check
--deep`` finds the latter before a job starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.inputs import write_input

from mdloader.catalog.discover import discover_systems
from mdloader.cli.check import deep_check
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.schema import DataRequirementItem
from mdloader.data.system import build_system_meta
from mdloader.errors import (
    ConfigError,
    CorruptFileError,
    DataError,
    MissingDataError,
    ShapeError,
    TypeMapError,
)
from mdloader.testing import make_lmdb, make_system


@pytest.fixture
def sources(tmp_path: Path) -> list[str]:
    return [make_system(tmp_path / "src", "a", natoms=6, nframes=4, seed=1),
            make_system(tmp_path / "src", "b", natoms=3, nframes=3, seed=2)]


def _db(tmp_path: Path, sources: list[str], broken: str | None = None, **kw: object) -> str:
    return make_lmdb(tmp_path / "d.lmdb", sources, broken=broken, **kw)


# -- build time: the metadata ----------------------------------------------------------------
@pytest.mark.parametrize("broken, error, message", [
    ("no_metadata", MissingDataError, r"the LMDB database has no __metadata__ entry .*; system: "
     r"\S+/d.lmdb; file: \S+/d.lmdb/data.mdb\[__metadata__\]"),
    ("corrupt_metadata", CorruptFileError, r"cannot decode the __metadata__ entry \(not msgpack\)"
     r"; system: \S+/d.lmdb; file: \S+/data.mdb\[__metadata__\]"),
    ("nframes_mismatch", MissingDataError, r"frame 7 is missing although nframes is 8; system: "
     r"\S+/d.lmdb; file: \S+/data.mdb\[000000000007\]"),
    ("nlocs_mismatch", ShapeError, r"frame_nlocs in __metadata__ disagrees with nframes; .*"
     r"expected: 7 entries; found: 6"),
])
def test_metadata_defects_fail_the_build(tmp_path: Path, sources: list[str], broken: str,
                                         error: type, message: str) -> None:
    db = _db(tmp_path, sources, broken)
    with pytest.raises(error, match=message):
        discover_systems(db)


def test_a_missing_frame_hidden_by_a_stray_entry_fails_at_its_read(
        tmp_path: Path, sources: list[str]) -> None:
    """The build checks the entry count and both ends only (reading every key would read the
    whole database); the frame itself is named when read, and by ``check --deep``."""
    db = _db(tmp_path, sources, "missing_frame")
    ds = DeepmdDataSetForLoader(discover_systems(db)[0], ["O", "H"])
    ds.get_batch([0, 1, 2])
    with pytest.raises(MissingDataError, match=r"frame 3 is missing from the database; system: "
                                               r"\S+#system=0,natoms=6; file: \S+/data.mdb"
                                               r"\[000000000003\]"):
        ds[3]
    assert deep_check(ds.meta) == [
        f"frame 3 is missing from the database; system: {db}#system=0,natoms=6; "
        f"file: {db}/data.mdb[000000000003]"]


def test_more_entries_than_frames(tmp_path: Path, sources: list[str]) -> None:
    import lmdb

    db = _db(tmp_path, sources)
    env = lmdb.open(db, map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"000000000099", b"\x80")
    env.close()
    with pytest.raises(ShapeError, match=r"holds more entries than __metadata__ announces; .*"
                                         r"expected: 7 frames \+ __metadata__ = 8 entries; "
                                         r"found: 9 entries"):
        discover_systems(db)


def test_an_element_missing_from_the_model_type_map(tmp_path: Path, sources: list[str]) -> None:
    db = _db(tmp_path, sources)
    with pytest.raises(TypeMapError, match=r"Elements \['H'\] of the database's type_map are not "
                                           r"in the model type_map; system: \S+#system=0,natoms=6"
                                           r"; file: \S+data.mdb\[__metadata__\]; expected: "
                                           r"elements within \['O', 'C'\]; found: \['O', 'H'\]"):
        build_system_meta(f"{db}#system=0,natoms=6", ["O", "C"])


@pytest.mark.parametrize("make, error, message", [
    (lambda p: p.mkdir(), MissingDataError, r"not an LMDB database: the directory holds no "
     r"data.mdb; system: \S+/x.lmdb; file: \S+/x.lmdb/data.mdb"),
    (lambda p: p.write_text("hello"), MissingDataError, r"the LMDB database is not a directory"),
    (lambda p: None, ConfigError, r"^systems: \S+/x.lmdb does not exist$"),
    (lambda p: (p.mkdir(), (p / "data.mdb").write_bytes(b"garbage" * 100)), CorruptFileError,
     r"cannot open the file as an LMDB database; system: \S+/x.lmdb; file: \S+/data.mdb; "
     r"found: "),
])
def test_a_path_that_is_not_an_lmdb_database(tmp_path: Path, make: object, error: type,
                                            message: str) -> None:
    make(tmp_path / "x.lmdb")  # type: ignore[operator]
    with pytest.raises(error, match=message):
        discover_systems(str(tmp_path / "x.lmdb"))


def test_whole_database_and_unknown_group_addresses(tmp_path: Path, sources: list[str]) -> None:
    db = _db(tmp_path, sources)
    with pytest.raises(DataError, match=r"an LMDB database holds many systems: pass it to "
                                        r"discover_systems"):
        DeepmdDataSetForLoader(db, ["O", "H"])
    with pytest.raises(MissingDataError, match=r"the database has no such group of frames; "
                                               r"system: \S+#system=0,natoms=5; .*expected: one "
                                               r"of system=0,natoms=6, system=1,natoms=3"):
        DeepmdDataSetForLoader(f"{db}#system=0,natoms=5", ["O", "H"])
    with pytest.raises(ConfigError, match=r"^systems: \S+/nothing_here does not exist$"):
        discover_systems(str(tmp_path / "nothing_here"))


# -- read time: what only a frame shows ------------------------------------------------------
@pytest.mark.parametrize("broken, error, message", [
    ("corrupt_frame", CorruptFileError, r"cannot decode frame 0 \(not msgpack\); system: "
     r"\S+#system=0,natoms=6; file: \S+/data.mdb\[000000000000\]"),
    ("bad_array", CorruptFileError, r"field 'coords' of frame 0 cannot be decoded; .*found: "
     r"ValueError"),
    ("bad_type_id", TypeMapError, r"frame 0 holds an atom type id outside the type map; .*"
     r"expected: ids < 2 \(or negative for virtual atoms\); found: 5"),
])
def test_frame_defects_name_the_frame_and_check_deep_finds_them(
        tmp_path: Path, sources: list[str], broken: str, error: type, message: str) -> None:
    db = _db(tmp_path, sources, broken)
    (first, second) = discover_systems(db)
    ds = DeepmdDataSetForLoader(first, ["O", "H"])
    with pytest.raises(error, match=message):
        ds.get_batch([0, 1])
    problems = deep_check(ds.meta)
    assert len(problems) == 1 and "frame 0" in problems[0], problems
    assert deep_check(DeepmdDataSetForLoader(second, ["O", "H"]).meta) == []


def test_atom_count_disagreeing_with_frame_nlocs(tmp_path: Path, sources: list[str]) -> None:
    db = _db(tmp_path, sources, "atoms_mismatch")
    ds = DeepmdDataSetForLoader(f"{db}#system=0,natoms=7", ["O", "H"])
    with pytest.raises(ShapeError, match=r"frame 0 holds 6 atoms in atype, but frame_nlocs gives "
                                         r"it 7; .*data.mdb\[000000000000\]; expected: 7"):
        ds[0]


def test_a_required_label_missing_from_a_frame(tmp_path: Path, sources: list[str]) -> None:
    ds = DeepmdDataSetForLoader(discover_systems(_db(tmp_path, sources))[0], ["O", "H"])
    ds.add_data_requirement([DataRequirementItem("fparam", 2, must=True)])
    with pytest.raises(MissingDataError, match=r"required field 'fparam' is unavailable in frame "
                                               r"0; system: \S+#system=0,natoms=6; file: "):
        ds[0]
    ds.add_data_requirement([DataRequirementItem("fparam", 2, must=False, default=3.0,
                                                 source_policy="default")])
    frame = ds[0]
    np.testing.assert_array_equal(frame["fparam"], [3.0, 3.0])
    assert frame["find_fparam"] == 1.0  # DeePMD-kit's "default" policy counts the fill as found


def test_check_deep_passes_a_good_database_and_reports_nan(tmp_path: Path) -> None:
    src = tmp_path / "src"
    energy = np.zeros((3, 1))
    energy[1] = np.nan
    db = make_lmdb(tmp_path / "d.lmdb", [make_system(src, "a", nframes=3),
                                         make_system(src, "b", nframes=3, seed=4,
                                                     extra_keys={"energy": energy})])
    good, bad = (DeepmdDataSetForLoader(a, ["O", "H"]).meta for a in discover_systems(db))
    assert deep_check(good) == []
    assert deep_check(bad) == [f"NaN/inf in field 'energy' of 1 frame(s) of {db}: frames [4]"]


def test_mdloader_check_on_a_database(tmp_path: Path, sources: list[str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from mdloader.cli.main import main

    db = _db(tmp_path, sources, "corrupt_frame")
    config = {"model": {"type_map": ["O", "H"]},
              "training": {"training_data": {"systems": db, "batch_size": "auto"},
                           "numb_steps": 1}}
    path = write_input(tmp_path, config)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{db}#system=0,natoms=6       6        4     6        1    0.500  ?" in out, out
    assert main(["check", str(path), "--deep"]) == 1
    assert "cannot decode frame 0 (not msgpack)" in capsys.readouterr().out


def test_scanning_for_atom_counts_names_a_missing_frame(tmp_path: Path,
                                                        sources: list[str]) -> None:
    db = make_lmdb(tmp_path / "d.lmdb", sources, drop_metadata=["frame_nlocs"],
                   broken="missing_frame")
    with pytest.raises(MissingDataError, match=r"frame 3 is missing although nframes is 7; "
                                               r"system: \S+/d.lmdb; file: \S+/data.mdb"
                                               r"\[000000000003\]"):
        discover_systems(db)


# -- while a job runs: the database replaced or truncated ------------------------------------
def test_a_database_replaced_while_open_is_read_as_opened_then_an_error_naming_it(
        tmp_path: Path, sources: list[str]) -> None:
    """``mdloader pack --overwrite`` of the database being trained on, same layout, new labels:
    the job switched to the new labels at the next pass, silently mixing two data sets. Now a
    process that holds it open reads on the database it opened (no path look-up per batch);
    one that opens it anew (another rank, a new worker) stops naming it."""
    db = _db(tmp_path, sources)
    ds = DeepmdDataSetForLoader(discover_systems(db)[0], ["O", "H"])
    first = ds.get_batch([0, 1])["energy"]
    relabelled = [make_system(tmp_path / "new", "a", natoms=6, nframes=4, seed=9),
                  make_system(tmp_path / "new", "b", natoms=3, nframes=3, seed=8)]
    make_lmdb(db, relabelled)  # written aside, then renamed over the old one
    message = (rf"^the LMDB database was replaced after it was described: its frames are not "
               rf"the ones described \(described when this job started; the data changed while "
               rf"it ran: restart the job\); system: {db}; file: {db}/data.mdb; expected: inode "
               r"\d+, \d+ bytes, mtime \d+ ns; found: inode \d+, \d+ bytes, mtime \d+ ns$")
    from mdloader.data.formats.lmdb import environment
    from mdloader.errors import StaleDataError

    np.testing.assert_array_equal(ds.get_batch([0, 1])["energy"], first)  # the one opened
    environment.forget(db)  # as a process that opens it now
    with pytest.raises(StaleDataError, match=message):
        ds.get_batch([0, 1])
    with pytest.raises(StaleDataError, match=message):
        ds[2]
    fresh = DeepmdDataSetForLoader(discover_systems(db)[0], ["O", "H"])  # described again
    assert fresh.get_batch([0, 1])["energy"].shape == (2, 1)


@pytest.mark.parametrize("change", ["chmod", "cp -p"])
def test_a_status_change_alone_is_one_warning_and_reading_goes_on(
        tmp_path: Path, sources: list[str], change: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A ``chmod``, or a copy of the same size put back with ``cp -p``/``rsync -a`` (same
    inode, size and modification time), changes only the status change time: one warning
    naming ``data.mdb``, once, and the frames are still served."""
    import logging
    import os
    import shutil
    import time

    db = _db(tmp_path, sources)
    data = os.path.join(db, "data.mdb")
    ds = DeepmdDataSetForLoader(discover_systems(db)[0], ["O", "H"])
    before = ds.get_batch([0, 1])["energy"]
    time.sleep(0.01)
    if change == "chmod":
        os.chmod(data, 0o640)
    else:
        backup = tmp_path / "backup.mdb"
        shutil.copy2(data, backup)
        shutil.copy2(backup, data)  # in place: same inode, size, mtime
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        first = ds.get_batch([0, 1])["energy"]
        again = ds.get_batch([1, 0])["energy"]
    warned = [r for r in caplog.records if "its status changed while it is read" in r.message]
    assert len(warned) == 1 and data in warned[0].message
    assert (first == before).all() and again.shape == (2, 1)


_TRUNCATE = """
import os, sys
from mdloader.catalog.discover import discover_systems
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.errors import MdloaderError
db = sys.argv[1]
ds = DeepmdDataSetForLoader(discover_systems(db)[0], ["O", "H"])
ds.get_batch([0, 1])
data = os.path.join(db, "data.mdb")
os.truncate(data, 4096)
try:
    ds.get_batch([2, 3])
except MdloaderError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_database_truncated_while_open_is_an_error_not_sigbus(tmp_path: Path) -> None:
    """Mapped pages beyond the new end raise SIGBUS: every rank died with -7 and no line."""
    import subprocess
    import sys

    big = [make_system(tmp_path / "src", "a", natoms=64, nframes=400, seed=1)]
    db = make_lmdb(tmp_path / "d.lmdb", big)
    run = subprocess.run([sys.executable, "-c", _TRUNCATE, db], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.startswith("StaleDataError the LMDB database was truncated after it was "
                                 "described: ")
    assert f"system: {db}; file: {db}/data.mdb; expected: inode" in run.stdout
