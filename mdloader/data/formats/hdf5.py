"""The HDF5 format: the npy layout as groups and datasets inside one file.

An address is ``file.h5#/group`` (``file.h5`` alone, or ``file.h5#/``, for the file's root); a
``systems`` entry that is a file expands into every group holding ``type.raw``
(DeePMD-kit takes any existing file given as a system for HDF5).

``/<grp>/type.raw``, ``/<grp>/type_map.raw`` (byte strings), ``/<grp>/nopbc`` (presence only),
``/<grp>/set.000/coord.npy`` ... Files are opened on first use and cached per process (bounded);
nothing here is ever pickled, and a forked worker reopens its own handles, because HDF5 handles
are not fork-safe. Frame reads fetch only the requested rows (DeePMD-kit reads the whole dataset
for every frame). With ``MDLOADER_DIRECT_READS=1`` a contiguous, unfiltered dataset's rows are read
by their byte offset with ``O_DIRECT`` (:mod:`mdloader.data.formats.direct`) from one more kept
descriptor of the file; a chunked, filtered, compact or external dataset is read by h5py.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from mdloader.data.formats.base import Listing, Location
from mdloader.data.formats.direct import read_at, start_direct, wanted
from mdloader.data.formats.handles import HandleCache
from mdloader.data.formats.npy import O_CLOEXEC, as_rows
from mdloader.data.formats.patterns import matches
from mdloader.data.formats.sets import SetBackend, SetStorage
from mdloader.data.layout import frames_and_width
from mdloader.errors import (
    CorruptFileError,
    DataError,
    MissingDataError,
    StaleDataError,
    UnreadableFileError,
)
from mdloader.settings import cached

_FILES: HandleCache[Any] = HandleCache(lambda: int(cached("max_open_h5")),
                                      close=lambda handle: handle.close(),
                                      valid=lambda handle: bool(handle.id.valid))
# (dataset, shape, byte offset of its data for direct reads or None) by its address; invalid
# once its file is closed
_DATASETS: HandleCache[tuple[Any, tuple[int, ...], int | None]] = HandleCache(
    lambda: DATASETS_KEPT, valid=lambda kept: bool(kept[0].id.valid), counted=False)


class KeptDescriptor:
    """A descriptor of an HDF5 file that reads rows with O_DIRECT (``device``: its device;
    ``None`` once its file system refused, then h5py reads)."""

    __slots__ = ("fd", "device")

    def __init__(self, fd: int, device: int | None) -> None:
        self.fd, self.device = fd, device

    def close(self) -> None:
        os.close(self.fd)


# a forked worker closes its copies of the parent's descriptors: each process reads its own
_DIRECT_FILES: HandleCache[KeptDescriptor] = HandleCache(
    lambda: int(cached("max_open_h5")), close=KeptDescriptor.close, close_inherited=True)


def open_file(path: str, address: str | None = None) -> Any:
    """An open read-only ``h5py.File``, from the per-process cache."""
    return _FILES.get(path, lambda: _open(path, address))


#: Bytes HDF5 reads around a small read of contiguous data (its "sieve buffer"; HDF5's default
#: is 64 KiB): 0 reads a row as itself, so a batch read cold fetches the pages of its rows.
SIEVE_BYTES = 0
#: Datasets one process keeps open (their look-up inside the file costs more than the read).
DATASETS_KEPT = 16384


def _open(path: str, address: str | None) -> Any:
    """The file, read without HDF5's sieve buffer and with the kernel told reads are random."""
    import h5py

    try:
        fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        fapl.set_sieve_buf_size(SIEVE_BYTES)
        handle = h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY, fapl=fapl))
    except FileNotFoundError as exc:
        raise MissingDataError("the HDF5 file does not exist", system=address or path,
                               file=path) from exc
    except OSError as exc:
        raise CorruptFileError("cannot open the file as HDF5", system=address or path, file=path,
                               found=str(exc)) from exc
    if handle.driver == "sec2":
        fd = handle.id.get_vfd_handle()
        _OPENED_SIZES[path] = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return handle


#: The size of each file when this process opened it: HDF5 reads past a file's end as zeros,
#: so a file truncated while open would train on zeros without this comparison.
_OPENED_SIZES: dict[str, int] = {}


