"""The file of a system index: a versioned header, a checksum, and the descriptions in columns.

Layout: ``MDLINDEX``, the format number, the lengths of the three parts that follow and the
SHA-256 of those parts; then a small JSON header (what was indexed, by which mdloader, when:
enough for ``mdloader index inspect``), a JSON body (the table's small lookup tables and what
the freshness check needs) and the table's columns as raw little-endian arrays. Nothing is
unpickled, so an index file from someone else cannot run code.

A file is written atomically (:func:`mdloader.persist.write_atomic`): a reader sees the old file
or the new one, never a part of either, and a writer killed half-way leaves only a temporary
file, which the next writer removes. A start that uses an index marks it used
(:func:`mdloader.catalog.index.load`), for ``mdloader cache``.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mdloader.catalog.table import SystemTable, TableBuilder
from mdloader.data.formats import get_backend
from mdloader.data.formats.base import SetMeta, restore_set
from mdloader.persist import write_atomic

MAGIC = b"MDLINDEX"
FORMAT = 3  # 3: each row names its storage format (backend_id)
_HEAD = struct.Struct("<8sIIIQ32s")  # magic, format, header, body and blob lengths, sha256


class IndexFileError(Exception):
    """An index file cannot be used; the message says why (for one warning line)."""


@dataclass
class SavedIndex:
    """What an index file holds besides its header.

    ``since_ns``: when the build that made it started (files changed later are stale);
    ``walked``: folders the walk listed that are not indexed systems (``True``: a system left
    out by the patterns); ``files``: HDF5 files listed;
    ``globs``: each pattern entry's matches; ``partial``: systems of a backend whose description
    a file does not hold (LMDB groups, described from their database's metadata) were left out,
    so they are described at every start.
    """

    table: SystemTable
    since_ns: int
    walked: dict[str, bool] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    globs: dict[str, list[str]] = field(default_factory=dict)
    partial: bool = False


def write_index(path: str, saved: SavedIndex, header: dict[str, Any]) -> None:
    """Write ``saved`` to ``path`` atomically (:func:`mdloader.persist.write_atomic`)."""
    head, body, blob = _encode(saved, header)
    digest = hashlib.sha256(head + body + blob).digest()
    fixed = _HEAD.pack(MAGIC, FORMAT, len(head), len(body), len(blob), digest)
    write_atomic(path, fixed + head + body + blob)


def open_index(path: str) -> Any:
    """``path`` opened for reading without blocking on it: a FIFO, a device or a folder at the
    index path is an :class:`IndexFileError` (a FIFO would block the read, and the job, forever).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "not a regular file")
        raise IndexFileError(f"the index path {path} is {kind}, not an index file")
    return os.fdopen(fd, "rb")


def read_header(path: str) -> dict[str, Any]:
    """The JSON header alone (no checksum over the rest): for ``mdloader index inspect``."""
    with open_index(path) as fh:
        fixed = fh.read(_HEAD.size)
        _, head_len, _, _ = _check_fixed(fixed, path, None)
        return _json(fh.read(head_len), path, "header")


def read_index(path: str) -> tuple[dict[str, Any], SavedIndex]:
    """(header, contents) of the index at ``path``; :class:`IndexFileError` says what is wrong.

    ``FileNotFoundError`` passes through: no index is not a fault.
    """
    with open_index(path) as fh:
        data = fh.read()
    fixed = data[:_HEAD.size]
    digest, head_len, body_len, blob_len = _check_fixed(fixed, path, len(data))
    rest = memoryview(data)[_HEAD.size:]
    if hashlib.sha256(rest).digest() != digest:
        raise IndexFileError(f"the index {path} is corrupt (its checksum does not match)")
    header = _json(rest[:head_len], path, "header")
    body = _json(rest[head_len:head_len + body_len], path, "body")
    blob = rest[head_len + body_len:]
    try:
        return header, _decode(body, blob)
    except (KeyError, TypeError, ValueError) as exc:
        raise IndexFileError(f"the index {path} cannot be read ({type(exc).__name__}: {exc})"
                             ) from exc


