"""A batch of LMDB records stacked field by field: the common case, without per-frame dicts.

When every record of a batch has the same fields, in the same order, as arrays of the same
dtype and shape, and stores no ``find_*`` flag of its own (what dpdata's and mdloader's writers
produce for the frames of one group), each field is copied straight from the records' bytes into
one preallocated block, types are remapped and counted for the whole batch at once, and the data
requirements are resolved once for the batch, by the rule the per-frame path uses
(:func:`~mdloader.data.formats.lmdb.fields.resolve_requirement`). The result is the batch that
decoding every frame (:meth:`~mdloader.data.formats.lmdb.reader.LmdbGroupReader.decode`) and
collating would give; any other batch returns ``None`` and takes that per-frame path, which also
names a defective frame.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from mdloader.data.collate import batch_from_blocks
from mdloader.data.formats.geometry import degenerate_boxes
from mdloader.data.formats.lmdb.fields import (
    ALWAYS_FLAGGED,
    CORE_SHAPES,
    DROPPED,
    ONE,
    ZERO,
    canonical,
    resolve_requirement,
)
from mdloader.data.schema import DataRequirementItem


class StackTarget(Protocol):
    """What stacking needs of the group a batch is read from, and nothing of how its records
    are read: the group's atom and type counts, the remap of stored type ids, the data
    requirements and the output dtypes (the group's reader, which passes itself, has them)."""

    natoms: int
    ntypes: int
    #: stored type id -> model type id (``None``: ids are used as stored)
    remap: np.ndarray | None
    #: the data requirements, by key
    requirements: dict[str, DataRequirementItem]
    #: the output dtype of each cast field, and a hashable key of them (layouts are shared by it)
    dtypes: dict[str, np.dtype]
    dtypes_key: tuple


#: Per-frame shape of the fields stacked (``-1``: the atom count), in DeePMD-kit's keys.
_CORE_SHAPES = {**CORE_SHAPES, "atype": (-1,)}


def stacked_batch(group: StackTarget, raws: list[dict[Any, Any]],
                  indices: list[int]) -> dict[str, Any] | None:
    """The batch of ``raws`` (unpacked records of frames ``indices``), or ``None`` when the
    records do not share one layout or one of them needs the per-frame path's error."""
    try:
        blocks = _blocks(group, raws)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None
    if blocks is None or not _types_ok(group, blocks):
        return None
    box = blocks.get("box")
    if box is not None and len(degenerate_boxes(box)):  # the per-frame path names the frame
        return None
    flags: dict[str, list[np.float32]] = {}
    if not _requirements(group, blocks, flags, len(raws)):
        return None
    for name in list(blocks):
        if name not in group.requirements and name not in ("coord", "box", "atype"):
            flags["find_" + name] = [ONE]
    for name in ALWAYS_FLAGGED:
        flags.setdefault("find_" + name, [ONE if name in blocks else ZERO])
    blocks["natoms"] = blocks["real_natoms_vec"] = _counts(blocks["atype"], group.ntypes)
    blocks.setdefault("box", None)
    return batch_from_blocks(blocks, flags, indices)


def _blocks(group: StackTarget, raws: list[dict[Any, Any]]) -> dict[str, Any] | None:
    """One stacked array per field, or ``None`` when the records' layouts differ."""
    layout = _layout(group, raws[0])
    if layout is None:
        return None
    names = layout.names
    for raw in raws:
        if raw.keys() != names:
            return None
    blocks: dict[str, Any] = {}
    for name, key, kind, shape, stored, per_frame, dtype, size in layout:
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


class _StackLayout(list):
    """How to stack each field of records laid out like one record; ``names``: their fields."""

    names: Any

    def fits(self, record: dict[Any, Any]) -> bool:
        return all(record[step[0]]["type"] == step[2] and record[step[0]]["shape"] == step[3]
                   for step in self)


_LAYOUTS: dict[tuple[Any, ...], _StackLayout] = {}
_LAYOUTS_LIMIT = 256


def _layout(group: StackTarget, first: dict[Any, Any]) -> _StackLayout | None:
    """The stacking layout of records like ``first``, or ``None`` when such a record needs the
    per-frame path. Layouts are shared by the groups of equal atom count and output dtypes."""
    names = tuple(first)
    key = (names, group.natoms, group.dtypes_key)
    layout = _LAYOUTS.get(key)
    if layout is not None and layout.fits(first):
        return layout
    layout = _new_layout(group, first)
    if layout is not None:
        if len(_LAYOUTS) >= _LAYOUTS_LIMIT:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def _new_layout(group: StackTarget, first: dict[Any, Any]) -> _StackLayout | None:
    layout = _StackLayout()
    layout.names = first.keys()
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
        dtype = np.dtype(np.int64) if key == "atype" else group.dtypes.get(key, stored)
        layout.append((name, key, kind, shape, stored, per_frame, dtype, count * stored.itemsize))
    if not {"atype", "coord"} <= {step[1] for step in layout}:
        return None
    return layout


def _resolve(shape: tuple[int, ...], count: int) -> tuple[int, ...]:
    if -1 not in shape:
        if math.prod(shape) != count:
            raise ValueError("size")
        return shape
    rest = math.prod(s for s in shape if s != -1)
    if count % rest:
        raise ValueError("size")
    return tuple(count // rest if s == -1 else s for s in shape)


def _types_ok(group: StackTarget, blocks: dict[str, Any]) -> bool:
    """Atom counts match the group, ids are in range; remaps them in place."""
    atype = blocks["atype"]
    if atype.shape[1] != group.natoms or blocks["coord"].shape[1] != group.natoms:
        return False
    if "force" in blocks and blocks["force"].shape[1] != group.natoms:
        return False
    limit = group.ntypes if group.remap is None else len(group.remap)
    if atype.size and atype.max() >= limit:
        return False
    if group.remap is not None:
        real = atype >= 0
        atype[real] = group.remap[atype[real]]
    return True


def _requirements(group: StackTarget, blocks: dict[str, Any],
                  flags: dict[str, list[np.float32]], k: int) -> bool:
    """Resolve every requirement for the whole batch; ``False``: a ``must`` label is absent
    (the per-frame path names the frame)."""
    natoms = blocks["atype"].shape[1]
    for name, req in group.requirements.items():
        if name not in blocks and req.must:
            return False
        flag, blocks[name] = resolve_requirement(req, blocks.get(name), natoms, k)
        flags["find_" + name] = [flag]
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
