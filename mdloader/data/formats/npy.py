"""The npy directory format: text files, ``set.*`` folders, npy headers and rows read by pread.

Its systems are folders, found by walking the ``systems`` entries
(:mod:`mdloader.catalog.discover`); any plain path the other formats do not claim is one.

Building reads only headers, never arrays: one listing per folder (the system's comes from
discovery) and one ``open`` per file. Frame reads are ``pread`` calls on descriptors kept open
in a bounded per-process cache (:func:`read_rows`): after a file's first read in a process, a
batch makes no path lookup, no open and no ``stat`` on the shared file system, asks the kernel
for no read-ahead, and a file truncated under it is a short read, an error naming it (a read
through a memory map would die of SIGBUS). With ``MDLOADER_DIRECT_READS=1`` the kept descriptor
reads with ``O_DIRECT`` (:mod:`mdloader.data.formats.direct`): storage sends the blocks a row
spans, not the 4 KiB pages the page cache fetches, for a data set larger than the node's memory.
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

from mdloader.data.formats.base import Listing, Location, interned
from mdloader.data.formats.direct import read_at, start_direct, wanted
from mdloader.data.formats.handles import HandleCache
from mdloader.data.formats.sets import SetBackend, SetStorage
from mdloader.data.layout import frames_and_width
from mdloader.errors import (
    CorruptFileError,
    MissingDataError,
    StaleDataError,
    UnreadableFileError,
)
from mdloader.fs_calls import timed
from mdloader.settings import cached

log = logging.getLogger(__name__)

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class OpenArray:
    """A kept descriptor of an npy file and what its header said when it was opened."""

    __slots__ = ("fd", "shape", "dtype", "offset", "fortran", "count", "device")

    def __init__(self, fd: int, shape: tuple[int, ...], dtype: np.dtype, offset: int,
                 fortran: bool, device: int | None = None) -> None:
        self.fd, self.shape, self.dtype, self.offset, self.fortran = (fd, shape, dtype, offset,
                                                                      fortran)
        self.count = math.prod(shape)
        self.device = device  # set while ``fd`` reads with O_DIRECT: the file's device

    def close(self) -> None:
        os.close(self.fd)


# a forked worker closes its copies of the parent's descriptors: each process reads its own
_FILES: HandleCache[OpenArray] = HandleCache(lambda: int(cached("max_open_files")),
                                             close=OpenArray.close, close_inherited=True)


def file_of(loc: Location, set_name: str | None, name: str) -> str:
    """The path a message should name for a member of the system."""
    return os.path.join(loc.path, set_name, name) if set_name else os.path.join(loc.path, name)


def read_small(path: str) -> bytes:
    """The whole of a small file in one ``open`` (Python's ``open`` adds two ``fstat`` calls)."""
    fd = timed(os.open, path, os.O_RDONLY | O_CLOEXEC)
    try:
        chunks = [timed(os.read, fd, 1 << 16)]
        while chunks[-1]:
            chunks.append(timed(os.read, fd, 1 << 20))
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_type_raw(loc: Location) -> np.ndarray:
    """The system's ``type.raw`` file: one atom type per atom."""
    path = file_of(loc, None, "type.raw")
    try:
        text = read_small(path).decode()
    except FileNotFoundError as exc:
        raise MissingDataError("the system has no type.raw", system=loc.address,
                               file=path) from exc
    try:
        return np.array([int(tok) for tok in text.split()], dtype=np.int64)
    except ValueError as exc:
        raise CorruptFileError("type.raw must hold whitespace-separated integers",
                               system=loc.address, file=path, found=str(exc)) from exc


def read_type_map(loc: Location, listing: Listing | None = None) -> list[str] | None:
    """``type_map.raw``'s names; not opened when the system's listing shows none."""
    if listing is not None and "type_map.raw" not in listing[0]:
        return None
    try:
        return read_small(file_of(loc, None, "type_map.raw")).decode().split()
    except FileNotFoundError:
        return None


def list_dir(path: str) -> Listing:
    """(file names, folder names, folders that are symbolic links) of ``path``, each sorted.

    One listing (the entry types come with it); the tuples are shared between folders with the
    same entries. A symbolic link to a folder counts as a folder (its ``set.*`` is read), and a
    walk looks at it without descending into it (as ``Path.rglob``); an entry whose type cannot
    be known (a symbolic link loop) is left out with a warning, as DeePMD-kit's ``rglob``
    ignores it.
    """
    files, dirs, links = [], [], []
    with timed(os.scandir, path) as listing:
        entries = timed(list, listing)
    for entry in entries:
        try:
            is_dir = entry.is_dir()
        except OSError as exc:  # a symbolic link loop: neither file nor folder, as for rglob
            log.warning("ignoring %s: %s", entry.path, exc.strerror or exc)
            continue
        if is_dir:
            dirs.append(entry.name)
            if entry.is_symlink():
                links.append(entry.name)
        else:
            files.append(entry.name)
    return (interned(tuple(sorted(files))), interned(tuple(sorted(dirs))),
            interned(tuple(sorted(links))))


def scan_system(loc: Location, listing: Listing | None = None) -> tuple[bool, list[str]]:
    """(periodic?, sorted set names) from the system's listing (made here when not given)."""
    if listing is None:
        try:
            listing = list_dir(loc.path)
        except FileNotFoundError as exc:
            raise MissingDataError("the system directory does not exist", system=loc.address,
                                   file=loc.path) from exc
        except NotADirectoryError as exc:
            raise MissingDataError("the system path is not a directory", system=loc.address,
                                   file=loc.path) from exc
    files, dirs = listing[0], listing[1]
    sets = [n for n in dirs if n.startswith("set.")]
    return "nopbc" not in files and "nopbc" not in dirs, sets


def set_shapes(loc: Location, set_name: str) -> dict[str, tuple[int, ...]]:
    """Shapes of every ``*.npy`` in a set, from headers only: one listing, one open per file."""
    folder = os.path.join(loc.path, set_name)
    files = list_dir(folder)[0]
    return {name[:-4]: _header_shape(loc, os.path.join(folder, name))
            for name in files if name.endswith(".npy")}


_HEADER_RE = re.compile(r"'descr':\s*'([^']+)',\s*'fortran_order':\s*(True|False),\s*"
                        r"'shape':\s*\(([\d,\s]*)\)")
_DTYPES: dict[str, np.dtype] = {}
_HEAD = 256  # bytes read first: the whole header numpy writes for DeePMD arrays


def _header_shape(loc: Location, path: str) -> tuple[int, ...]:
    """Shape from the npy header; also checks that the file holds all the data it announces.

    One ``open``, the first bytes read without read-ahead, the size from ``lseek``: a cold
    build reads about one page per file.
    """
    try:
        fd = timed(os.open, path, os.O_RDONLY | O_CLOEXEC)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            shape, dtype, offset, _ = _parse_header(lambda n: timed(os.pread, fd, n, 0))
            size = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise CorruptFileError("cannot read the npy header (corrupt or truncated file)",
                               system=loc.address, file=path, found=str(exc)) from exc
    needed = math.prod(shape) * dtype.itemsize
    if size - offset < needed:
        raise CorruptFileError("the npy file is shorter than its header says (truncated)",
                               system=loc.address, file=path,
                               expected=f"{needed} data bytes for shape {shape} {dtype}",
                               found=f"{size - offset} bytes")
    return shape


def _parse_header(read: Callable[[int], bytes]) -> tuple[tuple[int, ...], np.dtype, int, bool]:
    """(shape, dtype, data offset, Fortran order) of an npy file; ``read(n)`` gives its first
    ``n`` bytes.

    A small regex handles the headers numpy writes (numpy's own parser uses
    ``ast.literal_eval``, slow for the thousands of headers of a build); anything unusual goes
    to numpy's parser.
    """
    head = read(_HEAD)
    if head[:6] != b"\x93NUMPY" or len(head) < 10:
        raise ValueError(f"not an npy file (magic bytes {head[:8]!r})")
    start, hlen = (10, int.from_bytes(head[8:10], "little")) if head[6] == 1 else \
        (12, int.from_bytes(head[8:12], "little"))
    if start + hlen > len(head):
        head = read(start + hlen)
    match = _HEADER_RE.search(head[start:start + hlen].decode("latin1"))
    if match:
        descr = match.group(1)
        dtype = _DTYPES.get(descr) or _DTYPES.setdefault(descr, np.dtype(descr))
        shape = tuple(int(x) for x in match.group(3).replace(",", " ").split())
        return shape, dtype, start + hlen, match.group(2) == "True"
    fh = io.BytesIO(head)
    version = np.lib.format.read_magic(fh)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
        np.lib.format.read_array_header_2_0
    shape, fortran, dtype = reader(fh)
    return tuple(int(s) for s in shape), dtype, fh.tell(), bool(fortran)


def read_rows(loc: Location, set_name: str, stem: str, rows: np.ndarray, set_nframes: int,
              width: int | None = None) -> np.ndarray:
    """Rows ``rows`` of ``set_name/stem.npy`` as a fresh ``(len(rows), width)`` array.

    DeePMD-kit allows a one-frame set to store 0-D/1-D arrays; they are that single frame. An
    array stored flat is read as ``(set_nframes, -1)`` (:mod:`mdloader.data.layout`). The file
    is opened once per process and kept (:data:`_FILES`); ``width`` (the per-frame width in
    the system's description), the frame count and the file size are checked then: a file that
    changed since the description raises :class:`~mdloader.errors.StaleDataError`, one that
    vanished or cannot be read, another :class:`~mdloader.errors.DataError` naming the system
    and the file. Later reads are one ``pread`` per run of consecutive rows: a file truncated
    since is a short read (:class:`~mdloader.errors.CorruptFileError`); a file replaced by
    another (a rename onto its path) is not seen, the kept descriptor reads the file opened.
    """
    path = os.path.join(loc.path, set_name, stem + ".npy")
    held = _FILES.get(path, lambda: _open_array(path, loc, set_nframes, width))
    if width is not None and held.count != set_nframes * width:
        # kept from an older description of a file since described again: open it anew
        _FILES.discard(path)
        held = _FILES.get(path, lambda: _open_array(path, loc, set_nframes, width))
    count = held.count
    if count == 0 or held.fortran or set_nframes < 1 or count % set_nframes:
        return as_rows(_whole(held, path, loc), rows, set_nframes)
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= set_nframes):
        raise IndexError(f"rows {rows.tolist()} out of range [0, {set_nframes}) of {path}")
    return _pread_rows(held, path, loc, rows, count // set_nframes)


def _pread_rows(held: OpenArray, path: str, loc: Location, rows: np.ndarray,
                row_values: int) -> np.ndarray:
    """Rows of a C-ordered array, one ``preadv`` per run of consecutive rows straight into the
    result; a row beyond the file's end is a truncation."""
    out = np.empty((len(rows), row_values), dtype=held.dtype)
    row_bytes = row_values * held.dtype.itemsize
    wanted = rows.tolist()
    if wanted != sorted(set(wanted)):  # repeated or unordered: read each row once, in order
        unique, inverse = np.unique(rows, return_inverse=True)
        return _pread_rows(held, path, loc, unique, row_values)[inverse.reshape(-1)]
    view = memoryview(out.reshape(-1).view(np.uint8))
    lo = 0
    for hi in range(1, len(wanted) + 1):
        if hi < len(wanted) and wanted[hi] == wanted[hi - 1] + 1:
            continue
        at = held.offset + wanted[lo] * row_bytes
        size = (hi - lo) * row_bytes
        try:
            got = read_at(held, path, view[lo * row_bytes:hi * row_bytes], at)
        except OSError as exc:
            _FILES.discard(path)
            raise UnreadableFileError("cannot read the npy file", system=loc.address,
                                      file=path, found=f"{type(exc).__name__}: "
                                                       f"{exc.strerror or exc}") from exc
        if got < size:
            _FILES.discard(path)
            raise CorruptFileError("the npy file shrank while it was read (truncated during "
                                   "training?)", system=loc.address, file=path,
                                   expected=f"{at + size} bytes for rows {wanted[lo]}-"
                                            f"{wanted[hi - 1]} of shape {held.shape}",
                                   found=f"{at + got} bytes")
        lo = hi
    return out


def _whole(held: OpenArray, path: str, loc: Location) -> np.ndarray:
    """The whole array (a Fortran-ordered file, a 0-D array, an empty one), read at once."""
    count = held.count
    flat = np.empty(count, dtype=held.dtype)
    if count:
        size = flat.nbytes
        got = read_at(held, path, memoryview(flat.view(np.uint8)), held.offset)
        if got < size:
            _FILES.discard(path)
            raise CorruptFileError("the npy file shrank while it was read (truncated during "
                                   "training?)", system=loc.address, file=path,
                                   expected=f"{held.offset + size} bytes",
                                   found=f"{held.offset + got} bytes")
    return flat.reshape(held.shape, order="F" if held.fortran else "C")


def as_rows(arr: np.ndarray, rows: np.ndarray, set_nframes: int) -> np.ndarray:
    """Shared by both backends: index frames and flatten each to one row; an array whose
    first axis is not the frames is first viewed as ``(set_nframes, -1)``."""
    if arr.ndim == 0 or arr.shape[0] != set_nframes:
        arr = arr.reshape(set_nframes, -1)
    return np.asarray(arr[rows]).reshape(len(rows), -1)


def _open_array(path: str, loc: Location, nframes: int, width: int | None) -> OpenArray:
    """Open ``path`` for reading rows, after checking that it still holds the frames and width
    it was described with and every byte its header announces.

    The kernel is told the reads will be random (no read-ahead: a row read cold fetches the
    pages it spans, not the file around it); with ``MDLOADER_DIRECT_READS=1`` the descriptor
    is then switched to O_DIRECT (``fcntl``: no second open, no second descriptor), so a row
    fetches only the blocks it spans.
    """
    try:
        fd = timed(os.open, path, os.O_RDONLY | O_CLOEXEC)
    except FileNotFoundError as exc:
        raise MissingDataError("the npy file is gone (moved or deleted after the build)",
                               system=loc.address, file=path) from exc
    except OSError as exc:
        raise UnreadableFileError("cannot read the npy file", system=loc.address, file=path,
                                  found=f"{type(exc).__name__}: {exc.strerror or exc}") from exc
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        shape, dtype, offset, fortran = _mapped_header(loc, path, fd)
        size = os.lseek(fd, 0, os.SEEK_END)
        _check_unchanged(loc, path, shape, nframes, width, size - offset,
                         math.prod(shape) * dtype.itemsize)
        device = start_direct(fd, path) if wanted() else None
    except BaseException:
        os.close(fd)
        raise
    return OpenArray(fd, shape, dtype, offset, fortran, device)


def _mapped_header(loc: Location, path: str, fd: int) -> tuple[tuple[int, ...], np.dtype, int,
                                                               bool]:
    """The header of an open npy file, whose data must be numbers."""
    try:
        shape, dtype, offset, fortran = _parse_header(lambda n: os.pread(fd, n, 0))
    except OSError as exc:
        raise UnreadableFileError("cannot read the npy file", system=loc.address, file=path,
                                  found=f"{type(exc).__name__}: {exc.strerror or exc}") from exc
    except (ValueError, EOFError, SyntaxError) as exc:
        raise CorruptFileError("cannot read the npy header (changed after the build?)",
                               system=loc.address, file=path, found=str(exc)) from exc
    if dtype.hasobject:
        raise CorruptFileError("the npy file holds Python objects; DeePMD arrays are numeric",
                               system=loc.address, file=path, found=str(dtype))
    return shape, dtype, offset, fortran


def _check_unchanged(loc: Location, path: str, shape: tuple[int, ...], nframes: int,
                     width: int | None, data_bytes: int, needed: int) -> None:
    """The file still has the frames and width it was described with, and all its data."""
    found = frames_and_width(shape, nframes)
    if width is not None and found != (nframes, width):
        raise StaleDataError("the file changed after the system was described",
                             system=loc.address, file=path,
                             expected=f"{nframes} frames of width {width}",
                             found=f"{found[0]} frames of width {found[1]} (shape {shape})")
    if data_bytes < needed:
        raise CorruptFileError("the npy file is shorter than its header says (truncated after "
                               "the build?)", system=loc.address, file=path,
                               expected=f"{needed} data bytes for shape {shape}",
                               found=f"{data_bytes} bytes")


def release() -> None:
    """Close every kept file of this process (:func:`mdloader.data.formats.release_handles`)."""
    _FILES.clear()


class NpyBackend(SetBackend):
    """DeePMD-kit's npy directories (:class:`~mdloader.data.formats.sets.SetBackend`), found
    by walking folders (:class:`~mdloader.data.formats.capabilities.FolderWalk`)."""

    def list_folder(self, path: str) -> Listing:
        return list_dir(path)

    def walk_step(self, listing: Listing) -> tuple[bool, list[str], list[str]]:
        """A folder holding ``type.raw`` is a system; its ``set.*`` folders hold frames; a link
        to a folder is looked at (a system when it holds ``type.raw``) but not descended into,
        as DeePMD-kit's ``Path.rglob`` does."""
        files, dirs, links = listing
        is_system = "type.raw" in files
        walked = [d for d in dirs if not (is_system and d.startswith("set."))]
        return (is_system, [d for d in walked if d not in links],
                [d for d in walked if d in links])

    def parse(self, address: str) -> Location | None:
        if "#" in address or not address:
            return None
        return Location(self.name, address.rstrip("/") or "/", "")

    def freshness_paths(self, addresses: Sequence[str], layout: tuple[bool, tuple[str, ...]]
                        ) -> list[str] | None:
        """The folder, ``type.raw``, ``type_map.raw`` (when it has one), each ``set.*`` folder
        and its ``coord.npy`` (a set rewritten in place with other frames rewrites it); another
        array changed is checked when a process first opens it (:func:`read_rows`)."""
        ends = self._ends.get(layout)
        if ends is None:
            extra = ("/type_map.raw",) if layout[0] else ()
            sets = [end for s in layout[1] for end in ("/" + s, f"/{s}/coord.npy")]
            ends = self._ends[layout] = ("", "/type.raw", *extra, *sets)
        return [address + end for address in addresses for end in ends]

    def __init__(self) -> None:
        super().__init__(NPY_FOLDERS)
        self._ends: dict[tuple[bool, tuple[str, ...]], tuple[str, ...]] = {}

    def release(self) -> None:
        release()


#: Set-layout systems as folders of npy files.
NPY_FOLDERS = SetStorage(file_of=file_of, scan_system=scan_system, read_type_raw=read_type_raw,
                         read_type_map=read_type_map, set_shapes=set_shapes,
                         read_rows=read_rows)
BACKEND = NpyBackend()


def open_file_count() -> int:
    """How many npy files this process keeps open (for tests of the bound)."""
    return len(_FILES)


def direct_file_count() -> int:
    """How many of them read with O_DIRECT (``MDLOADER_DIRECT_READS=1``; for tests)."""
    return sum(held.device is not None for held in _FILES.values())
