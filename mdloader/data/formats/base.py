"""The core interface of a storage format: its addresses, a description, a frame reader.

A storage format (npy directories, HDF5 groups, groups of frames in an LMDB database, or one a
user registers) is a :class:`Backend`: it recognises its addresses, describes a system
(:class:`~mdloader.data.system.SystemMeta`), reads its frames and batches, and releases its
handles; what only some formats do (expand or walk a ``systems`` entry, name the paths a saved
description depends on, check deeply) are the optional capabilities of
:mod:`mdloader.data.formats.capabilities`. Everything above :mod:`mdloader.data.formats` asks
the backend of an address (:mod:`~mdloader.data.formats.registry`) instead of testing a
format's name, so a new format is one class and one ``register_backend`` call.

This module imports no format and not :mod:`mdloader.data.system` (only for type checking): the
description imports the registry, the formats import both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mdloader.errors import DataError

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
