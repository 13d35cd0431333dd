"""One storage format behind one interface, and the registry that finds a system's format.

A storage format (npy directories, HDF5 groups, groups of frames in an LMDB database, or one a
user registers) is a :class:`Backend`: it recognises its addresses, expands a ``systems`` entry
into systems, describes a system (:class:`~mdloader.data.system.SystemMeta`), reads its frames
and batches, checks it deeply, and says which paths tell whether a saved description is still
true. Everything above :mod:`mdloader.data.formats` asks the backend of an address
(:func:`backend_of`) instead of testing a format's name, so a new format is one class and one
:func:`register_backend` call.

This module imports no format and not :mod:`mdloader.data.system` (only for type checking): the
description imports the registry, the formats import both. The built-in formats are imported
on the first look-up, by module name, as a plugin would be.
"""

from __future__ import annotations

import importlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np

from mdloader.errors import DataError, UnknownFormatError

if TYPE_CHECKING:
    from mdloader.data.schema import DataRequirementItem
    from mdloader.data.system import SystemMeta

#: One directory's listing: (file names, directory names, directory names that are symbolic
#: links), each sorted. Discovery makes it; the build reuses it instead of listing again.
Listing = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]

#: Frames read at once by the default deep check and box check (bounds memory on large systems).
DEEP_CHUNK = 1024
SHOWN = 10  # frames named per problem


@dataclass(frozen=True)
class Location:
    """A parsed system address: the backend's name, the path on disk, the part inside it."""

    backend: str  # the registered name of the format: "npy", "hdf5", "lmdb", ...
    path: str  # the directory, the file, or the database (a directory)
    group: str  # "" for a directory; "/" or "/a/b" inside an HDF5 file; an LMDB group ...

    @property
    def address(self) -> str:
        return f"{self.path}#{self.group}" if self.group else self.path


class FrameReader(ABC):
    """Reads the frames of one described system under a set of data requirements.

    Frame ids come as the caller gave them (negative ones count from the end): a reader checks
    them with :func:`frame_ids`. Frames and batches are DeePMD-kit's
    (``DeepmdDataSetForLoader[i]`` and its collation, :mod:`mdloader.data.collate`).
    """

    @abstractmethod
    def frames(self, fids: Sequence[int]) -> list[dict[str, Any]]:
        """One frame dict per id."""

    def batch(self, fids: Sequence[int]) -> dict[str, Any]:
        """The collated batch of ``fids`` (by default the frames, collated)."""
        from mdloader.data.collate import collate_batch

        return collate_batch(self.frames(fids))


