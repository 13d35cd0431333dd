"""build_systems: one process, then 2 and 4 real gloo ranks, success and every rank-0 failure."""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.distributed_utils import RankError, errors, run_ranks, values
from support.fs_audit import count_data_touches
from support.terminal import drawn_bar, stderr

from mdloader import fs_calls as overlap
from mdloader import logs
from mdloader.catalog import describe
from mdloader.catalog.discover import discover_systems
from mdloader.data.system import build_system_meta
from mdloader.errors import (
    CollectiveTimeoutError,
    ConfigError,
    MissingDataError,
    RemoteError,
)
from mdloader.loading import build
from mdloader.testing import make_system

# ----------------------------------------------------------------------------- helpers



def _good_systems(root: Path) -> tuple[list[str], list[str]]:
    """(systems argument, addresses): three npy systems and an HDF5 file with two."""
    out = [make_system(root / "npy", f"sys.{i}", natoms=3 + i, nframes=4 + i, seed=i)
           for i in range(3)]
    out += [make_system(root, f"grp{i}", natoms=5, nframes=3, nsets=2, backend="hdf5",
                        h5_file="data.h5", seed=10 + i) for i in range(2)]
    return [str(root / "npy"), str(root / "data.h5")], out


# ----------------------------------------------------------------------------- one process


def test_single_process_builds_without_broadcast(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    systems, addresses = _good_systems(tmp_path)
    with caplog.at_level(logging.INFO, logger="mdloader.loading.build"):
        datasets, report = build.build_systems_with_report(systems, ["O", "H"],
                                                           num_workers=2)
    assert [d.meta for d in datasets] == [build_system_meta(a, ["O", "H"])  # entry by entry
                                          for a in addresses]
    assert (report.nsys, report.nframes, report.payload_bytes, report.world_size) == (
        5, 4 + 5 + 6 + 3 + 3, 0, 1)
    assert "built 5 systems (21 frames), up to 2 threads: discovery" in caplog.text
    assert [len(d[0]["atype"]) for d in datasets] == [3, 4, 5, 5, 5]  # the npy root, as given


def test_single_process_raises_the_original_error(tmp_path: Path) -> None:
    make_system(tmp_path, "a")
    bad = make_system(tmp_path, "b", broken="no_coord")
    with pytest.raises(MissingDataError, match=f"the set has no coord.npy; system: {bad}; "
                                               f"file: {bad}/set.000/coord.npy"):
        build.build_systems(str(tmp_path))


def test_single_process_names_the_system_of_a_foreign_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_system(tmp_path, "a")
    bad = make_system(tmp_path, "b")
    monkeypatch.setattr(describe, "build_system_meta", _raising_build(bad))
    with pytest.raises(RuntimeError, match="disk on fire") as info:
        build.build_systems(str(tmp_path))
    assert info.value.__notes__ == [f"while building the system {bad}"]


def test_the_first_start_shows_describing_on_a_terminal(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    make_system(tmp_path, "a")
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 0.0)
    err = stderr(monkeypatch, tty=True)
    build.build_systems(str(tmp_path), index_mode="off")
    assert drawn_bar(err.getvalue()) and "mdloader: describing systems: 100%" in err.getvalue()
    err.seek(0)
    err.truncate()
    build.build_systems(str(tmp_path), index_mode="off", progress=False)
    assert err.getvalue() == ""


def test_resolve_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MDLOADER_BUILD_WORKERS", raising=False)
    assert build.resolve_workers() == 32
    monkeypatch.setenv("MDLOADER_BUILD_WORKERS", "3")
    assert (build.resolve_workers(), build.resolve_workers(5)) == (3, 5)
    monkeypatch.setenv("MDLOADER_BUILD_WORKERS", "many")
    with pytest.raises(ConfigError, match="MDLOADER_BUILD_WORKERS: expected a whole number of "
                                          "threads, found 'many'"):
        build.resolve_workers()
    with pytest.raises(ConfigError, match="num_workers: expected at least 1 thread, found 0"):
        build.resolve_workers(0)


def _recording_build(seen: list[tuple[str, str]], bad: set[str],
                     delay: float = 0.0) -> Callable[..., Any]:
    def fake(address: str, type_map: Any = None, listing: Any = None) -> str:
        seen.append((address, threading.current_thread().name))
        if delay:
            overlap.timed(time.sleep, delay)  # a file-system call waiting on a disk
        else:
            start = time.thread_time()
            while time.thread_time() - start < 0.001:  # 1 ms of work, as on a local disk
                pass
        if address in bad:
            raise RuntimeError(f"cannot read {address}")
        return address
    return fake


@pytest.mark.parametrize("delay, pooled", [(0.0, False), (0.002, True)])
def test_threads_only_when_the_first_systems_wait_on_the_disk(monkeypatch: pytest.MonkeyPatch,
                                                              delay: float, pooled: bool) -> None:
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(describe, "build_system_meta", _recording_build(seen, set(), delay))
    monkeypatch.setattr(describe, "PROBE", 8)
    addresses = [f"s{i:03d}" for i in range(40)]
    assert list(describe.describe_systems(addresses, None, 4)) == addresses
    threads = {name for _, name in seen[8:]}
    assert all(name.startswith("mdloader-build") for name in threads) == pooled
    assert {name for _, name in seen[:8]} == {threading.current_thread().name}


def test_pool_stops_at_the_first_failing_system_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str]] = []
    addresses = [f"s{i:03d}" for i in range(200)]
    fake = _recording_build(seen, {"s017", "s030"}, delay=0.001)
    monkeypatch.setattr(describe, "build_system_meta", fake)
    monkeypatch.setattr(describe, "PROBE", 2)
    monkeypatch.setattr(overlap, "IO_SHARE", 0.0)  # always the pool
    monkeypatch.setattr(overlap, "WAIT", 0.0)
    monkeypatch.setattr(describe, "CHUNK", 3)
    got: list[str] = []
    with pytest.raises(describe.SystemFailed) as info:
        got.extend(describe.describe_systems(addresses, None, 4))
    assert info.value.address == "s017" and got == addresses[:17]
    assert str(info.value.__cause__) == "cannot read s017"
    assert len(seen) < 60 and "s199" not in {a for a, _ in seen}
    assert any(name.startswith("mdloader-build") for _, name in seen)


