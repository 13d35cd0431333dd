"""The system index: reused when still true, described again where the data changed, and every
fault of the file (corrupt, truncated, other version or key, unwritable, concurrent writers)
ends in a correct build with one warning line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mdloader.catalog import index, index_file
from mdloader.catalog.freshness import check_saved
from mdloader.data.formats import hdf5, release_handles
from mdloader.data.system import build_system_meta
from mdloader.errors import ConfigError, ShapeError, StaleDataError
from mdloader.fs_calls import Measurement, Overlap
from mdloader.loading import build
from mdloader.testing import make_system

TYPE_MAP = ["O", "H"]
SETTLE = 0.05  # seconds: file times here are finer than this


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(cache))
    monkeypatch.setenv("MDLOADER_INDEX_SETTLE", str(SETTLE))
    monkeypatch.delenv("MDLOADER_INDEX", raising=False)
    return cache


def _settle() -> None:
    """Let the data's file times fall behind the next build's start by the settling margin."""
    time.sleep(2 * SETTLE)


def _tree(root: Path, n: int = 4) -> Path:
    for i in range(n):
        make_system(root / ("a" if i % 2 else "b"), f"sys.{i}", natoms=3 + i, nframes=4 + i,
                    seed=i)
    _settle()
    return root


def _build(root: Path | list[str], spy: list[str] | None = None,
           **kwargs: object) -> build.BuildReport:
    """Build; check every description against the data; ``spy`` collects the build's opens."""
    systems = [str(p) for p in root] if isinstance(root, list) else str(root)
    real_open = os.open
    if spy is not None:
        os.open = lambda p, *a, **k: spy.append(os.fspath(p)) or real_open(p, *a, **k)
    try:
        datasets, report = build.build_systems_with_report(systems, TYPE_MAP, **kwargs)
    finally:
        os.open = real_open
    expected = [build_system_meta(d.system, TYPE_MAP) for d in datasets]
    assert [d.meta for d in datasets] == expected  # never a stale description
    return report


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ----------------------------------------------------------------------------- reuse


