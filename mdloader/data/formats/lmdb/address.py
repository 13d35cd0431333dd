"""Addresses of the groups of an LMDB database: ``<db>#system=S,natoms=N`` (``<db>#natoms=N``
when the database records no system ids); which path names a database, and the one database a
``mix:N`` section reads (checks that need neither torch nor the database's contents)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from mdloader.data.formats.base import Location
from mdloader.errors import ConfigError

#: The fragment naming one group of an LMDB database (any other fragment is an HDF5 group).
LMDB_GROUP = re.compile(r"(?:system=(\d+),)?natoms=(\d+)")


def lmdb_group_of(loc: Location) -> tuple[int, int]:
    """(system id, atoms) of an LMDB group; system id -1 when the database records none."""
    match = LMDB_GROUP.fullmatch(loc.group)
    if match is None:
        raise ValueError(f"{loc.address} does not name a group of an LMDB database")
    sid, natoms = match.groups()
    return (-1 if sid is None else int(sid)), int(natoms)


def group_address(path: str, sid: int, natoms: int) -> str:
    """``<db>#system=S,natoms=N`` (``<db>#natoms=N`` when the database has no system ids)."""
    head = f"system={sid}," if sid >= 0 else ""
    return f"{path}#{head}natoms={natoms}"


def is_lmdb(systems: str) -> bool:
    """Whether ``systems`` names an LMDB database (``*.lmdb``, or a folder with data.mdb)."""
    return systems.endswith(".lmdb") or os.path.isfile(os.path.join(systems, "data.mdb"))


def mixed_database(systems: Sequence[str], key: str) -> str:
    """The one LMDB database a ``mix:N`` section reads (``key``: its ``batch_size`` path)."""
    if len(systems) != 1 or not is_lmdb(str(systems[0])):
        raise ConfigError(f"mix:N batches frames of different atom counts from one LMDB "
                          f"database (DeePMD-kit 3.2's rule); these systems are "
                          f"{', '.join(map(str, systems)) or 'none'}: a batch of npy or HDF5 "
                          "data comes from one system, use a fixed batch size or 'auto:N' "
                          "there, or write the systems into one database with mdloader pack",
                          path=key)
    return str(systems[0])
