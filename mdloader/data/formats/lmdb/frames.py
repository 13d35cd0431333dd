"""Frames of an LMDB group exactly as DeePMD-kit 3.2.0's ``LmdbDataReader`` yields them.

One record becomes one frame dict (``decode_lmdb_frame``'s contract): the plural disk keys are
renamed (``coords`` -> ``coord`` ...), ``coord``/``box``/``energy``/``force``/``virial`` are
reshaped and cast to the requested precision, other fields keep their stored dtype and shape,
atom types are remapped to the model's ``type_map`` by element name but not sorted, ``natoms`` is
counted per frame, every present field gets ``find_<key>`` = 1, and each data requirement is
resolved (a missing optional label is ``default``-filled with ``find`` = 0, or 1 for the
``"default"`` source policy; a missing ``must`` label is an error). A frame without ``cells`` is
non-periodic and has no ``box``.

Batches follow mdloader's collation rules (:mod:`mdloader.data.collate`) with DeePMD-kit's LMDB
flag rule: a ``find_*`` flag is 1 only if every frame of the batch has it. Differences, each in
``docs/migrating.md``: a batch mixing periodic and non-periodic frames is an error (DeePMD-kit
drops ``box`` and trains the periodic frames as molecules), a batch without cells carries
``box: None`` as npy batches do, ``sid`` is the group's index, and type ids outside the type map
are errors naming the frame.

A batch of LMDB records stacked field by field: the common case, without per-frame dicts.

When every record of a batch has the same fields, in the same order, as arrays of the same
dtype and shape, and stores no ``find_*`` flag of its own (what dpdata's and mdloader's writers
produce for the frames of one group), each field is copied straight from the records' bytes into
one preallocated block, types are remapped and counted for the whole batch at once, and the data
requirements are resolved once. The result is the batch that decoding every frame
(:meth:`~mdloader.data.lmdb_frames.LmdbGroupReader.decode`) and collating would give; any other
batch returns ``None`` and takes that per-frame path, which also names a defective frame.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mdloader.data.collate import batch_from_blocks
from mdloader.data.formats.geometry import degenerate_boxes
from mdloader.data.formats.lmdb import codec, environment
from mdloader.data.formats.lmdb.environment import entry_of, frame_key
from mdloader.data.schema import DataRequirementItem, float_precisions, output_dtype
from mdloader.data.system import SystemMeta
from mdloader.errors import (
    ConfigError,
    CorruptFileError,
    DataError,
    MissingDataError,
    NonFiniteError,
    ShapeError,
    TypeMapError,
)

#: Disk names of the core fields -> DeePMD-kit's keys.
DISK_KEYS = {"coords": "coord", "cells": "box", "energies": "energy", "forces": "force",
             "atom_types": "atype", "virials": "virial"}
#: Per-frame shape of the core fields (``-1``: the atom count), in DeePMD-kit's keys.
CORE_SHAPES = {"coord": (-1, 3), "box": (9,), "force": (-1, 3), "virial": (9,), "energy": (1,)}
DROPPED = frozenset({"atom_numbs", "atom_names", "orig"})
_STRUCTURAL = frozenset({"coord", "box", "atype", "natoms", "real_natoms_vec", "fid"})
ALWAYS_FLAGGED = ("fparam", "aparam", "spin", "charge_spin")
ONE, ZERO = np.float32(1.0), np.float32(0.0)
_NUMERIC = (np.ndarray, np.generic, int, float, bool)  # what a batch stacks (text is left out)


def canonical(key: Any) -> str:
    """A record key in DeePMD-kit's in-memory spelling (``atomic_X`` -> ``atom_X``)."""
    key = key.decode() if isinstance(key, bytes) else str(key)
    key = DISK_KEYS.get(key, key)
    if key.startswith("find_atomic_"):
        return "find_atom_" + key[len("find_atomic_"):]
    if key.startswith("atomic_"):
        return "atom_" + key[len("atomic_"):]
    return key


def check_requirements(requirements: Sequence[DataRequirementItem]) -> None:
    """What an LMDB group cannot serve, refused when the requirement is added."""
    for req in requirements:
        if req.source_policy == "derived":
            raise ConfigError(f"data requirement {req.key!r}: derived labels are not "
                              "computed by mdloader", path="data_requirement")


