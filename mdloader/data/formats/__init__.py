"""Storage formats: npy directories, HDF5 groups, and groups of frames in an LMDB database.

A system *address* is a directory path, ``file.h5#/group`` (``file.h5`` alone or ``file.h5#/``
for a system at the file root), or ``data.lmdb#system=3,natoms=6`` for the frames of source
system 3 with 6 atoms in an LMDB database (``data.lmdb#natoms=6`` when the database records no
system ids). Each format is a :class:`~mdloader.data.formats.base.Backend` found through the
registry of :mod:`mdloader.data.formats.registry`; this package re-exports the registry's
functions.
Nothing here imports a format: they load on the first look-up.
"""

from __future__ import annotations

from mdloader.data.formats.base import Backend, FrameReader, Listing, Location
from mdloader.data.formats.registry import (
    address_sort_key,
    backend_of,
    backends,
    get_backend,
    locate_entry,
    parse_address,
    register_backend,
    release_handles,
    unregister_backend,
)

__all__ = ["Backend", "FrameReader", "Listing", "Location", "address_sort_key", "backend_of",
           "backends", "get_backend", "locate_entry", "parse_address", "register_backend",
           "release_handles", "unregister_backend"]