def test_the_second_start_reads_no_header(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    opened: list[str] = []
    first = _build(root, spy=opened)
    assert (first.source, first.described, first.reused) == ("built", 4, 0)
    assert os.path.isfile(first.index_file) and first.index_file.startswith(str(tmp_path / "cache"))
    assert len([p for p in opened if p.endswith(".npy")]) == 4 * 5  # each file once
    opened.clear()
    second = _build(root, spy=opened)
    assert (second.source, second.described, second.reused) == ("index", 0, 4)
    assert not [p for p in opened if str(root) in p]  # stat only, no open


def test_trust_checks_nothing_and_off_writes_nothing(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root = _tree(tmp_path / "data")
    off = _build(root, index_mode="off")
    assert off.index_file is None and not (tmp_path / "cache").exists()
    _build(root)
    stats: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(p) or real_stat(p, *a, **k))
    trusted = _build(root, index_mode="trust")
    assert trusted.source == "index (trusted)" and not [s for s in stats if str(root) in str(s)]


def test_refresh_describes_everything_again(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    _build(root)
    again = _build(root, index_mode="refresh")
    assert (again.source, again.described, again.reused) == ("built", 4, 0)
    with pytest.raises(ConfigError, match="index_mode: expected one of check, refresh, trust, "
                                          "off, found 'sometimes'"):
        _build(root, index_mode="sometimes")


def test_an_index_named_explicitly_and_a_changed_type_map(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    named = tmp_path / "mine" / "data.mdlidx"
    assert _build(root, index_file=str(named)).index_file == str(named) and named.is_file()
    assert _build(root, index_file=str(named)).source == "index"
    other = build.build_systems_with_report(str(root), ["H", "O"], index_file=str(named))[1]
    assert other.source == "built"  # another type map: another key (one warning, rebuilt)
    cached = build.build_systems_with_report(str(root), ["H", "O"])[1]
    assert cached.index_file != _build(root).index_file  # the cache keys the type map


# ----------------------------------------------------------------------------- freshness


def _edit(path: Path, text: str) -> None:
    with open(path, "w") as fh:  # in place: the folder does not change
        fh.write(text)


CHANGES = {
    "type.raw in place": lambda s: _edit(s / "type.raw", " ".join(["1"] * 3) + "\n"),
    "type_map.raw in place": lambda s: _edit(s / "type_map.raw", "H\nO\n"),
    "array added to a set": lambda s: np.save(s / "set.000" / "dipole.npy",
                                              np.zeros((4, 3), np.float32)),
    "array removed": lambda s: os.remove(s / "set.000" / "energy.npy"),
    "set added": lambda s: shutil.copytree(s / "set.000", s / "set.001"),
    "nopbc added": lambda s: (s / "nopbc").touch(),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_system_is_described_again_and_only_it(tmp_path: Path, change: str) -> None:
    root = _tree(tmp_path / "data")
    _build(root)
    CHANGES[change](root / "b" / "sys.0")
    report = _build(root)
    assert (report.source, report.described, report.reused) == ("index (updated)", 1, 3)
    assert _build(root).source in ("index", "index (updated)")  # settled: reused next time


def test_a_check_in_threads_flags_what_a_check_in_one_thread_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paths are checked in chunks (in threads where the file system waits): the same
    systems are flagged either way, whichever chunk holds the changed path."""
    root = _tree(tmp_path / "data", n=40)  # 200 paths: the probe, then chunks
    _build(root)
    changed = {"b/sys.0": "type.raw in place", "a/sys.21": "array removed",
               "a/sys.39": "array added to a set"}
    for name, change in changed.items():
        CHANGES[change](root / name)
    saved = index.load(index.index_request(str(root), None, TYPE_MAP, None))
    assert saved is not None
    since = saved.since_ns - int(SETTLE * 1e9)
    serial = check_saved(saved, since, Overlap(1)).systems
    monkeypatch.setattr(Measurement, "threads", lambda self, most: 3)
    threaded = Overlap(8)
    assert (check_saved(saved, since, threaded).systems == serial).all() and threaded.threads == 3
    flagged = {saved.table.address(int(row)) for row in np.flatnonzero(serial)}
    assert flagged == {str(root / name) for name in changed}


def test_added_and_removed_systems_anywhere_below_a_root(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    _build(root)
    make_system(root / "a" / "deeper" / "new", "sys.9", nframes=2)  # a new folder level
    shutil.rmtree(root / "b" / "sys.2")
    report = _build(root)
    assert (report.nsys, report.described, report.reused) == (4, 1, 3)
    make_system(root / "a" / "sys.3", "nested", nframes=2)  # a system inside a system
    assert _build(root).nsys == 5


def test_entries_that_appear_and_patterns_that_match_more(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    later = tmp_path / "later"
    entries = [str(root / "b" / "sys.*"), str(later)]
    with pytest.raises(ConfigError, match=r"systems\[1\]: .*later does not exist"):
        _build(entries)
    make_system(later, "x", nframes=2)
    assert _build(entries).nsys == 3
    make_system(root / "b", "sys.7", nframes=2)
    _settle()
    assert (_build(entries).nsys, _build(entries).source) == (4, "index")


def test_entries_keep_their_order_and_repetitions_through_the_index(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    entries = [root / "b", root, root / "b" / "sys.0"]
    datasets, first = build.build_systems_with_report([str(e) for e in entries], TYPE_MAP)
    names = [os.path.relpath(d.system, root) for d in datasets]
    assert names == ["b/sys.0", "b/sys.2", "a/sys.1", "a/sys.3", "b/sys.0", "b/sys.2",
                     "b/sys.0"] and first.described == 4
    again, second = build.build_systems_with_report([str(e) for e in entries], TYPE_MAP)
    assert second.source == "index" and [d.system for d in again] == [d.system for d in datasets]
    (root / "a" / "sys.1" / "nopbc").touch()
    _, third = build.build_systems_with_report([str(e) for e in entries], TYPE_MAP)
    assert (third.source, third.described, third.nsys) == ("index (updated)", 1, 7)


def test_lmdb_groups_are_described_at_every_start_and_the_rest_reused(tmp_path: Path) -> None:
    """An index file holds npy and HDF5 descriptions; an LMDB group is described again from its
    database's metadata at every start (cheap), so a list mixing both still uses the index."""
    from mdloader.testing import make_lmdb

    root = _tree(tmp_path / "data")
    db = make_lmdb(tmp_path / "db.lmdb", [make_system(tmp_path / "src", "s", nframes=3)])
    _settle()
    entries = [root, Path(db)]
    first = _build(entries)
    assert (first.source, first.nsys) == ("built", 5)
    head, saved = index_file.read_index(first.index_file)
    assert len(saved.table) == 4 and saved.partial and head["systems"] == 5
    second = _build(entries)
    assert (second.source, second.nsys, second.described, second.reused) == ("index", 5, 1, 4)
    (root / "b" / "sys.0" / "nopbc").touch()
    third = _build(entries)
    assert (third.source, third.nsys, third.described, third.reused) == (
        "index (updated)", 5, 2, 3)


def test_a_changed_hdf5_file_is_described_again(tmp_path: Path) -> None:
    make_system(tmp_path, "g0", backend="hdf5", h5_file="d.h5", nframes=3)
    _settle()
    h5 = str(tmp_path / "d.h5")
    _build([h5])
    hdf5._FILES.clear()  # this process holds the file open for reading; another would write
    make_system(tmp_path, "g1", backend="hdf5", h5_file="d.h5", nframes=2)
    report = _build([h5])
    assert (report.nsys, report.described) == (2, 2)


@pytest.mark.parametrize("mode", ["check", "trust"])
def test_an_array_rewritten_in_place_fails_its_first_read(tmp_path: Path, mode: str) -> None:
    """Same folder, same listing: the check cannot see it; the read names file and index."""
    root = _tree(tmp_path / "data")
    _build(root)
    force = root / "b" / "sys.0" / "set.000" / "force.npy"
    np.save(force, np.zeros((4, 3 * 3 + 3), np.float32))  # another width, same name
    datasets, report = build.build_systems_with_report(str(root), TYPE_MAP, index_mode=mode)
    assert report.source.startswith("index") and report.described == 0
    (changed,) = [d for d in datasets if d.system == str(root / "b" / "sys.0")]
    changed.add_data_requirement([{"key": "force", "ndof": 3, "atomic": True}])
    with pytest.raises(StaleDataError, match=(
            rf"the file changed after the system was described \(described by the index "
            rf"{report.index_file}, now removed: the next start describes the systems again; "
            rf"a shared copy is refreshed with `mdloader index refresh input.json`, "
            rf"MDLOADER_INDEX=refresh or index_mode='refresh'\); "
            rf"system: {root / 'b' / 'sys.0'}; file: {force}; "
            r"expected: 4 frames of width 9; found: 4 frames of width 12")):
        changed[0]
    assert not os.path.exists(report.index_file)
    with pytest.raises(ShapeError, match=r"per-frame width of force.npy"):  # described again
        build.build_systems(str(root), TYPE_MAP, index_mode=mode)


def test_the_start_after_a_stale_read_describes_the_system_again(tmp_path: Path) -> None:
    """A trusted index checks nothing at start: a set rewritten in place with more frames stops
    the first start at its read, and the next one describes the systems again and reads them."""
    root = _tree(tmp_path / "data")
    _build(root)
    set_dir = root / "b" / "sys.0" / "set.000"
    for array in sorted(set_dir.glob("*.npy")):
        np.save(array, np.concatenate([np.load(array)] * 2))  # 8 frames
    datasets, report = build.build_systems_with_report(str(root), TYPE_MAP, index_mode="trust")
    assert report.described == 0
    (changed,) = [d for d in datasets if d.system == str(root / "b" / "sys.0")]
    with pytest.raises(StaleDataError, match=rf"described by the index {report.index_file}"):
        changed[0]
    release_handles()
    datasets, report = build.build_systems_with_report(str(root), TYPE_MAP, index_mode="trust")
    assert report.described == report.nsys == 4
    (changed,) = [d for d in datasets if d.system == str(root / "b" / "sys.0")]
    assert len(changed) == 8
    np.testing.assert_allclose(np.sort(changed[7]["coord"].reshape(-1)),  # atoms by type
                               np.sort(np.load(set_dir / "coord.npy")[7]))


@pytest.mark.parametrize("how", ["rewrite", "same-mtime", "cp-p"])
def test_a_set_rewritten_in_place_with_more_frames_is_described_again(
        tmp_path: Path, how: str) -> None:
    """Same folder, same names, even the same modification time: the set is seen at start."""
    root = _tree(tmp_path / "data")
    set_dir = root / "b" / "sys.0" / "set.000"  # 4 frames
    old = None
    if how == "cp-p":  # an older copy of the set with 8 frames
        old = tmp_path / "older"
        make_system(old, "sys.0", natoms=3, nframes=8, seed=9)
        old = old / "sys.0" / "set.000"
    _build(root)
    for array in sorted(set_dir.glob("*.npy")):
        data = np.load(array)
        stat = array.stat()
        if old is not None:
            subprocess.run(["cp", "-p", str(old / array.name), str(array)], check=True)
        else:
            np.save(array, np.concatenate([data, data]))
        if how == "same-mtime":
            os.utime(array, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    report = _build(root)  # checks every description against the data
    assert report.source.startswith("index") and report.described == 1


def test_an_hdf5_dataset_rewritten_later_fails_its_read(tmp_path: Path) -> None:
    import h5py

    make_system(tmp_path, "g0", backend="hdf5", h5_file="d.h5", nframes=3, natoms=4)
    _settle()
    h5 = str(tmp_path / "d.h5")
    _build([h5])
    datasets = build.build_systems([h5], TYPE_MAP, index_mode="trust")
    hdf5._FILES.clear()
    with h5py.File(h5, "a") as fh:
        del fh["g0/set.000/coord.npy"]
        fh["g0/set.000/coord.npy"] = np.zeros((2, 12), np.float32)
    with pytest.raises(StaleDataError, match=r"the dataset changed after the system was "
                                             r"described \(described by the index .*; file: "
                                             rf"{h5}#/g0/set.000/coord.npy; expected: 3 frames "
                                             r"of width 12; found: 3 frames of width 8 "
                                             r"\(shape \(2, 12\)\)"):
        datasets[0][0]


# ----------------------------------------------------------------------------- faults


def _damage(path: str, how: str) -> None:
    data = Path(path).read_bytes()
    if how == "corrupt":
        Path(path).write_bytes(data[:-5] + bytes(b ^ 0xFF for b in data[-5:]))
    elif how == "truncated":
        Path(path).write_bytes(data[: len(data) // 2])
    elif how == "not an index":
        Path(path).write_bytes(b"hello\n")
    elif how == "older format":  # format 2: rows without their storage format
        Path(path).write_bytes(data[:8] + (2).to_bytes(4, "little") + data[12:])
    elif how == "empty":
        Path(path).write_bytes(b"")


FAULTS = {
    "corrupt": r"is corrupt \(its checksum does not match\)",
    "truncated": r"is truncated \(\d+ bytes, expected \d+\)",
    "not an index": "is not an mdloader index",
    "older format": "has format 2; this mdloader reads format 3",
    "empty": "is not an mdloader index",
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_index_costs_one_warning_and_a_rebuild(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str) -> None:
    root = _tree(tmp_path / "data")
    path = _build(root).index_file
    _damage(path, fault)
    with caplog.at_level(logging.INFO, logger="mdloader"):
        report = _build(root)
    assert report.source == "built"
    (line,) = _warnings(caplog)
    assert line.startswith("mdloader: ") and line.endswith("; describing the systems again")
    assert path in line and __import__("re").search(FAULTS[fault], line)
    assert _build(root).source == "index"  # saved again, whole


@pytest.mark.parametrize("kind", ["a FIFO", "a folder"])
def test_a_fifo_or_folder_at_the_index_path_is_refused_without_blocking(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    """Opening a FIFO for reading blocks until a writer comes: the job hung. It is refused from
    its type (one warning, a correct build); a FIFO is then replaced by the saved index."""
    root = _tree(tmp_path / "data")
    path = _build(root).index_file
    os.unlink(path)
    os.mkfifo(path) if kind == "a FIFO" else os.mkdir(path)

    def unblock() -> None:  # hang guard: without the fix, a writer ends the blocked read
        time.sleep(60)
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=unblock, daemon=True).start()
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        report = _build(root)
    assert report.source == "built"
    line = _warnings(caplog)[0]
    assert line == (f"mdloader: the index path {path} is {kind}, not an index file; describing "
                    "the systems again")
    if kind == "a FIFO":
        assert len(_warnings(caplog)) == 1
        assert _build(root).source == "index"


def test_an_index_of_another_mdloader_version(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    root = _tree(tmp_path / "data")
    _build(root)
    monkeypatch.setattr(index, "__version__", "99.0")
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        assert _build(root).source == "built"
    (line,) = _warnings(caplog)
    assert "was made by mdloader 0.1.0, this is 99.0" in line


def test_an_unwritable_cache_folder(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    root = _tree(tmp_path / "data")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(blocker / "cache"))  # works as root too
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        assert _build(root).source == "built"
        assert _build(root).source == "built"
    lines = _warnings(caplog)
    assert len(lines) == 2 and all("could not save the system index" in w for w in lines)


def test_a_writer_killed_half_way_leaves_the_old_index(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    path = _build(root).index_file
    leftover = Path(path).with_name(f".{Path(path).name}.12345.dead.tmp")
    leftover.write_bytes(Path(path).read_bytes()[:100])  # what a killed writer leaves
    assert _build(root).source == "index"
    old = time.time() - 2 * 3600
    os.utime(leftover, (old, old))
    _build(root, index_mode="refresh")  # the next save sweeps dead writers' files
    assert not leftover.exists() and sorted(os.listdir(Path(path).parent)) == [
        Path(path).name]


_WRITER = """
import sys
from mdloader.loading import build
build.build_systems(sys.argv[1], ["O", "H"], index_mode="refresh")
"""


def test_two_jobs_writing_the_same_index_at_once(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data", n=40)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    jobs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root)], env=env)
            for _ in range(4)]
    assert [job.wait(timeout=120) for job in jobs] == [0] * 4
    report = _build(root)
    assert (report.source, report.nsys) == ("index", 40)
    assert [n for n in os.listdir(Path(report.index_file).parent) if n.endswith(".tmp")] == []


def test_the_file_format(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    path = _build(root).index_file
    header = index.inspect(path)
    assert header["systems"] == 4 and header["request"]["type_map"] == TYPE_MAP
    assert header["request"]["systems"] == [str(root)] and header["format"] == 3
    data = Path(path).read_bytes()
    assert data.startswith(b"MDLINDEX") and b"pickle" not in data
    head, saved = index_file.read_index(path)
    assert json.loads(json.dumps(head)) == head and len(saved.table) == 4
    # each row names its format, so the check parses no address
    assert saved.table.backend_names == ("npy",)
    assert saved.table.rows_by_backend()["npy"].tolist() == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- real ranks


@pytest.mark.parametrize("order", ["creation", "reverse"])
def test_nested_audits_stopped_in_either_order_restore_the_originals(tmp_path: Path,
                                                                     order: str) -> None:
    import h5py.h5f
    from support.fs_audit import count_data_touches

    originals = (os.stat, os.lstat, h5py.h5f.open)
    (tmp_path / "d").mkdir()
    (tmp_path / "d2").mkdir()
    (outer, stop_outer), (inner, stop_inner) = (count_data_touches(str(tmp_path / "d")),
                                                count_data_touches(str(tmp_path / "d2")))
    os.stat(tmp_path / "d")
    os.stat(tmp_path / "d2")  # a sibling whose name starts with "d" is not under "d"
    assert outer["stat"] == 1 and inner["stat"] == 1
    stops = [stop_outer, stop_inner] if order == "creation" else [stop_inner, stop_outer]
    stops[0]()
    assert os.stat is not originals[0]  # the other audit still counts
    stops[1]()
    assert (os.stat, os.lstat, h5py.h5f.open) == originals
    assert os.stat is originals[0] and os.lstat is originals[1]
    os.stat(tmp_path / "d")
    assert outer["stat"] == 1 and inner["stat"] == 1


def _index_rank(rank: int, world: int, root: str, cache: str) -> dict[str, object]:
    from support.fs_audit import count_data_touches

    os.environ["MDLOADER_INDEX_SETTLE"] = str(SETTLE)
    os.environ["MDLOADER_CACHE_DIR"] = cache
    counters = {where: count_data_touches(where) for where in (root, cache)}
    try:
        datasets, report = build.build_systems_with_report(root, TYPE_MAP)
    finally:
        for _, stop in counters.values():
            stop()
    return {"source": report.source, "addresses": [d.system for d in datasets],
            "natoms": [d._natoms for d in datasets],
            "touched": {where: counts for where, (counts, _) in counters.items()}}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_only_rank0_reads_the_index_and_the_other_ranks_touch_nothing(tmp_path: Path) -> None:
    from support.distributed_utils import run_ranks, values

    root, cache = str(_tree(tmp_path / "data")), str(tmp_path / "cache")
    first = values(run_ranks(_index_rank, 2, root, cache))
    second = values(run_ranks(_index_rank, 2, root, cache))
    assert [r["source"] for r in first] == ["built", "received"]
    assert [r["source"] for r in second] == ["index", "received"]
    assert first[0]["addresses"] == second[1]["addresses"] and len(first[0]["addresses"]) == 4
    assert all(r["natoms"] == first[0]["natoms"] for r in first + second)
    r0 = second[0]["touched"]
    assert r0[cache]["open"] == 1 and r0[root]["open"] == 0 and r0[root]["stat"] > 0
    for rank in (first[1], second[1]):
        assert all(sum(counts.values()) == 0 for counts in rank["touched"].values())
