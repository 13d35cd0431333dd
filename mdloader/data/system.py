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

from mdloader.data.formats import Listing, Location, backend_of, parse_address
from mdloader.data.layout import frames_and_width, known_width
from mdloader.errors import DataError, MissingDataError, ShapeError, TypeMapError

_SHARED: dict[Any, Any] = {}
_SHARED_LIMIT = 1 << 20


def shared(value: Any) -> Any:
    """One instance per distinct value (set names, key tuples, type maps, whole sets).

    100 000 systems of a data set mostly repeat the same few ``SetMeta`` values: sharing them
    cuts the memory of the descriptions, and pickle writes a shared object once per broadcast.
    """
    found = _SHARED.get(value)
    if found is None:
        if len(_SHARED) >= _SHARED_LIMIT:
            _SHARED.clear()
        found = _SHARED[value] = value
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
        # Builtins plus shared sets: ~1 byte per atom plus the address, because the set
        # descriptions and the type map are shared objects that pickle writes once per stream.
        small = self.atom_types.max(initial=0) < 127
        types = self.atom_types.astype(np.int8 if small else np.int16).tobytes()
        flags = int(self.pbc) | int(self.mixed_type) << 1 | int(not small) << 2
        # the folder (or the LMDB database) is shared by siblings: pickle writes it once
        cut = max(self.address.rfind("/"), self.address.rfind("#")) + 1
        return (_restore, (shared(self.address[:cut]), self.address[cut:], types, self.type_map,
                           flags, self.sets, self.mixed_idx_map))


def restore_set(name: str, nframes: int, keys: tuple[str, ...],
                widths: tuple[int, ...]) -> SetMeta:
    return shared(SetMeta(shared(name), nframes, shared(keys), shared(widths)))


