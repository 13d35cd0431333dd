"""The registry of storage formats: which backend an address or a ``systems`` entry is of.

Formats a user registers are asked first, newest first, then the built-ins, which are imported
on the first look-up, by module name, as a plugin would be.
"""

from __future__ import annotations

import importlib
import os
import threading

from mdloader.data.formats.base import Backend, Location
from mdloader.data.formats.capabilities import FolderWalk, forget, has, partly_implemented
from mdloader.errors import UnknownFormatError

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
    partial = partly_implemented(backend)
    if partial:
        raise TypeError(f"the storage backend {name!r} implements only part of "
                        f"{'; '.join(partial)}: implement all of a capability's methods, or "
                        "none (then the defaults apply)")
    _load_builtins()
    with _LOCK:
        backend.name = name
        old = _REGISTRY.pop(name, None)
        if old is not None:
            _ORDER.remove(old)
            forget(old)
        _REGISTRY[name] = backend
        _ORDER.insert(0, backend)
    return backend


def unregister_backend(name: str) -> None:
    """Forget the format ``name`` (a test's toy format); unknown names are ignored."""
    with _LOCK:
        backend = _REGISTRY.pop(name, None)
        if backend is not None:
            _ORDER.remove(backend)
            forget(backend)


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
    """Close every npy file, HDF5 file and database this process keeps open.

    The next read reopens them, and opening checks a file again (an npy file shorter than its
    header, or replaced by one with other frames, is an error there).
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


def folder_walk() -> FolderWalk:
    """The registered format whose systems are folders found by walking (npy)."""
    for backend in backends():
        if has(backend, FolderWalk):
            return backend  # type: ignore[return-value]
    raise UnknownFormatError("no registered storage format walks folders for systems")
