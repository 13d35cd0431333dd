"""The persistence leaf on real files: atomic writes, leftovers of dead writers, the file stamp."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mdloader import persist
from mdloader.errors import WriteError


def _dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _temporary_of(target: Path, pid: int, host: str | None = None) -> Path:
    owner = f"{pid}@{host or socket.gethostname()}"
    return target.with_name(f".{target.name}.{owner}.0123abcd.tmp")


def test_an_atomic_write_replaces_the_file_and_leaves_nothing_else(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "entry.bin"
    persist.write_atomic(str(target), b"first")
    persist.write_atomic(str(target), lambda fh: fh.write(b"second"))
    assert target.read_bytes() == b"second"
    assert os.listdir(target.parent) == ["entry.bin"]


def test_a_durable_write_flushes_the_file_and_its_folder_and_a_cache_write_neither(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[bool] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    persist.write_atomic(str(tmp_path / "checkpoint.bin"), b"kept")
    assert synced == [False, True]  # the file, then the folder that holds its new name
    synced.clear()
    persist.write_atomic(str(tmp_path / "entry.bin"), b"cached", durable=False)
    assert synced == [] and (tmp_path / "entry.bin").read_bytes() == b"cached"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.bin", "entry.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "entry.bin"
    persist.write_atomic(str(target), b"old")

    def full_disk(fh: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WriteError, match=f"cannot write {target}: No space left on device"):
        persist.write_atomic(str(target), full_disk)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["entry.bin"]


def test_a_write_into_a_file_in_the_way_is_a_write_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(WriteError, match="a-file/entry"):
        persist.write_atomic(str(tmp_path / "a-file" / "entry"), b"x")


def test_leftovers_of_a_dead_writer_go_and_a_live_writers_stay(tmp_path: Path) -> None:
    target = tmp_path / "index.mdlidx"
    dead = _temporary_of(target, _dead_pid())
    live = _temporary_of(target, os.getpid())
    elsewhere_new = _temporary_of(target, 1, host="another-host")
    elsewhere_old = target.with_name(f".{target.name}.2@another-host.feedbeef.tmp")
    other_target = _temporary_of(tmp_path / "index.mdlidx.old", _dead_pid())
    for path in (dead, live, elsewhere_new, elsewhere_old, other_target):
        path.write_bytes(b"partial")
    old = time.time() - 2 * persist.LEFTOVER_AGE
    os.utime(elsewhere_old, (old, old))
    os.utime(other_target, (old, old))
    persist.write_atomic(str(target), b"done")  # every write sweeps first
    assert sorted(os.listdir(tmp_path)) == sorted(
        [target.name, live.name, elsewhere_new.name, other_target.name])


def test_a_dead_writers_partial_folder_goes(tmp_path: Path) -> None:
    target = tmp_path / "out.lmdb"
    partial = _temporary_of(target, _dead_pid())
    legacy = tmp_path / ".out.lmdb.partial-999999999-0"  # an older mdloader's name
    partial.mkdir()
    legacy.mkdir()
    (partial / "data.mdb").write_bytes(b"")
    assert sorted(persist.remove_leftovers(str(target))) == sorted([partial.name, legacy.name])
    assert os.listdir(tmp_path) == []


def test_a_folder_is_published_whole(tmp_path: Path) -> None:
    target = tmp_path / "db"
    for content in (b"one", b"two"):
        finished = Path(persist.temporary_path(str(target)))
        finished.mkdir()
        (finished / "data.mdb").write_bytes(content)
        persist.publish_folder(str(finished), str(target))
        assert (target / "data.mdb").read_bytes() == content
        assert os.listdir(tmp_path) == ["db"]


def test_a_link_is_pointed_atomically(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).write_text(name)
        persist.point_link(str(tmp_path / "latest"), name)
        assert (tmp_path / "latest").read_text() == name
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "latest"]


def test_the_stamp_catches_an_older_copy_put_back(tmp_path: Path) -> None:
    data = tmp_path / "energy.npy"
    data.write_bytes(b"new content")
    before = persist.file_stamp(str(data))
    assert before is not None
    older = tmp_path / "backup" / "energy.npy"
    older.parent.mkdir()
    older.write_bytes(b"old content")  # same size, and the same modification time:
    os.utime(older, ns=(before.mtime_ns, before.mtime_ns))
    time.sleep(0.01)
    shutil.copy2(older, data)  # cp -p: the file keeps its inode, size and mtime
    after = persist.file_stamp(str(data))
    assert after is not None and (after.ino, after.size, after.mtime_ns) == (
        before.ino, before.size, before.mtime_ns)
    assert after != before and after.ctime_ns > before.ctime_ns
    assert after.changed_since(before.ctime_ns + 1)
    assert persist.file_stamp(str(tmp_path / "gone")) is None


def test_an_entry_is_removed_whole_and_marked_used(tmp_path: Path) -> None:
    entry = tmp_path / "entry.mdlstat"
    persist.write_atomic(str(entry), b"x")
    old = time.time() - 10 * 86400
    os.utime(entry, (old, old))
    with open(entry, "rb") as reader:  # a reader that has it open keeps reading it
        persist.mark_used(str(entry), reader)
        facts = persist.usage(str(entry))
        assert facts is not None and facts[0] > old + 86400 and facts[1] == 1
        recent = time.time() - 3600
        os.utime(entry, (recent, recent))
        persist.mark_used(str(entry), reader)  # used within the day: no metadata write
        assert persist.usage(str(entry)) == (recent, 1)
        assert persist.remove_entry(str(entry)) and reader.read() == b"x"
    assert os.listdir(tmp_path) == [] and not persist.remove_entry(str(entry))