def _check_not_shrunk(loc: Location, where: str, dset: Any) -> None:
    """Raise if the file of ``dset`` is shorter now than when this process opened it (one
    ``fstat`` of the open file, no path lookup), the rows just read being HDF5's zeros."""
    opened = _OPENED_SIZES.get(loc.path)
    if opened is None or dset.file.driver != "sec2":
        return
    now = os.fstat(dset.file.id.get_vfd_handle()).st_size
    if now < opened:
        _DATASETS.discard(where)
        _FILES.discard(loc.path)
        raise CorruptFileError("the HDF5 file shrank while it was read (truncated during "
                               "training?)", system=loc.address, file=where,
                               expected=f"{opened} bytes (when it was opened)",
                               found=f"{now} bytes")


def release() -> None:
    """Close every HDF5 file of this process (:func:`mdloader.data.formats.release_handles`)."""
    _FILES.clear()
    _DATASETS.clear()
    _DIRECT_FILES.clear()


def file_of(loc: Location, set_name: str | None, name: str) -> str:
    """The ``file.h5#/group/set/name`` address of a dataset, as error messages name it."""
    inner = "/".join(p for p in (loc.group.strip("/"), set_name or "", name) if p)
    return f"{loc.path}#/{inner}"


def _group(loc: Location) -> Any:
    handle = open_file(loc.path, loc.address)
    try:
        grp = handle[loc.group]
    except KeyError as exc:
        groups = sorted(handle.keys())[:10]
        raise MissingDataError("no such group in the HDF5 file", system=loc.address,
                               file=loc.path, found=f"groups: {groups}") from exc
    if not hasattr(grp, "keys"):
        raise MissingDataError("the HDF5 path is a dataset, not a group", system=loc.address,
                               file=loc.address)
    return grp


