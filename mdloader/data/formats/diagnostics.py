"""``check``'s deep check and notes, the box check before training, and the file a message
names for a frame: the format's own (:class:`~mdloader.data.formats.capabilities.Diagnostics`)
or, for a format without them, a default that reads through its reader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from mdloader.data.formats.capabilities import Diagnostics, has
from mdloader.data.formats.registry import backend_of
from mdloader.errors import DataError

if TYPE_CHECKING:
    from mdloader.data.formats.base import SystemMeta

#: Frames read at once by the default deep check and box check (bounds memory on large systems).
DEEP_CHUNK = 1024
SHOWN = 10  # frames named per problem


def nonfinite_rows(block: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``block`` holding NaN/inf (none for integer data)."""
    if block.dtype.kind not in "fc":
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(~np.isfinite(block.reshape(len(block), -1)).all(axis=1))


def deep_check(meta: SystemMeta) -> list[str]:
    """Every problem found by reading every frame (``check --deep``): the format's own check,
    else unreadable frames and NaN/inf values per key, read through the reader."""
    backend = backend_of(meta.location)
    if has(backend, Diagnostics):
        return backend.deep_check(meta)
    reader = backend.reader(meta, ())
    found: list[str] = []
    bad: dict[str, list[int]] = {}
    for lo in range(0, meta.nframes, DEEP_CHUNK):
        fids = list(range(lo, min(meta.nframes, lo + DEEP_CHUNK)))
        try:
            frames = reader.frames(fids)
        except DataError as exc:
            found.append(str(exc))
            continue
        for fid, frame in zip(fids, frames):
            for key, value in frame.items():
                arr = np.asarray(value) if value is not None else None
                if arr is not None and arr.dtype.kind in "fc" and not np.isfinite(arr).all():
                    bad.setdefault(key, []).append(fid)
    for key, fids in bad.items():
        more = f" and {len(fids) - SHOWN} more" if len(fids) > SHOWN else ""
        found.append(f"NaN/inf in '{key}' of {meta.address}: {len(fids)} frame(s), frames "
                     f"{fids[:SHOWN]}{more}")
    return found


def layout_notes(meta: SystemMeta) -> list[str]:
    """Lines ``check`` prints about how the system is read (none by default)."""
    backend = backend_of(meta.location)
    return backend.notes(meta) if has(backend, Diagnostics) else []


def frame_file(meta: SystemMeta, key: str, fid: int) -> str | None:
    """The file (or entry) holding ``key`` of the frame whose ``fid`` is ``fid`` (what a read
    frame carries), for messages; ``None`` when the format does not say."""
    backend = backend_of(meta.location)
    return backend.frame_file(meta, key, fid) if has(backend, Diagnostics) else None


def position_file(meta: SystemMeta, key: str, position: int) -> str | None:
    """As :func:`frame_file` for the frame at ``position`` among the system's frames (for an
    LMDB group, its database frame, not the group's first frames)."""
    backend = backend_of(meta.location)
    if not has(backend, Diagnostics):
        return None
    fid = backend.reader(meta, ()).fids([position])[0]
    return backend.frame_file(meta, key, fid)


def box_blocks(meta: SystemMeta) -> Iterator[tuple[str | None, int, np.ndarray]]:
    """(file, first frame id, ``(n, 9)`` boxes) for every stored block of a periodic system,
    for the box check before training: the format's own, else read through the reader."""
    backend = backend_of(meta.location)
    if has(backend, Diagnostics):
        yield from backend.box_blocks(meta)
        return
    from mdloader.data.schema import DataRequirementItem

    reader = backend.reader(meta, (DataRequirementItem("box", 9, must=True),))
    for lo in range(0, meta.nframes, DEEP_CHUNK):
        fids = list(range(lo, min(meta.nframes, lo + DEEP_CHUNK)))
        boxes = np.stack([np.asarray(f["box"], dtype=np.float64).reshape(9)
                          for f in reader.frames(fids)])
        yield None, lo, boxes