class Backend(ABC):
    """A storage format: everything the library needs to find, describe and read its systems.

    Capabilities (class attributes) answer what callers used to learn from a format's name.
    """

    #: The registered name, also :attr:`Location.backend` of its addresses.
    name: str = ""
    #: Periodicity and boxes are known per frame, not from the description: ``check`` shows
    #: ``pbc ?`` and the box check before training leaves them to the reads (LMDB).
    pbc_per_frame: bool = False
    #: Descriptions may be saved in a system index; otherwise re-described at every start.
    indexable: bool = True
    #: Its systems are folders found by walking a ``systems`` entry (npy): discovery walks such
    #: an entry instead of calling :meth:`expand`, and a saved walk's folders are reused.
    walks: bool = False

    # -- addresses and discovery --------------------------------------------------------------
    @abstractmethod
    def parse(self, address: str) -> Location | None:
        """The address's location if its text names this format (no file-system call)."""

    def claim(self, path: str) -> Location | None:
        """The location of an existing plain path (no ``#``) given as a ``systems`` entry, if
        this format holds it: by default when its text names the format; a format may look at
        the file system (a folder holding an LMDB database, any file as HDF5)."""
        return self.parse(path)

    def expand(self, loc: Location, patterns: Sequence[str] | None,
               known: list[str] | None = None) -> list[str]:
        """The systems one ``systems`` entry at ``loc`` stands for (an HDF5 file's groups, a
        database's groups); ``known``: those an earlier discovery found in :meth:`container`,
        unchanged since."""
        return [loc.address]

    def container(self, loc: Location) -> str | None:
        """The file whose freshness tells whether :meth:`expand`'s answer still holds (``None``:
        expanded again at every start)."""
        return None

    def sort_key(self, loc: Location) -> tuple[int, int]:
        """Where ``loc`` sorts among addresses with the same text before its fragment."""
        return (-2, 0)

    def freshness_paths(self, address: str, layout: tuple[bool, tuple[str, ...]]
                        ) -> list[str] | None:
        """The paths whose change means the saved description of ``address`` may be wrong
        (``layout``: has its own type map, its set names); ``None``: always described again."""
        return None

    def list_folder(self, path: str) -> Listing:
        """(file names, folder names, folders that are links) of a folder a walk visits
        (formats that :attr:`walks`)."""
        raise NotImplementedError(f"the {self.name} format does not walk folders")

    def walk_step(self, listing: Listing) -> tuple[bool, list[str]]:
        """(is the listed folder a system?, names of its subfolders the walk descends into)
        (formats that :attr:`walks`)."""
        raise NotImplementedError(f"the {self.name} format does not walk folders")

    # -- description and reading --------------------------------------------------------------
    @abstractmethod
    def describe(self, loc: Location, type_map: Sequence[str] | None,
                 problems: list[DataError], listing: Listing | None = None) -> SystemMeta:
        """The system's description; raise what ends the inspection, append the other problems
        to ``problems`` (``listing``: the system folder's, when discovery made one)."""

    def requirements(self, meta: SystemMeta, extra: Sequence[DataRequirementItem]
                     ) -> tuple[DataRequirementItem, ...]:
        """What a frame carries: DeePMD-kit's defaults (box, coord, numb_copy) plus ``extra``."""
        from mdloader.data.schema import default_requirements, merge_requirements

        defaults = default_requirements(meta.pbc)
        return tuple(merge_requirements(defaults, extra)) if extra else defaults

    def check_requirements(self, meta: SystemMeta,
                           requirements: Sequence[DataRequirementItem]) -> None:
        """Raise what the description already shows cannot satisfy ``requirements`` (by
        default nothing can be seen before a frame is read)."""
        return None

    @abstractmethod
    def reader(self, meta: SystemMeta, requirements: Sequence[DataRequirementItem],
               origin: str | None = None) -> FrameReader:
        """A reader of ``meta``'s frames; ``origin``: where the description came from (an index
        file), named when a read finds the data changed since."""

    # -- checks ---------------------------------------------------------------------------------
    def deep_check(self, meta: SystemMeta) -> list[str]:
        """Every problem found by reading every frame (``check --deep``): by default unreadable
        frames and NaN/inf values per key."""
        reader = self.reader(meta, ())
        found: list[str] = []
        bad: dict[str, list[int]] = {}
        for lo in range(0, meta.nframes, DEEP_CHUNK):
            fids = list(range(lo, min(meta.nframes, lo + DEEP_CHUNK)))
            try:
                frames = reader.frames(fids)
            except DataError as exc:
                found.append(str(exc))
                continue
            for fid, frame in zip(fids, frames):
                for key, value in frame.items():
                    arr = np.asarray(value) if value is not None else None
                    if arr is not None and arr.dtype.kind in "fc" and not np.isfinite(arr).all():
                        bad.setdefault(key, []).append(fid)
        for key, fids in bad.items():
            more = f" and {len(fids) - SHOWN} more" if len(fids) > SHOWN else ""
            found.append(f"NaN/inf in '{key}' of {meta.address}: {len(fids)} frame(s), frames "
                         f"{fids[:SHOWN]}{more}")
        return found

    def notes(self, meta: SystemMeta) -> list[str]:
        """Lines ``check`` prints about how the system is read (arrays read reshaped)."""
        return []

    def frame_file(self, meta: SystemMeta, key: str, fid: int) -> str | None:
        """The file (or entry) that holds ``key`` of frame ``fid``, for messages."""
        return None

    def box_blocks(self, meta: SystemMeta) -> Iterator[tuple[str | None, int, np.ndarray]]:
        """(file, first frame id, ``(n, 9)`` boxes) for every stored block of a periodic
        system, for the box check before training (by default read through :meth:`reader`)."""
        from mdloader.data.schema import DataRequirementItem

        reader = self.reader(meta, (DataRequirementItem("box", 9, must=True),))
        for lo in range(0, meta.nframes, DEEP_CHUNK):
            fids = list(range(lo, min(meta.nframes, lo + DEEP_CHUNK)))
            boxes = np.stack([np.asarray(f["box"], dtype=np.float64).reshape(9)
                              for f in reader.frames(fids)])
            yield self.frame_file(meta, "box", lo), lo, boxes

    def release(self) -> None:
        """Close every handle this process keeps open for the format (by default none)."""
        return None


