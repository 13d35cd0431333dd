"""The LMDB format behind :class:`~mdloader.data.formats.base.Backend`: DeePMD-kit 3.2's
databases, each a ``systems`` entry that expands into its groups of frames.

A group is described from the database's metadata (:mod:`~mdloader.data.formats.lmdb.groups`)
and read record by record (:mod:`~mdloader.data.formats.lmdb.reader`). Its records carry their
own box, so periodicity is known per frame, and its description is made again at every start
(reading the metadata costs less than a saved index would save).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from mdloader.data.formats.base import (
    Backend,
    FrameReader,
    Listing,
    Location,
    SystemMeta,
    frame_ids,
)
from mdloader.data.formats.lmdb.address import LMDB_GROUP, lmdb_group_of
from mdloader.data.formats.lmdb.check import check_group
from mdloader.data.formats.lmdb.environment import entry_of, frame_key
from mdloader.data.formats.lmdb.fields import check_requirements
from mdloader.data.formats.lmdb.groups import describe_group, group_addresses
from mdloader.data.formats.lmdb.reader import LmdbGroupReader
from mdloader.data.schema import DataRequirementItem
from mdloader.errors import DataError


class CheckedGroupReader(LmdbGroupReader, FrameReader):
    """:class:`LmdbGroupReader` taking frame ids as given (negative ones count from the end)."""

    def frames(self, positions: Sequence[int]) -> list[dict[str, Any]]:
        return super().frames(frame_ids(positions, self.runs.nframes, self.address))

    def batch(self, positions: Sequence[int]) -> dict[str, Any]:
        return super().batch(frame_ids(positions, self.runs.nframes, self.address))

    def fids(self, positions: Sequence[int]) -> list[int]:
        """The database frame indices of the group's positions."""
        return self.keys(frame_ids(positions, self.runs.nframes, self.address)).tolist()


class LmdbBackend(Backend):
    """Groups of frames (one atom count, one source system) in an LMDB database; a database
    expands into its groups (:class:`~mdloader.data.formats.capabilities.EntryExpansion`) and
    checks its frames itself (:class:`~mdloader.data.formats.capabilities.Diagnostics`)."""

    pbc_per_frame = True
    indexable = False

    def parse(self, address: str) -> Location | None:
        path, sep, group = address.partition("#")
        if sep:
            return Location(self.name, path.rstrip("/") or "/", group) \
                if LMDB_GROUP.fullmatch(group) else None
        if address.rstrip("/").lower().endswith(".lmdb"):
            return Location(self.name, address.rstrip("/"), "")
        return None

    def claim(self, path: str) -> Location | None:
        """A path ending in ``.lmdb``, or a folder holding ``data.mdb`` named otherwise."""
        found = self.parse(path)
        if found is None and os.path.isfile(os.path.join(path, "data.mdb")):
            found = Location(self.name, os.path.normpath(os.path.abspath(path)), "")
        return found

    def expand(self, loc: Location, patterns: Sequence[str] | None,
               known: list[str] | None = None) -> list[str]:
        """One group's address, or every group of the database (``patterns`` do not apply)."""
        if loc.group:
            return [os.path.abspath(loc.path) + "#" + loc.group]
        return group_addresses(loc.path)

    def container(self, loc: Location) -> str | None:
        """None: reading a database's metadata again costs less than checking a saved answer."""
        return None

    def sort_key(self, loc: Location) -> tuple[int, int]:
        return lmdb_group_of(loc) if loc.group else (-2, 0)

    def describe(self, loc: Location, type_map: Sequence[str] | None,
                 problems: list[DataError], listing: Listing | None = None) -> SystemMeta:
        return describe_group(loc, type_map)

    def requirements(self, meta: SystemMeta, extra: Sequence[DataRequirementItem]
                     ) -> tuple[DataRequirementItem, ...]:
        """Only what was asked: the records carry coord and box."""
        return tuple(extra)

    def check_requirements(self, meta: SystemMeta,
                           requirements: Sequence[DataRequirementItem]) -> None:
        """What a frame holds is known when it is read: only the requirements themselves."""
        check_requirements(requirements)

    def reader(self, meta: SystemMeta, requirements: Sequence[DataRequirementItem],
               origin: str | None = None) -> CheckedGroupReader:
        return CheckedGroupReader(meta, requirements)

    def deep_check(self, meta: SystemMeta) -> list[str]:
        """Decode every frame (:func:`~mdloader.data.formats.lmdb.check.check_group`)."""
        return check_group(meta)

    def frame_file(self, meta: SystemMeta, key: str, fid: int) -> str | None:
        """The database entry of frame ``fid``: a database frame index, what a read frame
        carries as ``fid`` (a position in the group is mapped by the reader's ``fids``)."""
        return entry_of(meta.location.path, frame_key(fid, meta.sets[0].frame_format))

    def box_blocks(self, meta: SystemMeta) -> Iterator[tuple[str | None, int, Any]]:
        """None ahead of training: boxes are in the frames, checked as they are read."""
        return iter(())

    def notes(self, meta: SystemMeta) -> list[str]:
        """None: a record's arrays are read with the shapes they are stored with."""
        return []


BACKEND = LmdbBackend()
