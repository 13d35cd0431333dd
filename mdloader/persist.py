"""Writing files that readers may see at any moment, and telling whether a file changed.

Every writer of mdloader (checkpoints, system indexes, statistics entries, LMDB databases) goes
through this module, so that all of them give the same guarantees:

* :func:`write_atomic` writes a unique temporary file beside the target (``O_EXCL``), flushes
  it to disk, renames it over the target and flushes the folder: a reader sees the old file or
  the new one, never a part of either, and the rename survives a crash;
* :func:`publish_folder` does the same for a finished folder (an LMDB database);
* :func:`remove_leftovers` is the one policy for what killed writers leave: a temporary name
  is ``.<target>.<pid>@<host>.<token>.tmp``; it is removed when its writer is a dead process
  of this host, and otherwise (another host's writer, a pid reused) once nothing in it changed
  for :data:`LEFTOVER_AGE` seconds;
* :class:`FileStamp` is what "this file changed" means: inode, size, modification and status
  change times. Nobody can set a status change time, so a file rewritten in place, or replaced
  by an older copy (``cp -p``, ``rsync -a``, ``tar``), changes the stamp.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from typing import IO, NamedTuple

from mdloader.errors import WriteError

LEFTOVER_AGE = 3600.0
"""Seconds without a change after which a temporary of an unknown writer is taken for dead."""

TEMP_SUFFIX = ".tmp"


class FileStamp(NamedTuple):
    """What identifies a file's content without reading it (one ``stat``)."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        """The stamp of a ``stat`` result already at hand."""
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def changed_since(self, since_ns: int) -> bool:
        """Whether the file was modified, or its status changed, at or after ``since_ns``."""
        return self.mtime_ns >= since_ns or self.ctime_ns >= since_ns

    def describe(self) -> str:
        """The stamp in words, for error messages (the status change time is left out: where it
        alone differs, :meth:`only_ctime_differs` says so in words)."""
        return f"inode {self.ino}, {self.size} bytes, mtime {self.mtime_ns} ns"

    def only_ctime_differs(self, other: FileStamp) -> bool:
        """Whether ``other`` is this stamp but for its status change time."""
        return self[:3] == other[:3] and self.ctime_ns != other.ctime_ns


def file_stamp(path: str) -> FileStamp | None:
    """The stamp of ``path`` now (``None`` when it cannot be read: gone, no permission)."""
    try:
        return FileStamp.of(os.stat(path))
    except OSError:
        return None


def changed_paths(paths: Sequence[str], since_ns: int) -> list[bool]:
    """For each path, whether it is gone (or unreadable) or its stamp changed at or after
    ``since_ns``: :meth:`FileStamp.changed_since` from one ``stat``, in one loop that builds no
    stamp (a freshness check asks this of every path of a large index, and a Python call per
    path would cost as much as the ``stat`` itself)."""
    out: list[bool] = []
    append, stat = out.append, os.stat
    for path in paths:
        try:
            st = stat(path)
        except OSError:
            append(True)
            continue
        append(st.st_mtime_ns >= since_ns or st.st_ctime_ns >= since_ns)  # changed_since's rule
    return out


# -- temporaries ------------------------------------------------------------------------------

def temporary_path(target: str) -> str:
    """A fresh temporary name beside ``target`` that names its writer (pid and host)."""
    folder, name = os.path.split(os.path.abspath(target))
    return os.path.join(folder, f".{name}.{os.getpid()}@{_host()}.{secrets.token_hex(4)}"
                                f"{TEMP_SUFFIX}")


def is_temporary(name: str) -> bool:
    """Whether a file name is a writer's temporary (or a leftover of an older mdloader's)."""
    return name.startswith(".") and (name.endswith(TEMP_SUFFIX) or _LEGACY.search(name)
                                     is not None)


_LEGACY = re.compile(r"\.(?:partial|replaced)-\d+-\d+$")  # the LMDB writer's older names
_OWNER = re.compile(r"(?:partial-|replaced-)?(\d+)(?:@(.+?))?[.-][0-9A-Za-z]+(?:\.tmp)?$")


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def _writer_gone(rest: str, path: str, now: float) -> bool:
    """Whether the writer of the leftover ``path`` (``rest``: its name after the target's) is
    gone: a dead process of this host, or nothing changed for :data:`LEFTOVER_AGE`."""
    match = _OWNER.match(rest)
    if match is None:  # another target's temporary (``a`` and ``a.b``): not this one's
        return False
    local = match.group(2) in (None, _host())  # no host: an older mdloader's local name
    if local and not _alive(int(match.group(1))):
        return True
    # another host's writer, or a pid that may have been reused: a live writer keeps
    # changing what it writes
    return now - _newest_change(path) > LEFTOVER_AGE


