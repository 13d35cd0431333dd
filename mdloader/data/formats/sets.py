"""DeePMD-kit's set layout, shared by the npy and HDF5 formats: ``type.raw``, ``type_map.raw``,
``nopbc`` and ``set.*`` folders of ``key.npy`` arrays, one row per frame.

:class:`SetBackend` describes such a system from headers only, reads rows of its arrays for
batches, and checks it deeply, through the :class:`SetStorage` it holds (list a system, read
``type.raw``, the shapes of a set, rows of an array): a folder of npy files
(:mod:`~mdloader.data.formats.npy`) or a group of an HDF5 file
(:mod:`~mdloader.data.formats.hdf5`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mdloader.data.formats.base import (
    Backend,
    FrameReader,
    Listing,
    Location,
    SetMeta,
    SystemMeta,
    frame_ids,
    interned,
    restore_set,
)
from mdloader.data.formats.diagnostics import DEEP_CHUNK, SHOWN, nonfinite_rows
from mdloader.data.formats.geometry import degenerate_boxes
from mdloader.data.frames import AtomOrder, default_block, expected_widths, transform
from mdloader.data.layout import frames_and_width, known_width, stored_flat
from mdloader.data.schema import DataRequirementItem, output_key, stem_in
from mdloader.errors import (
    DataError,
    MissingDataError,
    ShapeError,
    StaleDataError,
    TypeMapError,
)
from mdloader.persist import remove_entry


@dataclass(frozen=True)
class SetStorage:
    """Where set-layout systems live (folders of npy files, groups of an HDF5 file): the
    operations the layout code asks of it, each a function of the system's location."""

    #: ``(loc, set name or None, member name)``: the path a message names for a member.
    file_of: Callable[[Location, str | None, str], str]
    #: ``(loc, listing=None)``: (periodic?, sorted set names).
    scan_system: Callable[..., tuple[bool, list[str]]]
    #: ``(loc)``: the atom types of ``type.raw``.
    read_type_raw: Callable[[Location], np.ndarray]
    #: ``(loc, listing=None)``: ``type_map.raw``'s names, ``None`` without one.
    read_type_map: Callable[..., list[str] | None]
    #: ``(loc, set name)``: shapes of every array of a set, from headers only.
    set_shapes: Callable[[Location, str], dict[str, tuple[int, ...]]]
    #: ``(loc, set name, stem, rows, set frames, width=None)``: rows of ``stem.npy`` as a
    #: ``(len(rows), width)`` array; a file changed since the description is a StaleDataError.
    read_rows: Callable[..., np.ndarray]


