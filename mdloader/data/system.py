"""The compact description of one system, built from headers only.

:class:`SystemMeta` is what rank 0 broadcasts: an address, the atom types, the type map and,
per set, the frame count and the keys present with their per-frame widths. No frame data. With
it every rank can read any frame later, and every check that does not need frame values has
already been made on rank 0, so nothing is left to fail hours into training inside a worker.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mdloader.data.formats.base import Listing, Location
from mdloader.data.formats.registry import backend_of, parse_address
from mdloader.errors import DataError

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
    """

    address: str
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
        """The parsed address, computed once (every frame read needs it)."""
        return parse_address(self.address)

    @property
    def backend(self) -> str:
        """The name of its storage format (:func:`mdloader.data.formats.backend_of` gives the
        format itself)."""
        return self.location.backend

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
        return (_restore, (interned(self.address[:cut]), self.address[cut:], types, self.type_map,
                           flags, self.sets, self.mixed_idx_map))


def restore_set(name: str, nframes: int, keys: tuple[str, ...],
                widths: tuple[int, ...]) -> SetMeta:
    """A :class:`SetMeta` rebuilt from its saved fields, interned like a freshly described one."""
    return interned(SetMeta(interned(name), nframes, interned(keys), interned(widths)))


def _restore(folder: str, name: str, types: bytes, tmap: tuple[str, ...] | None, flags: int,
             sets: tuple[SetMeta, ...], mixed_idx_map: tuple[int, ...] | None) -> SystemMeta:
    atom_types = np.frombuffer(types, dtype=np.int16 if flags & 4 else np.int8).astype(np.int32)
    atom_types.flags.writeable = False
    return SystemMeta(
        address=folder + name, atom_types=atom_types, type_map=interned(tmap),
        pbc=bool(flags & 1), mixed_type=bool(flags & 2), sets=interned(tuple(sets)),
        mixed_idx_map=mixed_idx_map,
    )


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