@functools.lru_cache(maxsize=64)
def _core_dtypes(requirements: tuple[DataRequirementItem, ...],
                 precisions: tuple[np.dtype, np.dtype]) -> tuple[dict[str, np.dtype], tuple]:
    """Output dtypes of the cast fields (a requirement's dtype, else DeePMD-kit's defaults),
    and a hashable key of them; shared by every group read under the same requirements."""
    normal, high = precisions
    core = {"coord": normal, "box": normal, "force": normal, "virial": normal, "energy": high}
    given = {req.key: req for req in requirements}
    dtypes = {k: output_dtype(given[k]) if k in given else v for k, v in core.items()}
    return dtypes, tuple(sorted((k, v.str) for k, v in dtypes.items()))


class LmdbGroupReader:
    """Reads the frames of one group (``meta``) under the given data requirements; a frame
    whose cell holds NaN/inf or no volume is an error naming it (unless ``check_cells`` is
    false: the deep check collects them instead)."""

    check_cells = True

    def __init__(self, meta: SystemMeta, requirements: Sequence[DataRequirementItem]) -> None:
        group = meta.sets[0]
        self.address, self.path = meta.address, meta.location.path
        self.natoms, self.ntypes = meta.natoms, meta.ntypes
        self.runs, self.fmt, self.stamp = group.runs, group.frame_format, group.stamp
        self.remap = None if group.remap is None else np.asarray(group.remap, dtype=np.int64)
        self.requirements = {req.key: req for req in requirements}
        self.dtypes, self.dtypes_key = _core_dtypes(tuple(requirements), float_precisions())

    # -- public -------------------------------------------------------------------------------
    def keys(self, positions: Sequence[int]) -> np.ndarray:
        """The database frame indices of the group's positions."""
        return self.runs.keys(positions)

    def frames(self, positions: Sequence[int]) -> list[dict[str, Any]]:
        """``LmdbDataReader[i]`` for each position (fresh, writable arrays)."""
        return [self.decode(index, copy=True) for index in self.keys(positions).tolist()]

    def batch(self, positions: Sequence[int]) -> dict[str, Any]:
        """The collated batch of the positions (torch tensors, ``fid`` = frame indices).

        The records are stacked field by field when they share one layout (the usual case:
        :func:`stacked_batch`); otherwise, or to name a defect, each
        frame is decoded on its own and the frames are collated.
        """
        indices = self.keys(positions).tolist()
        txn = environment.serving_txn(self.path, self.stamp)
        raws = [self.unpacked(index, txn) for index in indices]
        fast = stacked_batch(self, raws, indices)
        if fast is not None:
            return fast
        frames = [self._frame(self._decoded(raw, index, False), index)
                  for raw, index in zip(raws, indices)]
        blocks, flags = self._collate(frames, indices)
        return batch_from_blocks(blocks, flags, indices)

    # -- one frame ----------------------------------------------------------------------------
    def unpacked(self, index: int, txn: Any = None) -> dict[Any, Any]:
        """The msgpack map of frame ``index``, arrays still encoded."""
        key = frame_key(index, self.fmt)
        raw = (txn or environment.serving_txn(self.path, self.stamp)).get(key)
        if raw is None:
            raise MissingDataError(f"frame {index} is missing from the database",
                                   system=self.address, file=entry_of(self.path, key))
        record = codec.unpack(raw, f"frame {index}", self.address, key)
        if not isinstance(record, dict):
            raise CorruptFileError(f"frame {index} is not a map", system=self.address,
                                   file=entry_of(self.path, key), found=type(record).__name__)
        return record

    def record(self, index: int, *, copy: bool = False) -> dict[str, Any]:
        """The stored record of frame ``index``, arrays decoded (read-only views unless
        ``copy``)."""
        return self._decoded(self.unpacked(index), index, copy)

    def _decoded(self, record: dict[Any, Any], index: int, copy: bool) -> dict[str, Any]:
        key = frame_key(index, self.fmt)
        out: dict[str, Any] = {}
        for name, value in record.items():
            try:
                if codec.is_encoded_array(value):
                    value = _copied(codec.decode_array(value), copy)
                elif isinstance(value, list) and value and codec.is_encoded_array(value[0]):
                    value = [_copied(codec.decode_array(v), copy) for v in value]
            except (TypeError, ValueError) as exc:
                raise CorruptFileError(f"field {name!r} of frame {index} cannot be decoded",
                                       system=self.address, file=entry_of(self.path, key),
                                       found=f"{type(exc).__name__}: {exc}") from exc
            out[canonical(name)] = value
        return out

    def decode(self, index: int, *, copy: bool) -> dict[str, Any]:
        """Frame ``index`` in DeePMD-kit's convention (``decode_lmdb_frame``)."""
        return self._frame(self.record(index, copy=copy), index)

    def _frame(self, frame: dict[str, Any], index: int) -> dict[str, Any]:
        for name in DROPPED:
            frame.pop(name, None)
        self._core(frame, index)
        atype = frame["atype"]
        natoms = np.zeros(self.ntypes + 2, dtype=np.int64)
        natoms[:2] = len(atype)
        natoms[2:] = np.bincount(atype[atype >= 0], minlength=self.ntypes)[: self.ntypes]
        frame["natoms"] = frame["real_natoms_vec"] = natoms
        reqs = self.requirements
        for name in list(frame):
            if not (name.startswith("find_") or name in _STRUCTURAL or name in reqs):
                frame.setdefault("find_" + name, ONE)
        for name, req in reqs.items():
            self._resolve(frame, name, req, index)
        for name in ALWAYS_FLAGGED:
            frame.setdefault("find_" + name, ONE if name in frame else ZERO)
        frame["fid"] = index
        return frame

    def _core(self, frame: dict[str, Any], index: int) -> None:
        """Reshape and cast the core fields; check atoms and type ids against the group."""
        for name, shape in CORE_SHAPES.items():
            value = frame.get(name)
            if isinstance(value, np.ndarray):
                frame[name] = value.reshape(shape).astype(self.dtypes[name], copy=False)
            elif name == "energy" and value is not None:
                frame[name] = np.array([float(value)], dtype=self.dtypes[name])
        box = frame.get("box")
        if self.check_cells and isinstance(box, np.ndarray) and len(degenerate_boxes(box)):
            raise self.bad_box(box, index)
        atype = frame.get("atype")
        if not isinstance(atype, np.ndarray) or "coord" not in frame:
            missing = "atom_types" if not isinstance(atype, np.ndarray) else "coords"
            raise MissingDataError(f"frame {index} has no {missing}", system=self.address,
                                   file=self._entry(index))
        atype = atype.reshape(-1).astype(np.int64)
        for name, rows in (("atype", len(atype)), ("coord", len(frame["coord"])),
                           ("force", len(frame.get("force", atype)))):
            if rows != self.natoms:
                raise ShapeError(f"frame {index} holds {rows} atoms in {name}, but frame_nlocs "
                                 f"gives it {self.natoms}", system=self.address,
                                 file=self._entry(index), expected=self.natoms, found=rows)
        frame["atype"] = self._remap(atype, index)

    def bad_box(self, box: np.ndarray, index: int) -> DataError:
        """The error of frame ``index``'s cell ``box``, which holds NaN/inf or no volume
        (:func:`~mdloader.data.formats.geometry.degenerate_boxes`): its heights are NaN."""
        if not np.isfinite(box).all():
            return NonFiniteError(f"the box of frame {index} holds NaN/inf", system=self.address,
                                  file=self._entry(index))
        return DataError(f"the box of frame {index} encloses no volume (a degenerate cell)",
                         system=self.address, file=self._entry(index),
                         expected="a cell of volume > 0", found=f"box {box.reshape(-1).tolist()}")

    def _remap(self, atype: np.ndarray, index: int) -> np.ndarray:
        limit = self.ntypes if self.remap is None else len(self.remap)
        real = atype >= 0
        if np.any(atype[real] >= limit):
            raise TypeMapError(f"frame {index} holds an atom type id outside the type map",
                               system=self.address, file=self._entry(index),
                               expected=f"ids < {limit} (or negative for virtual atoms)",
                               found=int(atype.max()))
        if self.remap is not None:
            atype[real] = self.remap[atype[real]]
        return atype

    def _resolve(self, frame: dict[str, Any], name: str, req: DataRequirementItem,
                 index: int) -> None:
        """One data requirement, as DeePMD-kit resolves it for an LMDB frame."""
        flag = "find_" + name
        if not _available(frame, name):
            if req.must:
                raise MissingDataError(f"required field {name!r} is unavailable in frame "
                                       f"{index}", system=self.address, file=self._entry(index))
            frame[flag] = ONE if req.source_policy == "default" else ZERO
            shape = (len(frame["atype"]), req.ndof) if req.atomic else (req.ndof,)
            data = np.full(shape, req.default, dtype=output_dtype(req))
            frame[name] = data if req.repeat == 1 else np.repeat(data, req.repeat).reshape(-1)
            return
        frame.setdefault(flag, ONE)
        if req.repeat != 1 and isinstance(frame[name], np.ndarray):
            repeated = np.repeat(frame[name], req.repeat).reshape(-1)
            frame[name] = repeated.astype(output_dtype(req), copy=False)

    def _entry(self, index: int) -> str:
        return entry_of(self.path, frame_key(index, self.fmt))

    # -- a batch ------------------------------------------------------------------------------
    def _collate(self, frames: list[dict[str, Any]], indices: list[int]
                 ) -> tuple[dict[str, np.ndarray | None], dict[str, list[np.float32]]]:
        """Stacked fields and AND-reduced flags; a field missing from some frames is left out."""
        names: dict[str, None] = {}
        for frame in frames:
            names.update(dict.fromkeys(frame))
        blocks: dict[str, np.ndarray | None] = {}
        flags: dict[str, list[np.float32]] = {}
        for name in names:
            if name == "fid":
                continue
            values = [frame.get(name) for frame in frames]
            if name.startswith("find_"):
                every = all(v is not None and float(v) != 0.0 for v in values)
                flags[name] = [ONE if every else ZERO]
            elif all(isinstance(v, _NUMERIC) for v in values):
                blocks[name] = self._stack(name, values, indices)
            elif name == "box" and any(v is not None for v in values):
                with_box = [i for i, v in zip(indices, values) if v is not None]
                without = [i for i, v in zip(indices, values) if v is None]
                raise DataError("a batch mixes periodic frames (with cells) and non-periodic "
                                f"ones: frames {with_box[:5]} and {without[:5]}",
                                system=self.address, file=self._entry(without[0]))
        blocks.setdefault("box", None)
        return blocks, flags

    def _stack(self, name: str, values: list[Any], indices: list[int]) -> np.ndarray:
        try:
            return np.stack(values)
        except ValueError as exc:
            shapes = sorted({str(np.shape(v)) for v in values})
            raise ShapeError(f"field {name!r} changes shape within one batch", system=self.address,
                             file=self._entry(indices[0]), found=", ".join(shapes)) from exc


