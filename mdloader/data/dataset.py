"""``DeepmdDataSetForLoader``: one system as a lazy torch ``Dataset``.

It holds a :class:`~mdloader.data.system.SystemMeta` and the data requirements, nothing else, so it
pickles to a few hundred bytes and travels cheaply to other ranks and DataLoader workers.
Frames are read on demand: rows of memory-mapped npy files or rows of HDF5 datasets, through
handles opened on first read in the reading process. The frames of an LMDB group are read
record by record, as DeePMD-kit's LMDB reader yields them
(:mod:`mdloader.data.formats.lmdb.frames`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from mdloader.data.collate import batch_from_blocks
from mdloader.data.formats import backend_of
from mdloader.data.frames import AtomOrder, default_block, expected_widths, transform
from mdloader.data.schema import (
    DataRequirementItem,
    default_requirements,
    merge_requirements,
    output_key,
    stem_in,
)
from mdloader.data.system import SetMeta, SystemMeta, build_system_meta
from mdloader.errors import MissingDataError, ShapeError, StaleDataError, TypeMapError


class DeepmdDataSetForLoader(Dataset):
    """The frames of one DeePMD system, read lazily.

    Parameters
    ----------
    system
        A system address (directory or ``file.h5#/group``) or an already built
        :class:`SystemMeta` (what :func:`mdloader.loading.build.build_systems` hands every rank).
    type_map
        The model's type map; system types are remapped to it (DeePMD-kit's rules).
    origin
        Where the description comes from (an index file), named when a read finds that a file
        changed since; ``None``: described at start-up.
    """

    def __init__(self, system: str | SystemMeta, type_map: Sequence[str] | None = None, *,
                 origin: str | None = None) -> None:
        meta = system if isinstance(system, SystemMeta) else build_system_meta(system, type_map)
        self._meta = meta
        self._origin = origin
        self._extra: list[DataRequirementItem] = []
        self._reset()

    def _reset(self) -> None:
        # Shared tuples and lazily computed arrays: a dataset costs little until it is read.
        self._order: AtomOrder | None = None
        self._prefix: np.ndarray | None = None
        self._lmdb: Any = None
        if self._meta.backend == "lmdb":  # records carry coord and box: only what was asked
            self._requirements = tuple(self._extra)
            return
        defaults = default_requirements(self._meta.pbc)
        self._requirements = (merge_requirements(defaults, self._extra) if self._extra
                              else defaults)

    # -- pickling: metadata and requirements only ------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"meta": self._meta, "extra": self._extra, "origin": self._origin}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._meta = state["meta"]
        self._extra = state["extra"]
        self._origin = state.get("origin")
        self._reset()

    # -- DeePMD-kit's attributes -------------------------------------------------------------
    @property
    def meta(self) -> SystemMeta:
        return self._meta

    @property
    def system(self) -> str:
        return self._meta.address

    @property
    def mixed_type(self) -> bool:
        return self._meta.mixed_type

    @property
    def _natoms(self) -> int:
        return self._meta.natoms

    @property
    def _ntypes(self) -> int:
        return self._meta.ntypes

    @property
    def _natoms_vec(self) -> np.ndarray:
        return self._meta.natoms_vec()

    @property
    def requirements(self) -> list[DataRequirementItem]:
        return list(self._requirements)

    def __len__(self) -> int:
        return self._meta.nframes

    def __repr__(self) -> str:
        return (f"DeepmdDataSetForLoader({self.system!r}, natoms={self._natoms}, "
                f"nframes={len(self)})")

    def add_data_requirement(self, data_requirement: Iterable[Any]) -> None:
        """Add what a model or loss needs, and check it against the headers right away."""
        merged = merge_requirements(self._extra, data_requirement)
        if self._meta.backend == "lmdb":  # what a frame holds is known when it is read
            from mdloader.data.formats.lmdb.frames import check_requirements

            check_requirements(merged)
        else:
            for req in merged:
                self._check_requirement(req)
        self._extra = merged
        self._reset()

    def _check_requirement(self, req: DataRequirementItem) -> None:
        io = backend_of(self._meta.location)
        accepted = expected_widths(req, self._meta.atom_types)
        for s in self._meta.sets:
            stem = stem_in(s.keys, req.key)
            if stem is None:
                if req.must:
                    raise MissingDataError(f"a required key is missing: {req.key}",
                                           system=self.system,
                                           file=io.file_of(self._meta.location, s.name,
                                                           req.key + ".npy"))
                continue
            width = s.width(stem)
            if width not in accepted:
                raise ShapeError(f"per-frame width of {stem}.npy does not match the requirement",
                                 system=self.system,
                                 file=io.file_of(self._meta.location, s.name, stem + ".npy"),
                                 expected=" or ".join(str(w) for w in accepted), found=width)

    def _lmdb_reader(self) -> Any:
        """The reader of an LMDB group, made on first read (100 000 groups cost nothing before)."""
        if self._lmdb is None:
            from mdloader.data.formats.lmdb.frames import LmdbGroupReader

            self._lmdb = LmdbGroupReader(self._meta, self._requirements)
        return self._lmdb

    def _atom_order(self) -> AtomOrder:
        if self._order is None:
            self._order = AtomOrder.of(self._meta.atom_types)
        return self._order

    # -- reading ------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.get_frames([index])[0]

    def get_frames(self, fids: Sequence[int]) -> list[dict[str, Any]]:
        """Frame dicts exactly as DeePMD-kit's ``DeepmdDataSetForLoader[i]`` yields them (for an
        LMDB group: as its ``LmdbDataReader[i]`` does)."""
        if self._meta.backend == "lmdb":
            return self._lmdb_reader().frames(self._check_fids(fids))
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

    def get_batch(self, fids: Sequence[int]) -> dict[str, Any]:
        """The collated batch of ``fids`` (the same as ``collate_batch(get_frames(fids))``; for
        an LMDB group, a flag is 1 only when every frame has the label, as DeePMD-kit's)."""
        if self._meta.backend == "lmdb":
            return self._lmdb_reader().batch(self._check_fids(fids))
        arrays, flags = self._read(fids)
        return batch_from_blocks(arrays, flags, np.asarray(fids, dtype=np.int64).tolist())

    def _read(self, fids: Sequence[int]) -> tuple[dict[str, np.ndarray | None],
                                                 dict[str, list[np.float32]]]:
        fid_arr = self._check_fids(fids)
        if self._prefix is None:
            self._prefix = np.cumsum([s.nframes for s in self._meta.sets])
        set_idx = np.searchsorted(self._prefix, fid_arr, side="right")
        starts = np.concatenate([[0], self._prefix[:-1]])
        k = len(fid_arr)
        meta, order = self._meta, self._atom_order()
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
        meta = self._meta
        loc = meta.location
        io = backend_of(loc)
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
                                           file=io.file_of(loc, s.name, req.key + ".npy"))
                continue
            rows = self._rows(io, s, stem, fid_arr[pos] - starts[si])
            where = (meta.address, io.file_of(loc, s.name, stem + ".npy"))
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
        io = backend_of(loc)
        types = np.empty((k, meta.natoms), dtype=np.int32)
        for si, pos in groups:
            s = meta.sets[si]
            rows = self._rows(io, s, "real_atom_types", fid_arr[pos] - starts[si]
                              ).astype(np.int64)
            types[pos] = self._map_real_types(rows, io.file_of(loc, s.name,
                                                               "real_atom_types.npy"))
        counts = np.stack([np.bincount(t[t >= 0], minlength=meta.ntypes) for t in types])
        head = np.full((k, 2), meta.natoms)
        return types, {"real_natoms_vec": np.concatenate([head, counts], axis=1).astype(np.int32)}

    def _rows(self, io: Any, s: SetMeta, stem: str, rows: np.ndarray) -> np.ndarray:
        """Rows of ``stem`` in set ``s``; a file changed since the description is an error."""
        try:
            return io.read_rows(self._meta.location, s.name, stem, rows, s.nframes,
                                s.width(stem))
        except StaleDataError as exc:
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

    def _check_fids(self, fids: Sequence[int]) -> np.ndarray:
        fid_arr = np.asarray(fids, dtype=np.int64).reshape(-1)
        n = len(self)
        if fid_arr.size == 0:
            raise IndexError(f"no frame requested from system {self.system}")
        if fid_arr.min() < -n or fid_arr.max() >= n:
            raise IndexError(f"frame index out of range [0, {n}) in system {self.system}: "
                             f"{fid_arr.tolist()}")
        return np.where(fid_arr < 0, fid_arr + n, fid_arr)