class SetBackend(Backend):
    """A format storing DeePMD-kit's set layout in ``storage``; it checks its systems itself
    (:class:`~mdloader.data.formats.capabilities.Diagnostics`)."""

    def __init__(self, storage: SetStorage) -> None:
        self.storage = storage

    # -- the core -------------------------------------------------------------------------------
    def describe(self, loc: Location, type_map: Sequence[str] | None,
                 problems: list[DataError], listing: Listing | None = None) -> SystemMeta:
        storage = self.storage
        pbc, set_names = storage.scan_system(loc, listing) if listing else storage.scan_system(loc)
        types = self.storage.read_type_raw(loc)
        if types.size == 0:
            raise DataError("the system has no atoms (type.raw is empty)", system=loc.address,
                            file=self.storage.file_of(loc, None, "type.raw"))
        if not set_names:
            raise MissingDataError("no set.* is found in the system", system=loc.address,
                                   file=self.storage.file_of(loc, None, "set.*"))
        described = [self._describe_set(loc, name, len(types), pbc, problems)
                     for name in set_names]
        sets = tuple(s for s in described if s is not None)
        mixed = _collect(problems, self._mixed_flag, loc, sets) if sets else False
        if not problems and sum(s.nframes for s in sets) == 0:
            problems.append(DataError("the system has no frames", system=loc.address,
                                      file=self.storage.file_of(loc, sets[0].name, "coord.npy"),
                                      expected=">= 1 frame", found="0 frames"))
        sys_map = storage.read_type_map(loc, listing) if listing else storage.read_type_map(loc)
        resolved = _collect(problems, self._resolve_types, loc, types, sys_map, type_map,
                            mixed) or (types, None, None)
        atom_types, final_map, idx_map = resolved
        atom_types = atom_types.astype(np.int32)
        atom_types.flags.writeable = False
        return SystemMeta(address=loc.address, backend=loc.backend, atom_types=atom_types,
                          type_map=interned(final_map), pbc=pbc, mixed_type=bool(mixed),
                          sets=interned(sets), mixed_idx_map=idx_map)

    def check_requirements(self, meta: SystemMeta,
                           requirements: Sequence[DataRequirementItem]) -> None:
        """Every requirement against the widths in the headers, before any frame is read."""
        for req in requirements:
            accepted = expected_widths(req, meta.atom_types)
            for s in meta.sets:
                stem = stem_in(s.keys, req.key)
                if stem is None:
                    if req.must:
                        raise MissingDataError(f"a required key is missing: {req.key}",
                                               system=meta.address,
                                               file=self.storage.file_of(meta.location, s.name,
                                                                 req.key + ".npy"))
                    continue
                width = s.width(stem)
                if width not in accepted:
                    raise ShapeError(f"per-frame width of {stem}.npy does not match the "
                                     "requirement", system=meta.address,
                                     file=self.storage.file_of(meta.location, s.name,
                                                               stem + ".npy"),
                                     expected=" or ".join(str(w) for w in accepted),
                                     found=width)

    def reader(self, meta: SystemMeta, requirements: Sequence[DataRequirementItem],
               origin: str | None = None) -> SetReader:
        return SetReader(self.storage, meta, tuple(requirements), origin)

    # -- diagnostics ----------------------------------------------------------------------------
    def deep_check(self, meta: SystemMeta) -> list[str]:
        """Read every array of every set; report NaN/inf frames and unreadable or short data."""
        loc = meta.location
        found: list[str] = []
        start = 0
        for s in meta.sets:
            for key in s.keys:
                where = self.storage.file_of(loc, s.name, key + ".npy")
                try:
                    bad, flat = self._bad_frames(loc, s.name, key, s.nframes,
                                                 cells=meta.pbc and key == "box")
                except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file
                    found.append(f"cannot read {s.nframes} frames from {where}: "
                                 f"{type(exc).__name__}: {exc}")
                    continue
                for what, frames in (("NaN/inf", bad), ("a box of volume 0 (degenerate "
                                                         "cell)", flat)):
                    if len(frames):
                        shown = ", ".join(str(start + int(f)) for f in frames[:SHOWN])
                        more = (f" and {len(frames) - SHOWN} more" if len(frames) > SHOWN
                                else "")
                        found.append(f"{what} in {where}: {len(frames)} frame(s), system frame "
                                     f"ids {shown}{more}")
            start += s.nframes
        return found

    def _bad_frames(self, loc: Location, set_name: str, key: str, nframes: int,
                    cells: bool) -> tuple[np.ndarray, np.ndarray]:
        """(rows holding NaN/inf, finite rows that are degenerate cells when ``cells``)."""
        bad, flat = [], []
        for lo in range(0, nframes, DEEP_CHUNK):
            rows = np.arange(lo, min(nframes, lo + DEEP_CHUNK))
            block = self.storage.read_rows(loc, set_name, key, rows, nframes)
            if block.shape[0] != len(rows):
                raise ValueError(f"got {block.shape[0]} rows, expected {len(rows)}")
            nonfinite = nonfinite_rows(block)
            bad.append(rows[nonfinite])
            if cells:
                flat.append(rows[np.setdiff1d(degenerate_boxes(block), nonfinite)])
        empty = np.empty(0, dtype=np.int64)
        return (np.concatenate(bad) if bad else empty, np.concatenate(flat) if flat else empty)

    def notes(self, meta: SystemMeta) -> list[str]:
        """One line per array stored flat, read reshaped as DeePMD-kit's whole-set reader does."""
        loc = meta.location
        notes = []
        for s in meta.sets:
            for key, shape in self.storage.set_shapes(loc, s.name).items():
                if stored_flat(shape, s.nframes):
                    where = self.storage.file_of(loc, s.name, key + ".npy")
                    notes.append(f"{where} of shape {shape} "
                                 f"is read as ({s.nframes}, {s.width(key)}): frames x values")
        return notes

    def frame_file(self, meta: SystemMeta, key: str, fid: int) -> str | None:
        start = 0
        for s in meta.sets:
            if fid < start + s.nframes:
                stem = stem_in(s.keys, key)
                return None if stem is None else self.storage.file_of(meta.location, s.name,
                                                              stem + ".npy")
            start += s.nframes
        return None

    def box_blocks(self, meta: SystemMeta) -> Iterator[tuple[str | None, int, np.ndarray]]:
        """Each set's ``box.npy``, whole (a few floats per frame)."""
        start = 0
        for s in meta.sets:
            rows = self.storage.read_rows(meta.location, s.name, "box", np.arange(s.nframes),
                                  s.nframes, s.width("box"))
            yield self.storage.file_of(meta.location, s.name, "box.npy"), start, rows
            start += s.nframes

    # -- description helpers ------------------------------------------------------------------
    def _describe_set(self, loc: Location, name: str, natoms: int, pbc: bool,
                      problems: list[DataError]) -> SetMeta | None:
        """The set's description, or ``None`` when its frames cannot be known (no coord.npy);
        its problems go to ``problems``."""
        shapes = self.storage.set_shapes(loc, name)
        if "coord" not in shapes:
            problems.append(MissingDataError("the set has no coord.npy", system=loc.address,
                                             file=self.storage.file_of(loc, name, "coord.npy")))
        if pbc and "box" not in shapes:
            problems.append(MissingDataError(
                "a periodic system needs box.npy in every set (add an empty 'nopbc' file "
                "to the system if it is not periodic)",
                system=loc.address, file=self.storage.file_of(loc, name, "box.npy")))
        if "coord" not in shapes:
            return None
        nframes, _ = frames_and_width(shapes["coord"], None)
        widths = {}
        for key, shape in shapes.items():
            width, problem = self._array_width(loc, name, key, shape, nframes, natoms)
            if problem is None:
                widths[key] = width
            else:
                problems.append(problem)
        return restore_set(name, nframes, tuple(widths), tuple(widths.values()))

    def _array_width(self, loc: Location, set_name: str, key: str, shape: tuple[int, ...],
                     nframes: int, natoms: int) -> tuple[int, ShapeError | None]:
        """Values per frame of ``key.npy``, or what is wrong with it: its frame count, or a
        width that the format fixes and it does not have."""
        where = {"system": loc.address, "file": self.storage.file_of(loc, set_name, key + ".npy")}
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

    def _mixed_flag(self, loc: Location, sets: tuple[SetMeta, ...]) -> bool:
        flags = {s.name: "real_atom_types" in s.keys for s in sets}
        if len(set(flags.values())) > 1:
            mixed = sorted(n for n, f in flags.items() if f)
            plain = sorted(n for n, f in flags.items() if not f)
            raise DataError("either every set of a system is mixed type (real_atom_types.npy) "
                            "or none is", system=loc.address,
                            file=self.storage.file_of(loc, plain[0], "real_atom_types.npy"),
                            found=f"mixed: {mixed}; not mixed: {plain}")
        return next(iter(flags.values()))

    def _resolve_types(
        self, loc: Location, types: np.ndarray, sys_map: list[str] | None,
        model_map: Sequence[str] | None, mixed: bool,
    ) -> tuple[np.ndarray, tuple[str, ...] | None, tuple[int, ...] | None]:
        """DeePMD-kit's type-map rules (``DeepmdData.__init__``), with errors instead of
        asserts."""
        type_file = self.storage.file_of(loc, None, "type.raw")
        if types.min() < 0:
            raise TypeMapError("type.raw holds a negative type id", system=loc.address,
                               file=type_file, expected="ids >= 0", found=int(types.min()))
        if sys_map is not None and types.max() >= len(sys_map):
            raise TypeMapError("type.raw holds a type id outside type_map.raw",
                               system=loc.address, file=type_file,
                               expected=f"ids < {len(sys_map)} ({' '.join(sys_map)})",
                               found=f"id {int(types.max())}")
        model = list(model_map) if model_map is not None else None
        if model and sys_map is not None:
            missing = [e for e in sys_map if e not in model]
            if missing:
                raise TypeMapError(f"Elements {missing} are not present in the provided "
                                   "type_map.", system=loc.address,
                                   file=self.storage.file_of(loc, None, "type_map.raw"),
                                   expected=f"elements within {model}", found=sys_map)
            order = [model.index(name) for name in sys_map]
            if mixed:
                return types, tuple(model), tuple(order) + (-1,)
            return np.asarray(order, dtype=np.int64)[types], tuple(model), None
        if mixed and model is None and sys_map is None:
            raise DataError("a mixed-type system needs type_map.raw or a model type_map",
                            system=loc.address,
                            file=self.storage.file_of(loc, None, "type_map.raw"))
        if model and sys_map is None and not mixed and types.max() >= len(model):
            raise TypeMapError("type.raw holds a type id outside the model type_map",
                               system=loc.address, file=type_file,
                               expected=f"ids < {len(model)} ({' '.join(model)})",
                               found=f"id {int(types.max())}")
        return types, None if sys_map is None else tuple(sys_map), None