def frame_ids(fids: Sequence[int], nframes: int, system: str) -> np.ndarray:
    """``fids`` as non-negative frame ids; an empty or out-of-range request is an IndexError."""
    fid_arr = np.asarray(fids, dtype=np.int64).reshape(-1)
    if fid_arr.size == 0:
        raise IndexError(f"no frame requested from system {system}")
    if fid_arr.min() < -nframes or fid_arr.max() >= nframes:
        raise IndexError(f"frame index out of range [0, {nframes}) in system {system}: "
                         f"{fid_arr.tolist()}")
    return np.where(fid_arr < 0, fid_arr + nframes, fid_arr)


def nonfinite_rows(block: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``block`` holding NaN/inf (none for integer data)."""
    if block.dtype.kind not in "fc":
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(~np.isfinite(block.reshape(len(block), -1)).all(axis=1))


#: A cell whose volume is at most this fraction of the product of its edge lengths is flat.
FLAT_CELL = 1e-10


def degenerate_boxes(boxes: np.ndarray) -> np.ndarray:
    """Indices of the ``(n, 9)`` cells that hold NaN/inf or enclose no volume (zero, or
    ``FLAT_CELL`` of their edge lengths' product): heights, inverse and minimum image of such
    a cell are NaN or undefined, and ``NaN < 2 * rcut`` is false."""
    cells = np.asarray(boxes, dtype=np.float64).reshape(-1, 3, 3)
    finite = np.isfinite(cells).all(axis=(1, 2))
    safe = np.where(finite[:, None, None], cells, 0.0)
    volume = np.abs(np.linalg.det(safe))
    edges = np.linalg.norm(safe, axis=2).prod(axis=1)
    return np.flatnonzero(~finite | ~(volume > FLAT_CELL * edges))


def matches(relpath: str, patterns: Sequence[str] | None) -> bool:
    """Whether ``relpath`` (below a root) matches one of ``patterns`` at any depth, like
    ``pathlib.Path.rglob`` (all paths match when there is no pattern)."""
    if not patterns:
        return True
    rel = PurePosixPath(relpath.replace(os.sep, "/"))
    return any(rel.match(p) for p in patterns)


# -- the registry ---------------------------------------------------------------------------
#: The built-in formats, imported on first use; asked in this order, after registered ones.
BUILTIN = {"lmdb": "mdloader.data.formats.lmdb.backend",
           "hdf5": "mdloader.data.formats.hdf5",
           "npy": "mdloader.data.formats.npy"}

_REGISTRY: dict[str, Backend] = {}
_ORDER: list[Backend] = []  # asked first to last: registered formats newest first, built-ins
_LOCK = threading.RLock()  # importing a built-in may look one up
_loaded = False


def register_backend(name: str, backend: Backend) -> Backend:
    """Make ``backend`` the format called ``name``; it is asked before those registered earlier
    and before the built-ins, so it may claim addresses they would take (a ``.npz`` file)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"a storage backend must be a {Backend.__qualname__}, got "
                        f"{type(backend).__name__}")
    _load_builtins()
    with _LOCK:
        backend.name = name
        old = _REGISTRY.pop(name, None)
        if old is not None:
            _ORDER.remove(old)
        _REGISTRY[name] = backend
        _ORDER.insert(0, backend)
    return backend


def unregister_backend(name: str) -> None:
    """Forget the format ``name`` (a test's toy format); unknown names are ignored."""
    with _LOCK:
        backend = _REGISTRY.pop(name, None)
        if backend is not None:
            _ORDER.remove(backend)


def backends() -> list[Backend]:
    """Every registered backend, in the order addresses are offered to them."""
    _load_builtins()
    return list(_ORDER)


def walking_backend() -> Backend:
    """The format whose systems are folders found by walking a ``systems`` entry (npy)."""
    for backend in backends():
        if backend.walks:
            return backend
    raise UnknownFormatError("no registered storage format walks folders for systems")


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``."""
    _load_builtins()
    found = _REGISTRY.get(name)
    if found is None:
        raise UnknownFormatError(f"no storage format is registered as {name!r} (known: "
                                 f"{sorted(_REGISTRY)})")
    return found


def parse_address(address: str) -> Location:
    """Split ``file.h5#/grp`` or ``db.lmdb#natoms=6`` and decide the format without touching
    the file system: the first backend whose :meth:`Backend.parse` recognises it.

    With the built-ins, a fragment ``system=S,natoms=N`` or ``natoms=N`` names an LMDB group,
    any other fragment an HDF5 group; a plain path is an HDF5 file when it ends in ``.h5``/
    ``.hdf5``/``.hdf``, a whole LMDB database when it ends in ``.lmdb``, else a directory.
    """
    text = os.fspath(address)
    for backend in backends():
        loc = backend.parse(text)
        if loc is not None:
            return loc
    raise UnknownFormatError("no storage format recognises the address", system=text,
                             file=text.partition("#")[0] or text,
                             expected=f"an address of one of {sorted(_REGISTRY)}")


def backend_of(address: str | os.PathLike[str] | Location) -> Backend:
    """The backend of a system address (or of an already parsed location)."""
    loc = address if isinstance(address, Location) else parse_address(address)
    _load_builtins()
    found = _REGISTRY.get(loc.backend)
    if found is None:
        raise UnknownFormatError(f"the address is of the storage format {loc.backend!r}, which "
                                 "is not registered in this process", system=loc.address,
                                 file=loc.path, expected=f"one of {sorted(_REGISTRY)}")
    return found


def locate_entry(path: str) -> Location:
    """Where a ``systems`` entry points: its parsed address, except that a plain path is offered
    to every backend's :meth:`Backend.claim` (the file system may say more than the text)."""
    loc = parse_address(path)
    if "#" in path:
        return loc
    for backend in backends():
        claimed = backend.claim(path)
        if claimed is not None:
            return claimed
    return loc


def address_sort_key(address: str) -> tuple[str, tuple[int, int]]:
    """Sort key of addresses: text order, except that a backend may order the systems of one
    file by their fragment (LMDB groups by system id and atom count, as numbers)."""
    path, sep, _ = address.partition("#")
    if sep:
        loc = parse_address(address)
        key = backend_of(loc).sort_key(loc)
        if key != (-2, 0):
            return path + sep, key
    return address, (-2, 0)


def release_handles() -> None:
    """Close every memory map, HDF5 file and database this process keeps open.

    The next read reopens them, and opening checks a file again (an npy file shorter than its
    header is an error there, where a map kept open over a shrunk file raises SIGBUS).
    """
    for backend in backends():
        backend.release()


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    with _LOCK:
        if _loaded:
            return
        for name, module in BUILTIN.items():
            backend = importlib.import_module(module).BACKEND
            backend.name = name
            _REGISTRY.setdefault(name, backend)
            _ORDER.append(backend)
        _loaded = True