# ----------------------------------------------------------------------------- real ranks


def _raising_build(bad: str, exc: BaseException | None = None) -> Callable[..., Any]:
    def fake(address: str, type_map: Any = None, listing: Any = None) -> Any:
        if address == bad:
            raise exc or RuntimeError("disk on fire")
        return build_system_meta(address, type_map, listing=listing)
    return fake


def _unpicklable_build(bad: str) -> Callable[..., Any]:
    def fake(address: str, type_map: Any = None, listing: Any = None) -> Any:
        meta = build_system_meta(address, type_map, listing=listing)
        if address == bad:  # a field holding something pickle refuses
            meta = dataclasses.replace(meta, mixed_idx_map=threading.Lock())
        return meta
    return fake


def _none_build(bad: str) -> Callable[..., Any]:
    return lambda address, type_map=None, listing=None: (
        None if address == bad else build_system_meta(address, type_map, listing=listing))


def _build_rank(rank: int, world: int, root: str, systems: Any, patch: tuple | None,
                timeout: float | None = None) -> dict[str, Any]:
    if patch is not None and rank == patch[0]:
        factory, arg = patch[1], patch[2]
        if factory == "slow":
            real = describe.build_system_meta
            describe.build_system_meta = lambda a, t=None, listing=None: (
                time.sleep(arg), real(a, t, listing=listing))[1]
        else:
            describe.build_system_meta = factory(arg)
    counts, stop = count_data_touches(root)
    try:
        datasets, report = build.build_systems_with_report(systems, ["O", "H"], num_workers=2,
                                                           timeout=timeout)
    finally:
        stop()
    frame = datasets[-1][0]  # reading after the build is allowed on every rank
    return {"metas": pickle.dumps([d.meta for d in datasets]), "touches": counts,
            "nsys": report.nsys, "bytes": report.payload_bytes, "natoms": len(frame["atype"])}


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_identical_entries_and_only_rank0_reads(tmp_path: Path, world: int) -> None:
    systems, _ = _good_systems(tmp_path)
    got = values(run_ranks(_build_rank, world, str(tmp_path), systems, None))
    assert all(g["metas"] == got[0]["metas"] for g in got)
    assert [len(pickle.loads(g["metas"])) for g in got] == [5] * world
    assert got[0]["bytes"] > 0 and len({g["bytes"] for g in got}) == 1
    assert got[0]["touches"]["open"] > 0 and got[0]["touches"]["h5open"] > 0
    for g in got[1:]:
        assert g["touches"] == {"open": 0, "list": 0, "stat": 0, "h5open": 0}