def _copied(array: np.ndarray, copy: bool) -> np.ndarray:
    return array.copy() if copy else array


def _available(frame: dict[str, Any], name: str) -> bool:
    """DeePMD-kit's availability: the field is an array or a number, and any stored
    ``find_<key>`` is nonzero."""
    present = isinstance(frame.get(name), _NUMERIC)
    flag = frame.get("find_" + name)
    if flag is None:
        return present
    return present and bool(float(np.asarray(flag).reshape(-1)[0]))


#: Per-frame shape of the fields stacked (``-1``: the atom count), in DeePMD-kit's keys.
_CORE_SHAPES = {**CORE_SHAPES, "atype": (-1,)}


def stacked_batch(reader: LmdbGroupReader, raws: list[dict[Any, Any]],
                  indices: list[int]) -> dict[str, Any] | None:
    """The batch of ``raws`` (unpacked records of frames ``indices``), or ``None`` when the
    records do not share one layout or one of them needs the per-frame path's error."""
    try:
        blocks = _blocks(reader, raws)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None
    if blocks is None or not _types_ok(reader, blocks):
        return None
    box = blocks.get("box")
    if box is not None and len(degenerate_boxes(box)):  # the per-frame path names the frame
        return None
    flags: dict[str, list[np.float32]] = {}
    if not _requirements(reader, blocks, flags, len(raws)):
        return None
    for name in list(blocks):
        if name not in reader.requirements and name not in ("coord", "box", "atype"):
            flags["find_" + name] = [ONE]
    for name in ALWAYS_FLAGGED:
        flags.setdefault("find_" + name, [ONE if name in blocks else ZERO])
    blocks["natoms"] = blocks["real_natoms_vec"] = _counts(blocks["atype"], reader.ntypes)
    blocks.setdefault("box", None)
    return batch_from_blocks(blocks, flags, indices)


