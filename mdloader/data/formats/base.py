"""The core interface of a storage format: its addresses, a description, a frame reader.

A storage format (npy directories, HDF5 groups, groups of frames in an LMDB database, or one a
user registers) is a :class:`Backend`: it recognises its addresses (:class:`Location`),
describes a system (:class:`SystemMeta`, with its :class:`SetMeta` entries), reads its frames
and batches, and releases its handles; what only some formats do (expand or walk a ``systems``
entry, name the paths a saved description depends on, check deeply) are the optional
capabilities of :mod:`mdloader.data.formats.capabilities`. Everything above
:mod:`mdloader.data.formats` asks the backend of an address
(:mod:`~mdloader.data.formats.registry`) instead of testing a format's name, so a new format is
one class and one ``register_backend`` call.

This module imports no format and not the registry: a description knows its format by name
(:attr:`SystemMeta.backend`), the registry imports this module, the formats import both.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mdloader.errors import DataError

if TYPE_CHECKING:
    from mdloader.data.schema import DataRequirementItem

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


_INTERNED: dict[Any, Any] = {}
_INTERNED_LIMIT = 1 << 20


def interned(value: Any) -> Any:
    """One instance per distinct value (set names, key tuples, type maps, whole sets).

    100 000 systems of a data set mostly repeat the same few ``SetMeta`` values: interning them
    cuts the memory of the descriptions, and pickle writes an interned object once per broadcast.
    """
    found = _INTERNED.get(value)
    if found is None:
        if len(_INTERNED) >= _INTERNED_LIMIT:
            _INTERNED.clear()
        found = _INTERNED[value] = value
    return found


@dataclass(frozen=True)
class SetMeta:
    """One ``set.*``: its name, frame count, and the arrays present with per-frame widths."""

    name: str
    nframes: int
    keys: tuple[str, ...]
    widths: tuple[int, ...]

    def __reduce__(self) -> tuple[Any, ...]:
        return (restore_set, (self.name, self.nframes, self.keys, self.widths))

    def width(self, key: str) -> int | None:
        try:
            return self.widths[self.keys.index(key)]
        except ValueError:
            return None


@dataclass(frozen=True, eq=False)
class SystemMeta:
    """Everything needed to read a system's frames later, and nothing heavy.

    ``atom_types`` are model type ids in ``type.raw`` order (after remapping to the model
    ``type_map``). ``mixed_idx_map`` maps a mixed-type system's own type ids to model ids, with a
    trailing ``-1`` so that virtual atoms stay ``-1``. A group of an LMDB database is described
    by the same fields: zeros as atom types (they are per frame), ``mixed_type`` set, and one
    :class:`~mdloader.data.formats.lmdb.groups.LmdbGroup` as its only set.

    ``address`` is its location's (:attr:`Location.address`) and ``backend`` the registered name
    of its format, decided once when the system is described: the location follows from the
    two without asking the registry again.
    """

    address: str
    backend: str
    atom_types: np.ndarray
    type_map: tuple[str, ...] | None
    pbc: bool
    mixed_type: bool
    sets: tuple[SetMeta, ...]
    mixed_idx_map: tuple[int, ...] | None = None

    @property
    def natoms(self) -> int:
        return int(self.atom_types.shape[0])

    @property
    def nframes(self) -> int:
        return sum(s.nframes for s in self.sets)

    @property
    def ntypes(self) -> int:
        if self.type_map is not None:
            return len(self.type_map)
        return int(self.atom_types.max()) + 1

    @functools.cached_property
    def location(self) -> Location:
        """The address split into its path and the part inside, computed once (every frame read
        needs it)."""
        path, _, group = self.address.partition("#")
        return Location(self.backend, path, group)

    def natoms_vec(self) -> np.ndarray:
        """``[N, N, count of type 0, ..., count of type T-1]`` as DeePMD-kit's ``natoms``."""
        counts = np.bincount(self.atom_types, minlength=self.ntypes)[: self.ntypes]
        return np.concatenate([[self.natoms, self.natoms], counts]).astype(np.int32)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SystemMeta) and self.__reduce__()[1] == other.__reduce__()[1]

    def __hash__(self) -> int:
        return hash(self.address)

    def __reduce__(self) -> tuple[Any, ...]:
        # Builtins plus interned sets: ~1 byte per atom plus the address, because the set
        # descriptions and the type map are interned objects that pickle writes once per stream.
        small = self.atom_types.max(initial=0) < 127
        types = self.atom_types.astype(np.int8 if small else np.int16).tobytes()
        flags = int(self.pbc) | int(self.mixed_type) << 1 | int(not small) << 2
        # the folder (or the LMDB database) is interned across siblings: pickle writes it once
        cut = max(self.address.rfind("/"), self.address.rfind("#")) + 1
        return (_restore, (interned(self.backend), interned(self.address[:cut]),
                           self.address[cut:], types, self.type_map, flags, self.sets,
                           self.mixed_idx_map))


def restore_set(name: str, nframes: int, keys: tuple[str, ...],
                widths: tuple[int, ...]) -> SetMeta:
    """A :class:`SetMeta` rebuilt from its saved fields, interned like a freshly described one."""
    return interned(SetMeta(interned(name), nframes, interned(keys), interned(widths)))


def _restore(backend: str, folder: str, name: str, types: bytes, tmap: tuple[str, ...] | None,
             flags: int, sets: tuple[SetMeta, ...], mixed_idx_map: tuple[int, ...] | None
             ) -> SystemMeta:
    atom_types = np.frombuffer(types, dtype=np.int16 if flags & 4 else np.int8).astype(np.int32)
    atom_types.flags.writeable = False
    return SystemMeta(
        address=folder + name, backend=backend, atom_types=atom_types, type_map=interned(tmap),
        pbc=bool(flags & 1), mixed_type=bool(flags & 2), sets=interned(tuple(sets)),
        mixed_idx_map=mixed_idx_map,
    )


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
