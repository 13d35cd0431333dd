"""Storage backends: npy directories, HDF5 groups, and groups of frames in an LMDB database.

A system *address* is a directory path, ``file.h5#/group`` (``file.h5`` alone or ``file.h5#/``
for a system at the file root), or ``data.lmdb#system=3,natoms=6`` for the frames of source
system 3 with 6 atoms in an LMDB database (``data.lmdb#natoms=6`` when the database records no
system ids). npy and HDF5 expose the same small set of functions, so everything above this
package is written once; an LMDB group is read frame by frame
(:mod:`mdloader.data.formats.lmdb.frames`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import ModuleType

#: The fragment naming one group of an LMDB database (any other fragment is an HDF5 group).
LMDB_GROUP = re.compile(r"(?:system=(\d+),)?natoms=(\d+)")

#: One directory's listing: (file names, directory names, directory names that are symbolic
#: links), each sorted. Discovery makes it; the build reuses it instead of listing again.
Listing = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


@dataclass(frozen=True)
class Location:
    """A parsed system address."""

    backend: str  # "npy", "hdf5" or "lmdb"
    path: str  # the directory, the HDF5 file, or the LMDB database (a directory)
    group: str  # "" for npy; "/" or "/a/b" inside an HDF5 file; "system=3,natoms=6" or ""

    @property
    def address(self) -> str:
        return f"{self.path}#{self.group}" if self.group else self.path


def parse_address(address: str) -> Location:
    """Split ``file.h5#/grp`` or ``db.lmdb#natoms=6`` and decide the backend without touching the
    file system.

    A fragment of the form ``system=S,natoms=N`` or ``natoms=N`` names an LMDB group, any other
    fragment an HDF5 group. A plain path is an HDF5 file when it ends in ``.h5``/``.hdf5``/
    ``.hdf``, a whole LMDB database when it ends in ``.lmdb`` (group ``""``); otherwise a
    directory. (``#`` cannot appear in a directory name used as a system.)
    """
    text = os.fspath(address)
    if "#" in text:
        path, group = text.split("#", 1)
        if LMDB_GROUP.fullmatch(group):
            return Location("lmdb", path.rstrip("/") or "/", group)
        group = "/" + group.strip("/")
        return Location("hdf5", path, group)
    if text.lower().endswith((".h5", ".hdf5", ".hdf")):
        return Location("hdf5", text, "/")
    if text.rstrip("/").lower().endswith(".lmdb"):
        return Location("lmdb", text.rstrip("/"), "")
    return Location("npy", text.rstrip("/") or "/", "")


def lmdb_group_of(loc: Location) -> tuple[int, int]:
    """(system id, atoms) of an LMDB group; system id -1 when the database records none."""
    match = LMDB_GROUP.fullmatch(loc.group)
    if match is None:
        raise ValueError(f"{loc.address} does not name a group of an LMDB database")
    sid, natoms = match.groups()
    return (-1 if sid is None else int(sid)), int(natoms)


def address_sort_key(address: str) -> tuple[str, tuple[int, int]]:
    """Sort key of addresses: text order, except that the groups of one LMDB database follow
    their system ids and atom counts as numbers (``system=10`` after ``system=9``)."""
    path, sep, group = address.partition("#")
    if sep and LMDB_GROUP.fullmatch(group):
        return path + sep, lmdb_group_of(Location("lmdb", path, group))
    return address, (-2, 0)


def backend_of(loc: Location) -> ModuleType:
    """The module implementing ``loc``'s storage (imported lazily: h5py only when needed)."""
    if loc.backend == "npy":
        from mdloader.data.formats import npy

        return npy
    if loc.backend == "lmdb":
        from mdloader.data.formats.lmdb import env as lmdb

        return lmdb
    from mdloader.data.formats import hdf5

    return hdf5


def release_handles() -> None:
    """Close every memory map and HDF5 file this process keeps open.

    The next read reopens them, and opening checks a file again (an npy file shorter than its
    header is an error there, where a map kept open over a shrunk file raises SIGBUS).
    """
    from mdloader.data.formats import hdf5, npy

    npy.release()
    hdf5.release()
