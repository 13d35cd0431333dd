"""Addresses of the groups of an LMDB database: ``<db>#system=S,natoms=N`` (``<db>#natoms=N``
when the database records no system ids)."""

from __future__ import annotations

import re

from mdloader.data.formats.base import Location

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