def _check_fixed(fixed: bytes, path: str, size: int | None) -> tuple[bytes, int, int, int]:
    if len(fixed) < _HEAD.size or not fixed.startswith(MAGIC):
        raise IndexFileError(f"{path} is not an mdloader index (or is truncated)")
    _, version, head_len, body_len, blob_len, digest = _HEAD.unpack(fixed)
    if version != FORMAT:
        raise IndexFileError(f"the index {path} has format {version}; this mdloader reads "
                             f"format {FORMAT}")
    if size is not None and size != _HEAD.size + head_len + body_len + blob_len:
        raise IndexFileError(f"the index {path} is truncated ({size} bytes, expected "
                             f"{_HEAD.size + head_len + body_len + blob_len})")
    return digest, head_len, body_len, blob_len


def _json(raw: bytes | memoryview, path: str, part: str) -> Any:
    try:
        return json.loads(bytes(raw))
    except ValueError as exc:
        raise IndexFileError(f"the {part} of the index {path} is not valid JSON") from exc


def _storable(table: SystemTable) -> tuple[SystemTable, bool]:
    """The rows a file holds (systems of a format whose descriptions may be stored, described by
    sets), and whether some were left out (they are described again at every start)."""
    sets = table.parts()["sets"]
    other = {i for i, s in enumerate(sets) if not isinstance(s, SetMeta)}
    keep = [not other.intersection(table.set_ids(row).tolist()) if other else True
            for row in range(len(table))]
    indexable = np.zeros(len(table), dtype=bool)
    for name, rows in table.rows_by_backend().items():
        indexable[rows] = get_backend(name).indexable
    keep = [k and bool(i) for k, i in zip(keep, indexable.tolist())]
    if all(keep):
        return table, False
    builder = TableBuilder()
    for row in np.flatnonzero(keep).tolist():
        builder.add_row(table, row)
    return builder.table(), True


def _encode(saved: SavedIndex, header: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
    table, partial = _storable(saved.table)
    parts = table.parts()
    columns, offset, chunks = [], 0, []
    for name, array in parts["columns"].items():
        raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        columns.append([name, array.dtype.newbyteorder("<").str, len(array), offset])
        chunks.append(raw + bytes(-len(raw) % 8))  # aligned columns
        offset += len(raw) + (-len(raw) % 8)
    chunks.append(parts["names"])
    body = {"columns": columns, "names": [offset, len(parts["names"])],
            "folders": list(parts["folders"]), "type_maps": _lists(parts["type_maps"]),
            "sets": [[s.name, s.nframes, list(s.keys), list(s.widths)] for s in parts["sets"]],
            "idx_maps": _lists(parts["idx_maps"]), "backends": list(parts["backends"]),
            "since_ns": saved.since_ns,
            "walked": saved.walked, "files": saved.files,
            "globs": saved.globs, "partial": partial or saved.partial}
    return (json.dumps(header).encode(), json.dumps(body).encode(), b"".join(chunks))


def _lists(values: tuple[Any, ...]) -> list[Any]:
    return [None if v is None else list(v) for v in values]


def _tuples(values: list[Any]) -> tuple[Any, ...]:
    return tuple(None if v is None else tuple(v) for v in values)


def _decode(body: dict[str, Any], blob: memoryview) -> SavedIndex:
    columns = {name: np.frombuffer(blob, dtype=np.dtype(dtype), count=count, offset=offset)
               for name, dtype, count, offset in body["columns"]}
    start, length = body["names"]
    sets: tuple[SetMeta, ...] = tuple(restore_set(name, int(nframes), tuple(keys), tuple(widths))
                                      for name, nframes, keys, widths in body["sets"])
    table = SystemTable.from_parts(
        columns=columns, names=bytes(blob[start:start + length]),
        folders=tuple(body["folders"]), type_maps=_tuples(body["type_maps"]), sets=sets,
        idx_maps=_tuples(body["idx_maps"]), backends=tuple(body["backends"]))
    return SavedIndex(table, int(body["since_ns"]), dict(body["walked"]), list(body["files"]),
                      {k: list(v) for k, v in body["globs"].items()},
                      bool(body["partial"]))
