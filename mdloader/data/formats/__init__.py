"""Storage backends for one DeePMD layout: npy directories and HDF5 groups.

A system *address* is a directory path, or ``file.h5#/group`` (``file.h5`` alone or
``file.h5#/`` for a system at the file root). Both backends expose the same small set of
functions, so everything above this package is written once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Location:
    """A parsed system address."""

    backend: str  # "npy" or "hdf5"
    path: str  # the directory, or the HDF5 file
    group: str  # "" for npy; "/" or "/a/b" inside an HDF5 file

    @property
    def address(self) -> str:
        return self.path if self.backend == "npy" else f"{self.path}#{self.group}"


def parse_address(address: str) -> Location:
    """Split ``file.h5#/grp`` and decide the backend without touching the file system.

    A plain path is an HDF5 file when it names a file ending in ``.h5``/``.hdf5``/``.hdf``;
    otherwise a directory. (``#`` cannot appear in a directory name used as a system.)
    """
    text = os.fspath(address)
    if "#" in text:
        path, group = text.split("#", 1)
        group = "/" + group.strip("/")
        return Location("hdf5", path, group)
    if text.lower().endswith((".h5", ".hdf5", ".hdf")):
        return Location("hdf5", text, "/")
    return Location("npy", text.rstrip("/") or "/", "")


def backend_of(loc: Location) -> ModuleType:
    """The module implementing ``loc``'s storage (imported lazily: h5py only when needed)."""
    if loc.backend == "npy":
        from mdloader.data.formats import npy

        return npy
    from mdloader.data.formats import hdf5

    return hdf5