def _collect(problems: list[DataError], check: Any, *args: Any) -> Any:
    """``check(*args)``, or ``None`` with its DataError appended to ``problems``."""
    try:
        return check(*args)
    except DataError as exc:
        problems.append(exc)
        return None


class SetReader(FrameReader):
    """Rows of a set-layout system's arrays, read for the frames asked and transformed as
    DeePMD-kit's ``DeepmdDataSetForLoader`` yields them (atoms sorted by type, ``find_*``
    flags, defaults for absent optional labels)."""

    def __init__(self, storage: SetStorage, meta: SystemMeta,
                 requirements: tuple[DataRequirementItem, ...], origin: str | None) -> None:
        self._storage, self._meta = storage, meta
        self._requirements, self._origin = requirements, origin
        self._order: AtomOrder | None = None
        self._prefix: np.ndarray | None = None

    def frames(self, fids: Sequence[int]) -> list[dict[str, Any]]:
        arrays, flags = self._read(fids)
        frames = []
        for j, fid in enumerate(np.asarray(fids, dtype=np.int64).tolist()):
            frame: dict[str, Any] = {}
            for key, block in arrays.items():
                frame[key] = None if block is None else block[j]
            for key, row_flags in flags.items():
                frame[key] = row_flags[j]
            frame["type"] = frame["atype"]
            frame["fid"] = fid
            frames.append(frame)
        return frames

    def batch(self, fids: Sequence[int]) -> dict[str, Any]:
        arrays, flags = self._read(fids)
        from mdloader.data.collate import batch_from_blocks  # torch: only when reading batches

        return batch_from_blocks(arrays, flags, np.asarray(fids, dtype=np.int64).tolist())

    def _atom_order(self) -> AtomOrder:
        if self._order is None:
            self._order = AtomOrder.of(self._meta.atom_types)
        return self._order

    def _read(self, fids: Sequence[int]) -> tuple[dict[str, np.ndarray | None],
                                                 dict[str, list[np.float32]]]:
        meta = self._meta
        fid_arr = frame_ids(fids, meta.nframes, meta.address)
        if self._prefix is None:
            self._prefix = np.cumsum([s.nframes for s in meta.sets])
        set_idx = np.searchsorted(self._prefix, fid_arr, side="right")
        starts = np.concatenate([[0], self._prefix[:-1]])
        k = len(fid_arr)
        order = self._atom_order()
        arrays: dict[str, np.ndarray | None] = {}
        flags: dict[str, list[np.float32]] = {}
        groups = [(int(si), np.nonzero(set_idx == si)[0]) for si in np.unique(set_idx)]
        for req in self._requirements:
            name = output_key(req.key)
            out, found = self._read_key(req, groups, starts, fid_arr, order)
            arrays[name] = out
            flags["find_" + name] = [np.float32(found[j]) for j in range(k)]
        arrays["atype"], extra = self._types(groups, starts, fid_arr, order, k)
        arrays.update(extra)
        arrays["natoms"] = np.repeat(meta.natoms_vec()[None, :], k, axis=0)
        if not meta.pbc:
            arrays["box"] = None
        return arrays, flags

    def _read_key(self, req: DataRequirementItem, groups: list[tuple[int, np.ndarray]],
                  starts: np.ndarray, fid_arr: np.ndarray,
                  order: AtomOrder) -> tuple[np.ndarray, np.ndarray]:
        meta, storage = self._meta, self._storage
        loc = meta.location
        nsel = int(np.isin(order.atom_types, req.type_sel).sum()) if req.type_sel else 0
        out = default_block(req, len(fid_arr), meta.natoms, nsel)
        found = np.zeros(len(fid_arr), dtype=bool)
        for si, pos in groups:
            s = meta.sets[si]
            stem = stem_in(s.keys, req.key)
            if stem is None:
                if req.must:
                    raise MissingDataError(f"a required key is missing: {req.key}",
                                           system=meta.address,
                                           file=storage.file_of(loc, s.name, req.key + ".npy"))
                continue
            rows = self._rows(s, stem, fid_arr[pos] - starts[si])
            where = (meta.address, storage.file_of(loc, s.name, stem + ".npy"))
            out[pos] = transform(req, rows, order, where)
            found[pos] = True
        return out, found

    def _types(self, groups: list[tuple[int, np.ndarray]], starts: np.ndarray,
               fid_arr: np.ndarray, order: AtomOrder,
               k: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        meta = self._meta
        if not meta.mixed_type:
            sorted_types = order.atom_types[order.idx_map].astype(np.int32)
            return np.repeat(sorted_types[None, :], k, axis=0), {}
        loc = meta.location
        types = np.empty((k, meta.natoms), dtype=np.int32)
        for si, pos in groups:
            s = meta.sets[si]
            rows = self._rows(s, "real_atom_types", fid_arr[pos] - starts[si]).astype(np.int64)
            types[pos] = self._map_real_types(rows, self._storage.file_of(loc, s.name,
                                                                     "real_atom_types.npy"))
        counts = np.stack([np.bincount(t[t >= 0], minlength=meta.ntypes) for t in types])
        head = np.full((k, 2), meta.natoms)
        return types, {"real_natoms_vec": np.concatenate([head, counts], axis=1).astype(np.int32)}

    def _rows(self, s: SetMeta, stem: str, rows: np.ndarray) -> np.ndarray:
        """Rows of ``stem`` in set ``s``; a file changed since the description is an error."""
        try:
            return self._storage.read_rows(self._meta.location, s.name, stem, rows, s.nframes,
                                      s.width(stem))
        except StaleDataError as exc:
            if self._origin is not None:  # a start that reads it again would fail the same way
                remove_entry(self._origin)
            raise exc.described_by(self._origin) from None

    def _map_real_types(self, rows: np.ndarray, file: str) -> np.ndarray:
        meta = self._meta
        limit = len(meta.mixed_idx_map) - 1 if meta.mixed_idx_map else meta.ntypes
        bad = (rows < -1) | (rows >= limit)
        if bad.any():
            raise TypeMapError("real_atom_types.npy holds a type id outside the type map",
                               system=meta.address, file=file,
                               expected=f"ids in [-1, {limit})", found=int(rows[bad][0]))
        if meta.mixed_idx_map:
            rows = np.asarray(meta.mixed_idx_map, dtype=np.int64)[rows]
        return rows.astype(np.int32)