def _blocks(reader: LmdbGroupReader, raws: list[dict[Any, Any]]) -> dict[str, Any] | None:
    """One stacked array per field, or ``None`` when the records' layouts differ."""
    plan = _plan(reader, raws[0])
    if plan is None:
        return None
    names = plan.names
    for raw in raws:
        if raw.keys() != names:
            return None
    blocks: dict[str, Any] = {}
    for name, key, kind, shape, stored, per_frame, dtype, size in plan:
        datas = []
        for raw in raws:
            value = raw[name]
            data = value["data"]
            if len(data) != size or value["type"] != kind or value["shape"] != shape:
                return None
            datas.append(data)
        # one buffer for the whole field (a bytearray: torch wants writable arrays)
        block = np.frombuffer(bytearray().join(datas), dtype=stored)
        block = block.reshape((len(raws),) + per_frame)
        blocks[key] = block if block.dtype == dtype else block.astype(dtype)
    return blocks


class _Plan(list):
    """How to stack each field of records laid out like one record; ``names``: their fields."""

    names: Any

    def fits(self, record: dict[Any, Any]) -> bool:
        return all(record[step[0]]["type"] == step[2] and record[step[0]]["shape"] == step[3]
                   for step in self)


_PLANS: dict[tuple[Any, ...], _Plan] = {}
_PLANS_LIMIT = 256


