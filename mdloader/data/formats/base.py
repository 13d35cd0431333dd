"""One storage format behind one interface, and the registry that finds a system's format.

A storage format (npy directories, HDF5 groups, groups of frames in an LMDB database, or one a
user registers) is a :class:`Backend`: it recognises its addresses, describes a system
(:class:`~mdloader.data.system.SystemMeta`), reads its frames and batches, and releases its
handles; what only some formats do (expand or walk a ``systems`` entry, name the paths a saved
description depends on, check deeply) are the optional capabilities of
:mod:`mdloader.data.formats.capabilities`. Everything above :mod:`mdloader.data.formats` asks
the backend of an address (:func:`backend_of`) instead of testing a format's name, so a new
format is one class and one :func:`register_backend` call.

This module imports no format and not :mod:`mdloader.data.system` (only for type checking): the
description imports the registry, the formats import both. The built-in formats are imported
on the first look-up, by module name, as a plugin would be.
"""

from __future__ import annotations

import importlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mdloader.errors import DataError, UnknownFormatError

if TYPE_CHECKING:
    from mdloader.data.schema import DataRequirementItem
    from mdloader.data.system import SystemMeta

#: One directory's listing: (file names, directory names, directory names that are symbolic
#: links), each sorted. Discovery makes it; the build reuses it instead of listing again.
Listing = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]

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

    def fids(self, positions: Sequence[int]) -> list[int]:
        """The ``fid`` that the frames at ``positions`` (frame ids of the system, as
        :meth:`frames` takes them) carry: by default the positions themselves."""
        return [int(f) for f in np.asarray(positions, dtype=np.int64).reshape(-1)]


class Backend(ABC):
    """A storage format's core: its addresses, a description of a system, a reader of its
    frames, and its handles.

    What only some formats do is an optional capability
    (:mod:`mdloader.data.formats.capabilities`): a client asks ``isinstance(backend, ...)`` and
    otherwise applies its own default. The two attributes below are facts about the format's
    descriptions, not capabilities.
    """

    #: The registered name, also :attr:`Location.backend` of its addresses.
    name: str = ""
    #: Periodicity and boxes are known per frame, not from the description: ``check`` shows
    #: ``pbc ?`` and the box check before training leaves them to the reads (LMDB).
    pbc_per_frame: bool = False
    #: Descriptions may be saved in a system index; otherwise re-described at every start.
    indexable: bool = True

    # -- addresses ------------------------------------------------------------------------------
    @abstractmethod
    def parse(self, address: str) -> Location | None:
        """The address's location if its text names this format (no file-system call)."""

    def claim(self, path: str) -> Location | None:
        """The location of an existing plain path (no ``#``) given as a ``systems`` entry, if
        this format holds it: by default when its text names the format; a format may look at
        the file system (a folder holding an LMDB database, any file as HDF5)."""
        return self.parse(path)

    def sort_key(self, loc: Location) -> tuple[int, int]:
        """Where ``loc`` sorts among addresses with the same text before its fragment."""
        return (-2, 0)

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
