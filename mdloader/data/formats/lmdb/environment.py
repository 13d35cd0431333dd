"""An LMDB database's entries and its read-only environments, opened once per process.

A database is a directory holding ``data.mdb``: a ``__metadata__`` entry and one entry per
frame, keyed by the zero-padded frame index (their values: :mod:`~mdloader.data.formats.lmdb.
codec`). Messages name an entry ``<database>/data.mdb[<key>]`` (:func:`entry_of`).

Frames are served by one read-only environment per database and process (no lock file, no
readahead: training reads frames in shuffled order; checked by an ``fstat`` of the file it
reads, no path look-up per batch), opened on the first read through a bounded
:class:`~mdloader.data.formats.handles.HandleCache` and reopened after a fork, since
python-lmdb refuses a second open of a path its process holds. Rank 0 reads the metadata through
:func:`metadata_view`, with readahead on, because that entry is one long sequential value.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from mdloader.data.formats.handles import HandleCache
from mdloader.errors import CorruptFileError, MissingDataError, StaleDataError
from mdloader.persist import FileStamp, file_stamp
from mdloader.settings import cached

log = logging.getLogger(__name__)

METADATA_KEY = b"__metadata__"
DEFAULT_FRAME_FORMAT = "012d"


class _Handle:
    """An open environment, the long-lived read transaction that serves its frames, and a
    descriptor of its ``data.mdb`` whose ``fstat`` checks it before each read (no path
    look-up: the file opened is the one read, even after a rename replaced it)."""

    def __init__(self, env: Any, data_fd: int) -> None:
        self.env, self.data_fd = env, data_fd
        self.txn = env.begin(buffers=True)

    def close(self) -> None:
        self.env.close()  # also ends the transaction
        os.close(self.data_fd)


_ENVS: HandleCache[_Handle] = HandleCache(lambda: int(cached("max_open_lmdb")),
                                         close=_Handle.close, close_inherited=True)


def entry_of(path: str, key: bytes | str) -> str:
    """How messages name one entry: ``<database>/data.mdb[<key>]``."""
    text = key.decode("ascii", "replace") if isinstance(key, bytes) else key
    return f"{os.path.join(path, 'data.mdb')}[{text}]"


def frame_key(index: int, fmt: str) -> bytes:
    """The key of frame ``index`` (``format(index, frame_idx_fmt)``, ASCII)."""
    return format(int(index), fmt).encode("ascii")


def _open(path: str, *, readahead: bool) -> Any:
    import lmdb

    data_file = os.path.join(path, "data.mdb")
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is not a directory"
        raise MissingDataError(f"the LMDB database {what} (expected a directory holding "
                               "data.mdb)", system=path, file=path)
    if not os.path.isfile(data_file):
        raise MissingDataError("not an LMDB database: the directory holds no data.mdb",
                               system=path, file=data_file)
    try:
        return lmdb.open(path, readonly=True, lock=False, readahead=readahead, meminit=False)
    except lmdb.Error as exc:
        raise CorruptFileError("cannot open the file as an LMDB database", system=path,
                               file=data_file, found=str(exc)) from exc


#: What identifies the content of a ``data.mdb`` (:class:`mdloader.persist.FileStamp`).
Stamp = FileStamp


def data_stamp(path: str) -> Stamp | None:
    """The stamp of the database ``path``'s ``data.mdb`` now (``None`` when it is gone)."""
    return file_stamp(os.path.join(path, "data.mdb"))


def serving_txn(path: str, stamp: Stamp | None = None) -> Any:
    """The calling process's read transaction on ``path`` (opened on first use, cached, bounded),
    after checking that ``data.mdb`` still has the ``stamp`` it had when described: when this
    process opens it, by its path (a file replaced would serve another data set's frames);
    before every later read, by an ``fstat`` of the file opened (one truncated would raise
    SIGBUS, one rewritten in place would serve other frames)."""
    handle = _ENVS.get(path, lambda: _serving(path, stamp))
    if stamp is not None:
        check_stamp(path, stamp, os.fstat(handle.data_fd))
    return handle.txn


def _serving(path: str, stamp: Stamp | None) -> _Handle:
    if stamp is not None:
        check_stamp(path, stamp)
    env = _open(path, readahead=False)
    try:
        return _Handle(env, os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        env.close()
        raise MissingDataError("the LMDB database is gone (moved or deleted after it was "
                               "described)", system=path,
                               file=os.path.join(path, "data.mdb")) from exc


#: Databases whose ``data.mdb`` changed status only (ctime) while this process reads them,
#: with the stamp accepted since: warned about once, then read on.
_STATUS_ONLY: dict[str, FileStamp] = {}


def check_stamp(path: str, stamp: Stamp, opened: os.stat_result | None = None) -> None:
    """Raise a :class:`StaleDataError` naming the database when its ``data.mdb`` was replaced,
    truncated or rewritten since it was described with ``stamp`` (``opened``: the ``fstat`` of
    the file this process reads, instead of a look-up of its path).

    A change of status alone (the same inode, size and modification time, a new ctime: a
    ``chmod``, ``chown``, a hard link of a backup, or an older copy of the same size put back
    with ``cp -p``) is one warning per database and process, and reading goes on: ending a
    training for a permission change would be worse than the rare copy it could be. The file
    opened, replaced by a rename or removed (no link left), is read on: one warning.
    """
    now = data_stamp(path) if opened is None else FileStamp.of(opened)
    if now == stamp or (now is not None and _STATUS_ONLY.get(path) == now):
        return
    stamp = FileStamp(*stamp)
    data_file = os.path.join(path, "data.mdb")
    if now is not None and now.only_ctime_differs(stamp) and opened is not None \
            and opened.st_nlink == 0:
        _STATUS_ONLY[path] = now
        log.warning("%s was replaced or removed while it is read: this process reads on the "
                    "database it opened, the one described; a process that opens it anew "
                    "stops naming it", data_file)
        return
    if now is not None and now.only_ctime_differs(stamp):
        _STATUS_ONLY[path] = now
        log.warning("%s: its status changed while it is read (permissions, owner, links, or a "
                    "copy of the same size put back with its old modification time): reading "
                    "on, as its inode, size and modification time are the ones described",
                    data_file)
        return
    if now is None:
        what, found = "removed", "no data.mdb"
    else:
        what = ("replaced" if now.ino != stamp.ino else
                "truncated" if now.size < stamp.size else "rewritten")
        found = now.describe()
    raise StaleDataError(
        f"the LMDB database was {what} after it was described: its frames are not the ones "
        "described", system=path, file=data_file, expected=stamp.describe(),
        found=found).described_by(None)


def forget(path: str) -> None:
    """Close this process's environment of ``path`` (the next read reopens it)."""
    _ENVS.discard(path)


@contextlib.contextmanager
def metadata_view(path: str) -> Iterator[tuple[Any, int]]:
    """A read transaction for rank 0's description of the database, and its entry count.

    The environment that serves frames is used when this process already holds it (python-lmdb
    allows one per path); otherwise a temporary one with readahead on, closed afterwards.
    """
    held = _ENVS.peek(path)
    if held is not None:
        yield held.txn, int(held.env.stat()["entries"])
        return
    env = _open(path, readahead=True)
    try:
        with env.begin(buffers=True) as txn:
            yield txn, int(env.stat()["entries"])
    finally:
        env.close()


def open_count() -> int:
    """How many databases this process holds open (for tests of the bound)."""
    return len(_ENVS)
