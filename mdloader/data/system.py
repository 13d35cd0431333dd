"""Describing one system at an address, from its headers only, through its storage format.

The description, :class:`~mdloader.data.formats.base.SystemMeta`, is what rank 0 broadcasts: an
address, the atom types, the type map and, per set, the frame count and the keys present with
their per-frame widths. No frame data. With it every rank can read any frame later, and every
check that does not need frame values has already been made on rank 0, so nothing is left to
fail hours into training inside a worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from mdloader.data.formats.base import Listing, SystemMeta
from mdloader.data.formats.registry import backend_of, parse_address
from mdloader.errors import DataError


def build_system_meta(address: str, type_map: Sequence[str] | None = None, *,
                      listing: Listing | None = None) -> SystemMeta:
    """Describe the system at ``address``, reading ``type.raw``, ``type_map.raw`` and headers.

    Raises the first :class:`~mdloader.errors.DataError` subclass :func:`inspect_system` finds,
    naming the system and the file (every problem that can be seen without reading frames).
    """
    meta, problems = inspect_system(address, type_map, listing=listing)
    if problems:
        raise problems[0]
    return meta  # type: ignore[return-value]


def inspect_system(address: str, type_map: Sequence[str] | None = None, *,
                   listing: Listing | None = None) -> tuple[SystemMeta | None, list[DataError]]:
    """The description of a system and *every* problem found in it (``None`` if any).

    A problem that hides the rest (no directory, no ``type.raw``, no set, an unreadable set)
    ends the inspection; the others (a missing ``box.npy``, every array whose frames or width
    disagree, the type map) are all collected, in the order the files are met.
    """
    problems: list[DataError] = []
    try:
        loc = parse_address(address)
        meta = backend_of(loc).describe(loc, type_map, problems, listing)
    except DataError as exc:
        problems.append(exc)
    return (None if problems else meta), problems
