"""An LMDB database's ``__metadata__``, read and checked once, on rank 0.

Every problem that can be seen without decoding frames is a typed error naming the database and
the entry: no ``__metadata__``, an entry that is not msgpack, ``nframes`` that disagrees with
the entries or with ``frame_nlocs``/``frame_system_ids``, a missing frame. When ``frame_nlocs``
is absent, every frame is read once for its atom count (DeePMD-kit does this on every rank);
:func:`scanned_frames` counts those reads in this process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from mdloader.data.formats.lmdb import codec, environment
from mdloader.data.formats.lmdb.environment import (
    DEFAULT_FRAME_FORMAT,
    METADATA_KEY,
    entry_of,
    frame_key,
)
from mdloader.errors import CorruptFileError, DataError, MissingDataError, ShapeError

log = logging.getLogger(__name__)

_SCANNED = [0]


@dataclass(frozen=True)
class Metadata:
    """What the description needs: counts, key format, element names, per-frame tables."""

    nframes: int
    frame_format: str
    type_map: tuple[str, ...] | None
    frame_nlocs: np.ndarray
    frame_system_ids: np.ndarray | None
    scanned: bool  # frame_nlocs was missing and came from reading every frame
    system_natoms: int = 0  # atoms of ``system_info`` (0 when absent): DeePMD-kit's nominal size


def scanned_frames() -> int:
    """Frames this process has read to learn their atom count (``frame_nlocs`` missing)."""
    return _SCANNED[0]


def read_metadata(path: str) -> Metadata:
    """Read and check ``__metadata__`` of the database at ``path``."""
    where = entry_of(path, METADATA_KEY)
    with environment.metadata_view(path) as (txn, entries):
        raw = txn.get(METADATA_KEY)
        if raw is None:
            raise MissingDataError("the LMDB database has no __metadata__ entry (not a DeePMD "
                                   "database, or its writer did not finish)", system=path,
                                   file=where)
        meta = _str_keys(codec.unpack(raw, "the __metadata__ entry", path, METADATA_KEY))
        if not isinstance(meta, dict):
            raise CorruptFileError("__metadata__ is not a map", system=path, file=where,
                                   found=type(meta).__name__)
        nframes = _count(meta, path)
        fmt = _frame_format(meta, path)
        _check_entries(txn, entries, path, nframes, fmt)
        type_map = _names(meta.get("type_map"), path)
        sids = _per_frame(meta, "frame_system_ids", nframes, path, minimum=0)
        nlocs = _per_frame(meta, "frame_nlocs", nframes, path, minimum=1)
        scanned = nlocs is None
        fallback = _fallback_natoms(meta)
        if nlocs is None:
            nlocs = _scan_nlocs(txn, path, nframes, fmt, fallback)
    return Metadata(nframes, fmt, type_map, nlocs, sids, scanned, fallback or 0)


def _str_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k.decode() if isinstance(k, bytes) else k: v for k, v in value.items()}
    return value


def _count(meta: dict[str, Any], path: str) -> int:
    value = meta.get("nframes")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CorruptFileError("__metadata__ needs nframes, a positive integer", system=path,
                               file=entry_of(path, METADATA_KEY), found=repr(value))
    return value


def _frame_format(meta: dict[str, Any], path: str) -> str:
    fmt = meta.get("frame_idx_fmt", DEFAULT_FRAME_FORMAT)
    try:
        frame_key(0, fmt)
    except (TypeError, ValueError) as exc:
        raise CorruptFileError("__metadata__ holds an unusable frame_idx_fmt", system=path,
                               file=entry_of(path, METADATA_KEY), expected="e.g. '012d'",
                               found=repr(fmt)) from exc
    return fmt


def _check_entries(txn: Any, entries: int, path: str, nframes: int, fmt: str) -> None:
    """``nframes`` frames plus ``__metadata__``; the first and the last frame are present."""
    if entries == nframes + 1:
        for index in (0, nframes - 1):
            if txn.get(frame_key(index, fmt)) is None:
                _missing(path, index, fmt, nframes)
        return
    for index in range(nframes):  # only on the way to an error: name the first missing frame
        if txn.get(frame_key(index, fmt)) is None:
            _missing(path, index, fmt, nframes)
    raise ShapeError("the database holds more entries than __metadata__ announces",
                     system=path, file=entry_of(path, METADATA_KEY),
                     expected=f"{nframes} frames + __metadata__ = {nframes + 1} entries",
                     found=f"{entries} entries")


def _missing(path: str, index: int, fmt: str, nframes: int) -> None:
    key = frame_key(index, fmt)
    raise MissingDataError(f"frame {index} is missing although nframes is {nframes}",
                           system=path, file=entry_of(path, key))


def _names(value: Any, path: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise CorruptFileError("type_map in __metadata__ must be a list of element names",
                               system=path, file=entry_of(path, METADATA_KEY),
                               found=repr(value)[:200])
    return tuple(value)


def _per_frame(meta: dict[str, Any], name: str, nframes: int, path: str,
               minimum: int) -> np.ndarray | None:
    value = meta.get(name)
    if value is None:
        return None
    where = entry_of(path, METADATA_KEY)
    try:
        table = np.asarray(value, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CorruptFileError(f"{name} in __metadata__ must be a list of integers",
                               system=path, file=where, found=str(exc)) from exc
    if len(table) != nframes:
        raise ShapeError(f"{name} in __metadata__ disagrees with nframes", system=path,
                         file=where, expected=f"{nframes} entries", found=f"{len(table)}")
    bad = np.flatnonzero(table < minimum)
    if len(bad):
        raise DataError(f"{name} in __metadata__ holds {int(table[bad[0]])} for frame "
                        f"{int(bad[0])}", system=path, file=where,
                        expected=f"values >= {minimum}")
    return table.astype(np.int32)


def _fallback_natoms(meta: dict[str, Any]) -> int | None:
    """DeePMD-kit's fallback for frames without ``atom_types``: ``system_info``'s natoms."""
    info = meta.get("system_info")
    info = info[0] if isinstance(info, list) and info else info
    counts = info.get("natoms") if isinstance(info, dict) else None
    if not counts:
        return None
    return int(sum(int(np.asarray(codec.decode_array(c) if codec.is_encoded_array(c) else c))
                   for c in counts))


def _scan_nlocs(txn: Any, path: str, nframes: int, fmt: str, fallback: int | None) -> np.ndarray:
    """Atoms of every frame from its ``atom_types`` (the one read of all frames, rank 0).

    With zero-padded keys the frames are read with a cursor, in key order: sequential pages.
    """
    log.info("%s: __metadata__ has no frame_nlocs; reading the atom count of its %d frames once "
             "(mdloader pack writes it)", path, nframes)
    nlocs = np.empty(nframes, dtype=np.int32)
    if fmt == DEFAULT_FRAME_FORMAT:
        entries = iter(txn.cursor())
    else:
        entries = ((frame_key(i, fmt), txn.get(frame_key(i, fmt))) for i in range(nframes))
    for index in range(nframes):
        key, raw = next(entries, (None, None))
        expected = frame_key(index, fmt)
        if raw is None or bytes(key) != expected:
            _missing(path, index, fmt, nframes)
        nlocs[index] = _atoms(codec.unpack(raw, f"frame {index}", path, expected), fallback,
                              path, expected, index)
    _SCANNED[0] += nframes
    return nlocs


def _atoms(record: Any, fallback: int | None, path: str, key: bytes, index: int) -> int:
    """A frame's atom count: the length of its ``atom_types``, else the metadata's fallback."""
    types = record.get("atom_types") if isinstance(record, dict) else None
    if codec.is_encoded_array(types):
        shape = types.get("shape", types.get(b"shape"))
        if shape:
            count = int(shape[0])
        else:
            count = len(types.get("data", b"")) // np.dtype(types.get("type", "int32")).itemsize
    elif isinstance(types, (list, tuple)):
        count = len(types)
    elif fallback:
        count = fallback
    else:
        raise MissingDataError(f"frame {index} has no atom_types, and __metadata__ has neither "
                               "frame_nlocs nor system_info", system=path,
                               file=entry_of(path, key))
    if count < 1:
        raise DataError(f"frame {index} has no atoms", system=path, file=entry_of(path, key))
    return count