def _make_failure(root: Path, case: str) -> tuple[Any, tuple | None, str, str]:
    """(systems argument, patch, system named, file named) for one rank-0 failure."""
    for name in ("a", "c"):
        make_system(root, name)
    bad = str(root / "b")
    broken = {"no_sets": "no_sets", "no_coord": "no_coord", "corrupt_npy": "corrupt_header",
              "frames": "frame_mismatch", "type_map": "type_outside_map"}
    files = {"no_sets": "set.*", "no_coord": "set.000/coord.npy",
             "corrupt_npy": "set.000/coord.npy", "frames": "set.000/energy.npy",
             "type_map": "type.raw"}
    if case in broken:
        make_system(root, "b", broken=broken[case])
        return str(root), None, bad, f"{bad}/{files[case]}"
    make_system(root, "b")
    if case == "worker_oserror":
        exc = PermissionError(13, "Permission denied", f"{bad}/type.raw")
        return (str(root), (0, functools.partial(_raising_build, exc=exc), bad), bad,
                f"{bad}/type.raw")
    if case == "unpicklable":
        return str(root), (0, _unpicklable_build, bad), bad, ""
    fake = root / "fake.h5"
    fake.write_bytes(b"this is not an HDF5 file\n" * 10)
    return [str(root / "a"), str(fake)], None, f"{fake}#/", str(fake)


BUILDING = r"\(discovering and building the systems\): "
FAILURES = {  # what follows "rank 0 failed " in every rank's error
    "no_sets": BUILDING + "MissingDataError: no set.* is found in the system",
    "no_coord": BUILDING + "MissingDataError: the set has no coord.npy",
    "corrupt_npy": BUILDING + "CorruptFileError: cannot read the npy header",
    "frames": BUILDING + "ShapeError: frame counts disagree within set.000",
    "type_map": BUILDING + "TypeMapError: type.raw holds a type id outside type_map.raw",
    "worker_oserror": BUILDING + "PermissionError: .*Permission denied",
    "unpicklable": r"\(serializing the system descriptions\): TypeError: cannot pickle",
    "not_hdf5": BUILDING + "CorruptFileError: cannot open the file as HDF5",
}


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case, world", [(case, 2) for case in FAILURES] + [
    (case, 4) for case in ("no_coord", "unpicklable", "not_hdf5")])  # a sample at 4: keep it fast
def test_rank0_failure_fails_every_rank_together(tmp_path: Path, case: str, world: int) -> None:
    systems, patch, system, file = _make_failure(tmp_path, case)
    errs = errors(run_ranks(_build_rank, world, str(tmp_path), systems, patch))
    for err in errs:
        assert err.exc_type == "RemoteError", str(err)
        remote = err.exception
        assert (remote.origin_rank, remote.system) == (0, system)
        assert remote.file == (file or None)
        with pytest.raises(RemoteError, match="rank 0 failed " + FAILURES[case]):
            raise remote
        assert system in str(remote) and file in str(remote)
    times = [e.finished_at for e in errs]
    assert max(times) - min(times) < 3.0


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_none_entry_fails_every_rank_with_rank0s_error(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        make_system(tmp_path, name)
    patch = (0, _none_build, str(tmp_path / "b"))
    errs = errors(run_ranks(_build_rank, 2, str(tmp_path), str(tmp_path), patch))
    for err in errs:
        with pytest.raises(RemoteError, match=r"rank 0 failed \(discovering and building the "
                                              r"systems\): TypeError: entry 1 of the system "
                                              r"descriptions is not a SystemMeta \(found "
                                              r"NoneType\)"):
            raise err.exception


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_slow_rank0_times_out_with_a_clear_message(tmp_path: Path) -> None:
    make_system(tmp_path, "a")
    outcomes = run_ranks(_build_rank, 2, str(tmp_path), str(tmp_path), (0, "slow", 4.0), 1.5)
    err = outcomes[1]
    assert isinstance(err, RankError)
    with pytest.raises(CollectiveTimeoutError,
                       match=r"rank 1 waited 1\.\d s for the packet header from rank 0 "
                             r"\(timeout 1.5 s\): rank 0 may still be discovering and building "
                             r"the systems"):
        raise err.exception


@pytest.mark.timeout(120)
def test_large_cpu_bound_builds_use_processes_in_order(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PROCESS_MIN systems the build runs in spawned processes: same order, same entries,
    and the first broken system (in order) is the one named."""
    for i in range(60):
        make_system(tmp_path, f"sys.{i:02d}", natoms=3 + i % 4, nframes=2, seed=i)
    monkeypatch.setattr(describe, "PROCESS_MIN", 10)
    serial = [build_system_meta(a) for a in discover_systems(str(tmp_path))]
    datasets = build.build_systems(str(tmp_path), num_workers=2)
    assert [d.meta for d in datasets] == serial
    make_system(tmp_path, "sys.45b", broken="no_coord")
    make_system(tmp_path, "sys.50b", broken="no_sets")
    with pytest.raises(MissingDataError, match=r"the set has no coord\.npy") as info:
        build.build_systems(str(tmp_path), num_workers=2)
    assert info.value.system.endswith("sys.45b")