def _restore(folder: str, name: str, types: bytes, tmap: tuple[str, ...] | None, flags: int,
             sets: tuple[SetMeta, ...], mixed_idx_map: tuple[int, ...] | None) -> SystemMeta:
    atom_types = np.frombuffer(types, dtype=np.int16 if flags & 4 else np.int8).astype(np.int32)
    atom_types.flags.writeable = False
    return SystemMeta(
        address=folder + name, atom_types=atom_types, type_map=shared(tmap),
        pbc=bool(flags & 1), mixed_type=bool(flags & 2), sets=shared(tuple(sets)),
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
        meta = _describe_system(address, type_map, problems, listing)
    except DataError as exc:
        problems.append(exc)
    return (None if problems else meta), problems


def _describe_system(address: str, type_map: Sequence[str] | None, problems: list[DataError],
                     listing: Listing | None = None) -> SystemMeta:
    """Raise what ends the inspection, append to ``problems`` what does not."""
    loc = parse_address(address)
    if loc.backend == "lmdb":  # a group of frames in a database: described from its metadata
        from mdloader.data.formats.lmdb.groups import describe_group

        return describe_group(loc, type_map)
    io = backend_of(loc)
    pbc, set_names = io.scan_system(loc, listing) if listing else io.scan_system(loc)
    types = io.read_type_raw(loc)
    if types.size == 0:
        raise DataError("the system has no atoms (type.raw is empty)", system=loc.address,
                        file=io.file_of(loc, None, "type.raw"))
    if not set_names:
        raise MissingDataError("no set.* is found in the system", system=loc.address,
                               file=io.file_of(loc, None, "set.*"))
    described = [_describe_set(loc, io, name, len(types), pbc, problems) for name in set_names]
    sets = tuple(s for s in described if s is not None)
    mixed = _collect(problems, _mixed_flag, loc, io, sets) if sets else False
    if not problems and sum(s.nframes for s in sets) == 0:
        problems.append(DataError("the system has no frames", system=loc.address,
                                  file=io.file_of(loc, sets[0].name, "coord.npy"),
                                  expected=">= 1 frame", found="0 frames"))
    sys_map = io.read_type_map(loc, listing) if listing else io.read_type_map(loc)
    resolved = _collect(problems, _resolve_types, loc, io, types, sys_map, type_map,
                        mixed) or (types, None, None)
    atom_types, final_map, idx_map = resolved
    atom_types = atom_types.astype(np.int32)
    atom_types.flags.writeable = False
    return SystemMeta(address=loc.address, atom_types=atom_types, type_map=shared(final_map),
                      pbc=pbc, mixed_type=bool(mixed), sets=shared(sets), mixed_idx_map=idx_map)


def _collect(problems: list[DataError], check: Any, *args: Any) -> Any:
    """``check(*args)``, or ``None`` with its DataError appended to ``problems``."""
    try:
        return check(*args)
    except DataError as exc:
        problems.append(exc)
        return None


def _describe_set(loc: Location, io: Any, name: str, natoms: int, pbc: bool,
                  problems: list[DataError]) -> SetMeta | None:
    """The set's description, or ``None`` when its frames cannot be known (no coord.npy);
    its problems go to ``problems``."""
    shapes = io.set_shapes(loc, name)
    if "coord" not in shapes:
        problems.append(MissingDataError("the set has no coord.npy", system=loc.address,
                                         file=io.file_of(loc, name, "coord.npy")))
    if pbc and "box" not in shapes:
        problems.append(MissingDataError(
            "a periodic system needs box.npy in every set (add an empty 'nopbc' file "
            "to the system if it is not periodic)",
            system=loc.address, file=io.file_of(loc, name, "box.npy")))
    if "coord" not in shapes:
        return None
    nframes, _ = frames_and_width(shapes["coord"], None)
    widths = {}
    for key, shape in shapes.items():
        width, problem = _array_width(loc, io, name, key, shape, nframes, natoms)
        if problem is None:
            widths[key] = width
        else:
            problems.append(problem)
    return restore_set(name, nframes, tuple(widths), tuple(widths.values()))


def _array_width(loc: Location, io: Any, set_name: str, key: str, shape: tuple[int, ...],
                 nframes: int, natoms: int) -> tuple[int, ShapeError | None]:
    """Values per frame of ``key.npy``, or what is wrong with it: its frame count, or a width
    that the format fixes and it does not have."""
    where = {"system": loc.address, "file": io.file_of(loc, set_name, key + ".npy")}
    frames, width = frames_and_width(shape, nframes)
    if frames != nframes:
        return width, ShapeError(
            f"frame counts disagree within {set_name}: coord.npy has {nframes} frames",
            expected=f"{nframes} frames", found=f"{frames} frames (shape {shape})", **where)
    fixed = known_width(key, natoms)
    if fixed is None or fixed[0] == width:
        return width, None
    return width, ShapeError(f"per-frame width of {key}.npy does not match the system",
                             expected=f"{fixed[0]} values per frame ({fixed[1]})",
                             found=f"{width} (shape {shape})", **where)


def _mixed_flag(loc: Location, io: Any, sets: tuple[SetMeta, ...]) -> bool:
    flags = {s.name: "real_atom_types" in s.keys for s in sets}
    if len(set(flags.values())) > 1:
        mixed = sorted(n for n, f in flags.items() if f)
        plain = sorted(n for n, f in flags.items() if not f)
        raise DataError("either every set of a system is mixed type (real_atom_types.npy) "
                        "or none is", system=loc.address,
                        file=io.file_of(loc, plain[0], "real_atom_types.npy"),
                        found=f"mixed: {mixed}; not mixed: {plain}")
    return next(iter(flags.values()))


def _resolve_types(
    loc: Location, io: Any, types: np.ndarray, sys_map: list[str] | None,
    model_map: Sequence[str] | None, mixed: bool,
) -> tuple[np.ndarray, tuple[str, ...] | None, tuple[int, ...] | None]:
    """DeePMD-kit's type-map rules (``DeepmdData.__init__``), with errors instead of asserts."""
    type_file = io.file_of(loc, None, "type.raw")
    if types.min() < 0:
        raise TypeMapError("type.raw holds a negative type id", system=loc.address,
                           file=type_file, expected="ids >= 0", found=int(types.min()))
    if sys_map is not None and types.max() >= len(sys_map):
        raise TypeMapError("type.raw holds a type id outside type_map.raw", system=loc.address,
                           file=type_file, expected=f"ids < {len(sys_map)} ({' '.join(sys_map)})",
                           found=f"id {int(types.max())}")
    model = list(model_map) if model_map is not None else None
    if model and sys_map is not None:
        missing = [e for e in sys_map if e not in model]
        if missing:
            raise TypeMapError(f"Elements {missing} are not present in the provided type_map.",
                               system=loc.address, file=io.file_of(loc, None, "type_map.raw"),
                               expected=f"elements within {model}", found=sys_map)
        order = [model.index(name) for name in sys_map]
        if mixed:
            return types, tuple(model), tuple(order) + (-1,)
        return np.asarray(order, dtype=np.int64)[types], tuple(model), None
    if mixed and model is None and sys_map is None:
        raise DataError("a mixed-type system needs type_map.raw or a model type_map",
                        system=loc.address, file=io.file_of(loc, None, "type_map.raw"))
    if model and sys_map is None and not mixed and types.max() >= len(model):
        raise TypeMapError("type.raw holds a type id outside the model type_map",
                           system=loc.address, file=type_file,
                           expected=f"ids < {len(model)} ({' '.join(model)})",
                           found=f"id {int(types.max())}")
    return types, None if sys_map is None else tuple(sys_map), None