def _plan(reader: LmdbGroupReader, first: dict[Any, Any]) -> _Plan | None:
    """The stacking plan of records like ``first``, or ``None`` when such a record needs the
    per-frame path. Plans are shared by the groups of equal atom count and output dtypes."""
    names = tuple(first)
    key = (names, reader.natoms, reader.dtypes_key)
    plan = _PLANS.get(key)
    if plan is not None and plan.fits(first):
        return plan
    plan = _new_plan(reader, first)
    if plan is not None:
        if len(_PLANS) >= _PLANS_LIMIT:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _new_plan(reader: LmdbGroupReader, first: dict[Any, Any]) -> _Plan | None:
    plan = _Plan()
    plan.names = first.keys()
    for name in first:
        if name in DROPPED:
            continue
        value, key = first[name], canonical(name)
        if key.startswith("find_"):
            return None  # stored flags: resolved frame by frame
        kind, shape = value["type"], value["shape"]
        stored = np.dtype(kind)
        count = math.prod(shape)
        per_frame = tuple(shape) if key not in _CORE_SHAPES else _resolve(_CORE_SHAPES[key],
                                                                        count)
        dtype = np.dtype(np.int64) if key == "atype" else reader.dtypes.get(key, stored)
        plan.append((name, key, kind, shape, stored, per_frame, dtype, count * stored.itemsize))
    if not {"atype", "coord"} <= {step[1] for step in plan}:
        return None
    return plan


def _resolve(shape: tuple[int, ...], count: int) -> tuple[int, ...]:
    if -1 not in shape:
        if math.prod(shape) != count:
            raise ValueError("size")
        return shape
    rest = math.prod(s for s in shape if s != -1)
    if count % rest:
        raise ValueError("size")
    return tuple(count // rest if s == -1 else s for s in shape)


def _types_ok(reader: LmdbGroupReader, blocks: dict[str, Any]) -> bool:
    """Atom counts match the group, ids are in range; remaps them in place."""
    atype = blocks["atype"]
    if atype.shape[1] != reader.natoms or blocks["coord"].shape[1] != reader.natoms:
        return False
    if "force" in blocks and blocks["force"].shape[1] != reader.natoms:
        return False
    limit = reader.ntypes if reader.remap is None else len(reader.remap)
    if atype.size and atype.max() >= limit:
        return False
    if reader.remap is not None:
        real = atype >= 0
        atype[real] = reader.remap[atype[real]]
    return True


def _requirements(reader: LmdbGroupReader, blocks: dict[str, Any],
                  flags: dict[str, list[np.float32]], k: int) -> bool:
    """Resolve every requirement for the whole batch; ``False``: a ``must`` label is absent
    (the per-frame path names the frame)."""
    natoms = blocks["atype"].shape[1]
    for name, req in reader.requirements.items():
        if name not in blocks:
            if req.must:
                return False
            flags["find_" + name] = [ONE if req.source_policy == "default" else ZERO]
            shape = (natoms, req.ndof) if req.atomic else (req.ndof,)
            block = np.full((k,) + shape, req.default, dtype=output_dtype(req))
            blocks[name] = block if req.repeat == 1 else np.repeat(
                block.reshape(k, -1), req.repeat, axis=1)
            continue
        flags["find_" + name] = [ONE]
        if req.repeat != 1:
            blocks[name] = np.repeat(blocks[name].reshape(k, -1), req.repeat,
                                     axis=1).astype(output_dtype(req), copy=False)
    return True


def _counts(atype: np.ndarray, ntypes: int) -> np.ndarray:
    """``[nloc, nloc, count of each type]`` per frame (negative ids are not counted)."""
    k, nloc = atype.shape
    out = np.empty((k, ntypes + 2), dtype=np.int64)
    out[:, :2] = nloc
    first = atype[0]
    if (atype == first).all():  # frames of one source system usually share their types
        out[:, 2:] = np.bincount(first[(first >= 0) & (first < ntypes)], minlength=ntypes)
        return out
    real = (atype >= 0) & (atype < ntypes)
    slots = (atype + ntypes * np.arange(k)[:, None])[real]
    out[:, 2:] = np.bincount(slots, minlength=k * ntypes).reshape(k, ntypes)
    return out
