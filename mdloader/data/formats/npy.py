"""The npy directory backend: text files, ``set.*`` folders, npy headers and memory-mapped rows.

Building reads only headers (``np.lib.format``), never arrays. Frame reads go through memory maps
kept in a bounded per-process cache, because every open map holds a file descriptor and
``10 000 systems x 5 keys`` would exceed ``ulimit -n``.
"""

from __future__ import annotations

import math
import mmap
import os
import re
from typing import BinaryIO

import numpy as np

from mdloader.data.formats import Location
from mdloader.data.formats.handles import HandleCache
from mdloader.errors import CorruptFileError, MissingDataError
from mdloader.settings import cached

_MAPS: HandleCache[np.ndarray] = HandleCache(lambda: int(cached("max_open_files")))


def file_of(loc: Location, set_name: str | None, name: str) -> str:
    """The path a message should name for a member of the system."""
    return os.path.join(loc.path, set_name, name) if set_name else os.path.join(loc.path, name)


def read_type_raw(loc: Location) -> np.ndarray:
    path = file_of(loc, None, "type.raw")
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode()
    except FileNotFoundError as exc:
        raise MissingDataError("the system has no type.raw", system=loc.address,
                               file=path) from exc
    try:
        return np.array([int(tok) for tok in text.split()], dtype=np.int64)
    except ValueError as exc:
        raise CorruptFileError("type.raw must hold whitespace-separated integers",
                               system=loc.address, file=path, found=str(exc)) from exc


def read_type_map(loc: Location) -> list[str] | None:
    path = file_of(loc, None, "type_map.raw")
    try:
        with open(path, "rb") as fh:
            return fh.read().decode().split()
    except FileNotFoundError:
        return None


def scan_system(loc: Location) -> tuple[bool, list[str]]:
    """(periodic?, sorted set names) from one directory listing of the system."""
    try:
        entries = list(os.scandir(loc.path))
    except FileNotFoundError as exc:
        raise MissingDataError("the system directory does not exist", system=loc.address,
                               file=loc.path) from exc
    except NotADirectoryError as exc:
        raise MissingDataError("the system path is not a directory", system=loc.address,
                               file=loc.path) from exc
    names = {e.name: e for e in entries}
    sets = sorted(n for n, e in names.items() if n.startswith("set.") and e.is_dir())
    return "nopbc" not in names, sets


def set_shapes(loc: Location, set_name: str) -> dict[str, tuple[int, ...]]:
    """Shapes of every ``*.npy`` in a set, from headers only."""
    folder = os.path.join(loc.path, set_name)
    shapes: dict[str, tuple[int, ...]] = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.endswith(".npy"):
            shapes[entry.name[:-4]] = _header_shape(loc, entry.path)
    return shapes


_HEADER_RE = re.compile(r"'descr':\s*'([^']+)',\s*'fortran_order':\s*(True|False),\s*"
                        r"'shape':\s*\(([\d,\s]*)\)")
_DTYPES: dict[str, np.dtype] = {}


def _header_shape(loc: Location, path: str) -> tuple[int, ...]:
    """Shape from the npy header; also checks that the file holds all the data it announces.

    A small regex handles the headers numpy writes (numpy's own parser uses ``ast.literal_eval``,
    slow for the thousands of headers of a build); anything unusual falls back to numpy's.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(256)
            shape, dtype, offset, _ = _parse_header(fh, head)
            data_bytes = os.fstat(fh.fileno()).st_size - offset
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise CorruptFileError("cannot read the npy header (corrupt or truncated file)",
                               system=loc.address, file=path, found=str(exc)) from exc
    needed = math.prod(shape) * dtype.itemsize
    if data_bytes < needed:
        raise CorruptFileError("the npy file is shorter than its header says (truncated)",
                               system=loc.address, file=path,
                               expected=f"{needed} data bytes for shape {shape} {dtype}",
                               found=f"{data_bytes} bytes")
    return shape


def _parse_header(fh: BinaryIO, head: bytes) -> tuple[tuple[int, ...], np.dtype, int, bool]:
    """(shape, dtype, data offset, Fortran order) of an open npy file whose first bytes are
    ``head``."""
    if head[:6] != b"\x93NUMPY" or len(head) < 10:
        raise ValueError(f"not an npy file (magic bytes {head[:8]!r})")
    start, hlen = (10, int.from_bytes(head[8:10], "little")) if head[6] == 1 else \
        (12, int.from_bytes(head[8:12], "little"))
    if start + hlen <= len(head):
        match = _HEADER_RE.search(head[start:start + hlen].decode("latin1"))
        if match:
            descr = match.group(1)
            dtype = _DTYPES.get(descr) or _DTYPES.setdefault(descr, np.dtype(descr))
            shape = tuple(int(x) for x in match.group(3).replace(",", " ").split())
            return shape, dtype, start + hlen, match.group(2) == "True"
    fh.seek(0)
    version = np.lib.format.read_magic(fh)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
        np.lib.format.read_array_header_2_0
    shape, fortran, dtype = reader(fh)
    return tuple(int(s) for s in shape), dtype, fh.tell(), bool(fortran)


def read_rows(loc: Location, set_name: str, stem: str, rows: np.ndarray,
              set_nframes: int) -> np.ndarray:
    """Rows ``rows`` of ``set_name/stem.npy`` as a fresh ``(len(rows), width)`` array.

    DeePMD-kit allows a one-frame set to store 0-D/1-D arrays; they are that single frame. An
    array stored flat is read through a ``(set_nframes, -1)`` view of the same map
    (:mod:`mdloader.data.layout`).
    """
    arr = _memmap(os.path.join(loc.path, set_name, stem + ".npy"))
    return as_rows(arr, rows, set_nframes)


def as_rows(arr: np.ndarray, rows: np.ndarray, set_nframes: int) -> np.ndarray:
    """Shared by both backends: index frames and flatten each to one row; an array whose
    first axis is not the frames is first viewed as ``(set_nframes, -1)``."""
    if arr.ndim == 0 or arr.shape[0] != set_nframes:
        arr = arr.reshape(set_nframes, -1)
    return np.asarray(arr[rows]).reshape(len(rows), -1)


def _memmap(path: str) -> np.ndarray:
    return _MAPS.get(path, lambda: _open_map(path))


def _open_map(path: str) -> np.ndarray:
    with open(path, "rb") as fh:  # one open: the map keeps its own descriptor
        shape, dtype, offset, fortran = _parse_header(fh, fh.read(256))
        if dtype.hasobject:
            raise ValueError(f"{path} holds Python objects; DeePMD arrays are numeric")
        count = math.prod(shape)
        if count == 0:
            return np.empty(shape, dtype=dtype)
        # a plain ndarray over an mmap: np.memmap's Python-level hooks cost more per read
        buffer = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(
            shape, order="F" if fortran else "C")


def open_map_count() -> int:
    """How many memory maps this process holds (for tests of the bound)."""
    return len(_MAPS)
