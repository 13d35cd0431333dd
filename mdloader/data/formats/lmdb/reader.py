"""Frames of an LMDB group exactly as DeePMD-kit 3.2.0's ``LmdbDataReader`` yields them, decoded
record by record.

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
are errors naming the frame. A batch whose records share one layout is stacked field by field
instead (:mod:`~mdloader.data.formats.lmdb.stacked`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mdloader.data.collate import batch_from_blocks
from mdloader.data.formats.base import SystemMeta
from mdloader.data.formats.geometry import degenerate_boxes
from mdloader.data.formats.lmdb import codec, environment, stacked
from mdloader.data.formats.lmdb.environment import entry_of, frame_key
from mdloader.data.formats.lmdb.fields import (
    ALWAYS_FLAGGED,
    CORE_SHAPES,
    DROPPED,
    NUMERIC,
    ONE,
    STRUCTURAL,
    ZERO,
    canonical,
    core_dtypes,
    resolve_requirement,
)
from mdloader.data.schema import DataRequirementItem, float_precisions
from mdloader.errors import (
    CorruptFileError,
    DataError,
    MissingDataError,
    NonFiniteError,
    ShapeError,
    TypeMapError,
)


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
        self.dtypes, self.dtypes_key = core_dtypes(tuple(requirements), float_precisions())

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
        :func:`~mdloader.data.formats.lmdb.stacked.stacked_batch`); otherwise, or to name a
        defect, each frame is decoded on its own and the frames are collated.
        """
        indices = self.keys(positions).tolist()
        txn = environment.serving_txn(self.path, self.stamp)
        raws = [self.unpacked(index, txn) for index in indices]
        fast = stacked.stacked_batch(self, raws, indices)
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
            if not (name.startswith("find_") or name in STRUCTURAL or name in reqs):
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
            frame[flag], block = resolve_requirement(req, None, len(frame["atype"]), 1)
            frame[name] = block[0]
            return
        frame.setdefault(flag, ONE)
        if req.repeat != 1 and isinstance(frame[name], np.ndarray):
            frame[name] = resolve_requirement(req, frame[name][None], len(frame["atype"]),
                                              1)[1][0]

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
            elif all(isinstance(v, NUMERIC) for v in values):
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
    present = isinstance(frame.get(name), NUMERIC)
    flag = frame.get("find_" + name)
    if flag is None:
        return present
    return present and bool(float(np.asarray(flag).reshape(-1)[0]))


