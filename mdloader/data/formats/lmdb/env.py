"""The LMDB backend: DeePMD-kit's database of msgpack frames, opened read-only once per process.

A database is a directory holding ``data.mdb``. Its ``__metadata__`` entry and one entry per
frame, keyed by the zero-padded frame index, are msgpack maps; arrays are encoded as
``{"type": dtype name, "shape": [...], "data": C-order bytes}`` (dpdata's ``deepmd/lmdb``
writer, read by DeePMD-kit's ``LmdbDataReader``).

Frames are served by one read-only environment per database and process (no lock file, no
readahead: training reads frames in shuffled order), opened on the first read through a bounded
:class:`~mdloader.data.formats.handles.HandleCache` and reopened after a fork, since
python-lmdb refuses a second open of a path its process holds. Rank 0 reads the metadata through
:func:`metadata_view`, with readahead on, because that entry is one long sequential value.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from mdloader.data.formats.handles import HandleCache
from mdloader.errors import CorruptFileError, MissingDataError, StaleDataError
from mdloader.settings import cached

METADATA_KEY = b"__metadata__"
DEFAULT_FRAME_FORMAT = "012d"


class _Handle:
    """An open environment and the long-lived read transaction that serves its frames."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.txn = env.begin(buffers=True)

    def close(self) -> None:
        self.env.close()  # also ends the transaction


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


#: What identifies the content of a ``data.mdb``: (inode, size, mtime in ns).
Stamp = tuple[int, int, int]


def data_stamp(path: str) -> Stamp | None:
    """The stamp of the database ``path``'s ``data.mdb`` now (``None`` when it is gone)."""
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def serving_txn(path: str, stamp: Stamp | None = None) -> Any:
    """The calling process's read transaction on ``path`` (opened on first use, cached, bounded),
    after checking that ``data.mdb`` still has the ``stamp`` it had when described: a file
    replaced would serve another data set's frames, one truncated would raise SIGBUS."""
    if stamp is not None:
        check_stamp(path, stamp)
    return _ENVS.get(path, lambda: _Handle(_open(path, readahead=False))).txn


def check_stamp(path: str, stamp: Stamp) -> None:
    """Raise a :class:`StaleDataError` naming the database when its ``data.mdb`` was replaced,
    truncated or rewritten since it was described with ``stamp``."""
    now = data_stamp(path)
    if now == stamp:
        return
    data_file = os.path.join(path, "data.mdb")
    if now is None:
        what, found = "removed", "no data.mdb"
    else:
        what = ("replaced" if now[0] != stamp[0] else
                "truncated" if now[1] < stamp[1] else "rewritten")
        found = f"inode {now[0]}, {now[1]} bytes, mtime {now[2]} ns"
    raise StaleDataError(
        f"the LMDB database was {what} after it was described: its frames are not the ones "
        "described", system=path, file=data_file,
        expected=f"inode {stamp[0]}, {stamp[1]} bytes, mtime {stamp[2]} ns",
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


def unpack(raw: Any, what: str, path: str, key: bytes) -> Any:
    """msgpack-decode one entry; a corrupt value is a :class:`CorruptFileError` naming it."""
    import msgpack

    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError) as exc:
        raise CorruptFileError(f"cannot decode {what} (not msgpack)", system=path,
                               file=entry_of(path, key), found=f"{type(exc).__name__}: {exc}"
                               ) from exc


def pack(value: Any) -> bytes:
    """msgpack-encode an entry as dpdata does (binary type for bytes, string keys)."""
    import msgpack

    return msgpack.packb(value, use_bin_type=True)


def is_encoded_array(value: Any) -> bool:
    """Whether ``value`` is an ``{"type", "data"}`` map (string or byte keys)."""
    return isinstance(value, dict) and (("type" in value and "data" in value)
                                        or (b"type" in value and b"data" in value))


def decode_array(value: dict[Any, Any]) -> np.ndarray:
    """An encoded array as a read-only view of its bytes (``shape`` absent: one dimension).

    Raises ``ValueError``/``TypeError`` when the dtype is unknown or the bytes do not fill the
    shape; callers turn that into an error naming the frame.
    """
    def get(name: str) -> Any:
        return value[name] if name in value else value.get(name.encode())

    kind = get("type")
    dtype = np.dtype(kind.decode() if isinstance(kind, bytes) else kind)
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects")
    data = get("data")
    shape = get("shape")
    array = np.frombuffer(data, dtype=dtype)
    return array if shape is None else array.reshape(tuple(shape))


_DTYPE_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """The NumPy name of ``dtype`` (``float64``), as dpdata stores it; cached (``str`` is slow)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """``{"type", "shape", "data"}`` with numpy's dtype name, as dpdata writes it."""
    array = np.asarray(array)  # not ascontiguousarray: it turns a 0-d energy into shape (1,)
    return {"type": dtype_name(array.dtype), "shape": list(array.shape),
            "data": array.tobytes(order="C")}


def open_count() -> int:
    """How many databases this process holds open (for tests of the bound)."""
    return len(_ENVS)