def read_type_raw(loc: Location) -> np.ndarray:
    """The system's ``type.raw`` dataset: one atom type per atom."""
    grp = _group(loc)
    if "type.raw" not in grp:
        raise MissingDataError("the system has no type.raw", system=loc.address,
                               file=file_of(loc, None, "type.raw"))
    try:
        return np.asarray(grp["type.raw"][()], dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise CorruptFileError("type.raw must hold integers", system=loc.address,
                               file=file_of(loc, None, "type.raw"), found=str(exc)) from exc


def read_type_map(loc: Location, listing: Listing | None = None) -> list[str] | None:
    """The system's ``type_map.raw`` names, or ``None`` when the group has none."""
    grp = _group(loc)
    if "type_map.raw" not in grp:
        return None
    raw = np.asarray(grp["type_map.raw"][()]).reshape(-1)
    return [v.decode() if isinstance(v, bytes) else str(v) for v in raw.tolist()]


def scan_system(loc: Location, listing: Listing | None = None) -> tuple[bool, list[str]]:
    """Whether the system is periodic (no ``nopbc`` marker), and its ``set.*`` groups in order."""
    grp = _group(loc)
    names = list(grp.keys())
    sets = sorted(n for n in names if n.startswith("set.") and hasattr(grp[n], "keys"))
    return "nopbc" not in names, sets


def set_shapes(loc: Location, set_name: str) -> dict[str, tuple[int, ...]]:
    """The shape of each ``*.npy`` dataset of a set, by key, read without loading data."""
    grp = _group(loc)[set_name]
    return {name[:-4]: tuple(int(s) for s in grp[name].shape)
            for name in sorted(grp.keys()) if name.endswith(".npy")}


def read_rows(loc: Location, set_name: str, stem: str, rows: np.ndarray, set_nframes: int,
              width: int | None = None) -> np.ndarray:
    """As :func:`mdloader.data.formats.npy.read_rows`; the dataset is looked up and its shape
    checked once per process (kept open with its file), and a dataset that vanished or cannot
    be read any more is a :class:`~mdloader.errors.DataError` naming the system and the
    dataset."""
    where = file_of(loc, set_name, stem + ".npy")
    try:
        dset, shape, offset = _DATASETS.get(where, lambda: _dataset(loc, set_name, stem))
        found = frames_and_width(shape, set_nframes)
        if width is not None and found != (set_nframes, width):
            raise StaleDataError("the dataset changed after the system was described",
                                 system=loc.address, file=where,
                                 expected=f"{set_nframes} frames of width {width}",
                                 found=f"{found[0]} frames of width {found[1]} "
                                       f"(shape {shape})")
        if len(shape) == 0 or shape[0] != set_nframes:  # one-frame 0-D/1-D, or stored flat
            return as_rows(np.asarray(dset[()]), rows, set_nframes)
        if offset is not None:
            held = _DIRECT_FILES.get(loc.path, lambda: _open_direct(loc))
            if held.device is not None:
                return _direct_rows(held, loc, where, dset.dtype, shape, offset, rows)
        # h5py wants increasing, unique indices: read those, then put them back in order.
        uniq, inverse = np.unique(rows, return_inverse=True)
        block = dset[uniq[0]:uniq[0] + 1] if len(uniq) == 1 else dset[uniq.tolist()]
        _check_not_shrunk(loc, where, dset)
    except DataError:
        raise  # the file or the group is gone, or it changed: already said
    except KeyError as exc:
        raise MissingDataError("the dataset is gone (the file changed after the build)",
                               system=loc.address, file=where) from exc
    except (OSError, ValueError, IndexError) as exc:
        _DATASETS.discard(where)
        _FILES.discard(loc.path)  # the next read reopens the file
        raise UnreadableFileError("cannot read the dataset (the file changed after the "
                                  "build?)", system=loc.address, file=where,
                                  found=f"{type(exc).__name__}: {exc}") from exc
    return np.asarray(block)[inverse].reshape(len(rows), -1)


def _dataset(loc: Location, set_name: str, stem: str
             ) -> tuple[Any, tuple[int, ...], int | None]:
    """A set's dataset, its shape and, under ``MDLOADER_DIRECT_READS=1``, the byte offset of its
    data when it can be read by offset (:func:`direct_offset`); looked up once per process."""
    dset = _group(loc)[set_name][stem + ".npy"]
    return dset, tuple(int(n) for n in dset.shape), direct_offset(dset) if wanted() else None


def direct_offset(dset: Any) -> int | None:
    """The byte offset in its file of a dataset stored as one contiguous, unfiltered run of
    numbers, written in full; ``None`` for any other (chunked, filtered, compact, external,
    not yet written, or of strings or compound values), which h5py reads."""
    import h5py

    if dset.chunks is not None or dset.dtype.kind not in "biuf" or dset.dtype.fields:
        return None
    plist = dset.id.get_create_plist()
    if (plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters()
            or plist.get_external_count()):
        return None
    offset = dset.id.get_offset()
    if offset is None or dset.id.get_storage_size() != math.prod(dset.shape) * dset.dtype.itemsize:
        return None
    return int(offset)


def _open_direct(loc: Location) -> KeptDescriptor:
    """One more descriptor of the HDF5 file, switched to O_DIRECT (h5py's own descriptor keeps
    reading metadata and the datasets it reads through the page cache)."""
    try:
        fd = os.open(loc.path, os.O_RDONLY | O_CLOEXEC)
    except FileNotFoundError as exc:
        raise MissingDataError("the HDF5 file is gone (moved or deleted after the build)",
                               system=loc.address, file=loc.path) from exc
    except OSError as exc:
        raise UnreadableFileError("cannot read the HDF5 file", system=loc.address,
                                  file=loc.path, found=f"{type(exc).__name__}: "
                                                       f"{exc.strerror or exc}") from exc
    try:
        return KeptDescriptor(fd, start_direct(fd, loc.path))
    except BaseException:
        os.close(fd)
        raise


def _direct_rows(held: KeptDescriptor, loc: Location, where: str, dtype: np.dtype,
                 shape: tuple[int, ...], offset: int, rows: np.ndarray) -> np.ndarray:
    """Rows of a contiguous dataset at byte ``offset`` of the file, one direct read per run of
    consecutive rows straight into the result; a row beyond the file's end is a truncation."""
    row_values = math.prod(shape[1:])
    row_bytes = row_values * dtype.itemsize
    uniq, inverse = np.unique(np.asarray(rows, dtype=np.int64), return_inverse=True)
    if len(uniq) and (uniq[0] < 0 or uniq[-1] >= shape[0]):
        raise IndexError(f"rows {uniq.tolist()} out of range [0, {shape[0]})")
    out = np.empty((len(uniq), row_values), dtype=dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    wanted_rows = uniq.tolist()
    lo = 0
    for hi in range(1, len(wanted_rows) + 1):
        if hi < len(wanted_rows) and wanted_rows[hi] == wanted_rows[hi - 1] + 1:
            continue
        at, size = offset + wanted_rows[lo] * row_bytes, (hi - lo) * row_bytes
        try:
            got = read_at(held, loc.path, view[lo * row_bytes:hi * row_bytes], at)
        except OSError as exc:
            _DIRECT_FILES.discard(loc.path)
            raise UnreadableFileError("cannot read the dataset (the file changed after the "
                                      "build?)", system=loc.address, file=where,
                                      found=f"{type(exc).__name__}: "
                                            f"{exc.strerror or exc}") from exc
        if got < size:
            _DIRECT_FILES.discard(loc.path)
            raise CorruptFileError("the HDF5 file shrank while it was read (truncated during "
                                   "training?)", system=loc.address, file=where,
                                   expected=f"{at + size} bytes for rows {wanted_rows[lo]}-"
                                            f"{wanted_rows[hi - 1]} of shape {shape}",
                                   found=f"{at + got} bytes")
        lo = hi
    return out[inverse.reshape(-1)]


_SUFFIXES = (".h5", ".hdf5", ".hdf")


def hdf5_systems(path: str, group: str, patterns: Sequence[str] | None) -> list[str]:
    """Every group below ``group`` of the file ``path`` that holds ``type.raw`` and matches
    ``patterns`` (relative to ``group``)."""
    handle = open_file(path, f"{path}#{group}")
    top = handle[group] if group != "/" else handle
    out = []
    if "type.raw" in top and matches(".", patterns):
        out.append(f"{path}#{group}")
    prefix = group.rstrip("/")

    def visit(name: str, obj: object) -> None:
        if name.endswith("/type.raw") or name == "type.raw":
            grp = name[: -len("type.raw")].rstrip("/")
            if grp and matches(grp, patterns):
                out.append(f"{path}#{prefix}/{grp}")

    top.visititems(visit)
    return out


class Hdf5Backend(SetBackend):
    """HDF5 files of DeePMD systems (:class:`~mdloader.data.formats.sets.SetBackend`), a file
    expanding into its groups (:class:`~mdloader.data.formats.capabilities.EntryExpansion`)."""

    def parse(self, address: str) -> Location | None:
        path, sep, group = address.partition("#")
        if sep:
            return Location(self.name, path, "/" + group.strip("/")) if path else None
        if address.lower().endswith(_SUFFIXES):
            return Location(self.name, address, "/")
        return None

    def claim(self, path: str) -> Location | None:
        """Any existing file (DeePMD-kit's rule), whatever its name."""
        return Location(self.name, path, "/") if os.path.isfile(path) else None

    def container(self, loc: Location) -> str | None:
        return os.path.abspath(loc.path)

    def expand(self, loc: Location, patterns: Sequence[str] | None,
               known: list[str] | None = None) -> list[str]:
        file, group = os.path.abspath(loc.path), loc.group
        if known is not None:
            prefix = f"{file}#{group.rstrip('/')}"
            return [a for a in known
                    if group == "/" or a == prefix or a.startswith(prefix + "/")]
        return hdf5_systems(file, group, patterns)

    def freshness_paths(self, addresses: Sequence[str], layout: tuple[bool, tuple[str, ...]]
                        ) -> list[str] | None:
        """The file: any change to it describes its systems again."""
        return [address.partition("#")[0] for address in addresses]

    def release(self) -> None:
        release()


#: Set-layout systems as groups of HDF5 files.
HDF5_GROUPS = SetStorage(file_of=file_of, scan_system=scan_system, read_type_raw=read_type_raw,
                         read_type_map=read_type_map, set_shapes=set_shapes,
                         read_rows=read_rows)
BACKEND = Hdf5Backend(HDF5_GROUPS)


def direct_file_count() -> int:
    """How many HDF5 files this process reads rows of with O_DIRECT (for tests)."""
    return sum(held.device is not None for held in _DIRECT_FILES.values())