def _newest_change(path: str) -> float:
    """The last modification of ``path`` or, for a folder, of anything directly in it."""
    try:
        newest = os.stat(path).st_mtime
        if os.path.isdir(path):
            with os.scandir(path) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        newest = max(newest, entry.stat().st_mtime)
    except OSError:
        return time.time()  # vanished meanwhile: someone else handles it
    return newest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_leftovers(target: str, names: Sequence[str] | None = None) -> list[str]:
    """Remove the temporaries of ``target`` whose writers are gone; returns their names.

    A live writer's temporary is never touched, so two jobs may write one target at once.
    ``names``: the entries of ``target``'s folder, when the caller listed it already (a
    writer of many targets in one folder lists it once).
    """
    folder, name = os.path.split(os.path.abspath(target))
    prefix, now, removed = f".{name}.", time.time(), []
    if names is None:
        try:
            names = os.listdir(folder)
        except OSError:
            return removed
    for entry in names:
        if not (entry.startswith(prefix) and is_temporary(entry)):
            continue
        path = os.path.join(folder, entry)
        if _writer_gone(entry[len(prefix):], path, now):
            discard(path)
            removed.append(entry)
    return removed


def discard(path: str) -> None:
    """Remove a file or a whole folder, quietly (it may be gone already)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


# -- writing ----------------------------------------------------------------------------------

def fsync_folder(folder: str) -> None:
    """Make the entries of ``folder`` (a rename into it) durable; a file system that cannot
    sync a folder is left alone."""
    with contextlib.suppress(OSError):
        fd = os.open(folder or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str, data: bytes | memoryview | Callable[[IO[bytes]], None], *,
                 mode: int = 0o666, durable: bool = True) -> None:
    """Write ``data`` (bytes, or a function writing into the open file) to ``path`` atomically.

    Leftovers of dead writers of ``path`` are removed first. On a failure (a full disk, no
    permission) nothing is left behind and a :class:`~mdloader.errors.WriteError` names
    ``path``; the old file, if any, is untouched. ``durable=False`` (a cache entry, which a
    reader computes again when it cannot decode it) skips the two flushes to disk: still
    atomic for readers, but a crash may lose the entry, and no metadata server waits for it.
    """
    folder = os.path.dirname(os.path.abspath(path))
    temp = temporary_path(path)
    try:
        os.makedirs(folder, exist_ok=True)
        remove_leftovers(path)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)  # the umask applies
        try:
            with os.fdopen(fd, "wb") as fh:
                if callable(data):
                    data(fh)
                else:
                    fh.write(data)
                fh.flush()
                if durable:
                    os.fsync(fh.fileno())
            os.replace(temp, path)
        except BaseException:
            discard(temp)
            raise
    except OSError as exc:
        raise WriteError(f"cannot write {path}: {exc.strerror or exc}") from exc
    if durable:
        fsync_folder(folder)


def point_link(link: str, target: str) -> None:
    """Make the symbolic link ``link`` point at ``target`` atomically (a reader sees the old
    link or the new one); a :class:`~mdloader.errors.WriteError` names ``link``."""
    temp = temporary_path(link)
    try:
        remove_leftovers(link)
        os.symlink(target, temp)
        try:
            os.replace(temp, link)
        except BaseException:
            discard(temp)
            raise
    except OSError as exc:
        raise WriteError(f"cannot point {link} at {target}: {exc.strerror or exc}") from exc
    fsync_folder(os.path.dirname(os.path.abspath(link)))


def fsync_tree(folder: str) -> None:
    """Flush every file directly in ``folder``, then the folder itself."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_folder(folder)


def publish_folder(finished: str, target: str, *, durable: bool = True) -> None:
    """Rename the complete folder ``finished`` (made at :func:`temporary_path` of ``target``)
    to ``target``, flushed to disk first; an old ``target`` is moved aside and removed only
    once the new one is in place. ``durable=False`` (a node-local copy, made again when lost)
    skips the flushes: still atomic for readers."""
    if durable:
        fsync_tree(finished)
    old = None
    if os.path.lexists(target):
        old = temporary_path(target)
        os.replace(target, old)
    try:
        os.replace(finished, target)
    except BaseException:
        if old is not None:  # the old one back in place: nothing changed
            os.replace(old, target)
        raise
    if durable:
        fsync_folder(os.path.dirname(os.path.abspath(target)))
    if old is not None:
        discard(old)


def remove_entry(path: str) -> bool:
    """Remove one finished file so that no reader sees a part of it: renamed to a temporary
    name first (an open reader keeps reading the whole file), then deleted. ``False`` when
    it was gone already."""
    temp = temporary_path(path)
    try:
        os.rename(path, temp)
    except FileNotFoundError:
        return False
    discard(temp)
    return True


USE_RESOLUTION = 86400.0
"""Seconds: an entry's last use is recorded at most once in this time, so that reading it at
every start costs no metadata write on a shared file system (its age is what pruning asks)."""


def mark_used(path: str, opened: IO[bytes] | None = None) -> None:
    """Record that ``path`` was just used, as its modification time (access times are not kept
    on ``noatime`` mounts): one ``utime``, only when the last record is older than
    :data:`USE_RESOLUTION`. ``opened``: the file, already open (its ``fstat`` is asked, not the
    path's); read-only files are left alone."""
    with contextlib.suppress(OSError):
        st = os.fstat(opened.fileno()) if opened is not None else os.stat(path)
        if time.time() - st.st_mtime > USE_RESOLUTION:
            os.utime(path)


def usage(path: str) -> tuple[float, int] | None:
    """(last use in seconds since the epoch: written or :func:`mark_used`, size in bytes) of
    ``path``, from one ``stat``; ``None``: gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime, st.st_size
