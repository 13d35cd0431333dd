"""Reading the frames statistics need (coordinates, types, boxes) through mdloader's public
dataset API, grouped by set, with what error messages name: system, file, frame and atom."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mdloader.errors import ConfigError


@dataclass(frozen=True)
class FramePlace:
    """Where frames come from, for messages: the system, its coord/box files, the system frame
    index of each frame, and the file-order index of each (type-sorted) atom."""

    system: str
    coord_file: str | None = None
    box_file: str | None = None
    frame_ids: np.ndarray | None = None
    atom_ids: np.ndarray | None = None

    def frame(self, k: int) -> int:
        return int(self.frame_ids[k]) if self.frame_ids is not None else k

    def atom(self, p: int) -> int:
        return int(self.atom_ids[p]) if self.atom_ids is not None else p


def set_spans(dataset: Any) -> list[tuple[str, int, int]]:
    """``(set name, first system frame, end)`` of every set of a dataset's system."""
    spans, start = [], 0
    for s in dataset.meta.sets:
        spans.append((s.name, start, start + s.nframes))
        start += s.nframes
    return spans


def file_of(dataset: Any, set_name: str, name: str, fid: int = 0) -> str:
    """The file (or database entry) a message should name for ``name`` of frame ``fid`` in a set
    of the dataset's system, as its format says."""
    from mdloader.data.formats import backend_of

    meta = dataset.meta
    return backend_of(meta.location).frame_file(meta, name.removesuffix(".npy"), fid) \
        or meta.address


def read_frames(dataset: Any, fids: np.ndarray) -> list[tuple[np.ndarray, dict[str, Any]]]:
    """Runs of consecutive frames ``fids`` that agree on having a box: ``(fids, {"coord":
    (k, natoms, 3), "atype": (k, natoms), "box": (k, 9) or None})``, in DeePMD-kit's (type-sorted)
    atom order. A frame stored without a cell (an LMDB frame of a molecule) is non-periodic, as
    DeePMD-kit reads it."""
    frames = dataset.get_frames([int(f) for f in fids])
    periodic = [bool(dataset.meta.pbc) and f.get("box") is not None for f in frames]
    runs = []
    lo = 0
    for hi in range(1, len(frames) + 1):
        if hi < len(frames) and periodic[hi] == periodic[lo]:
            continue
        part = frames[lo:hi]
        runs.append((np.asarray(fids[lo:hi]), {
            "coord": np.stack([np.asarray(f["coord"], dtype=np.float64) for f in part]),
            "atype": np.stack([np.asarray(f["atype"], dtype=np.int64) for f in part]),
            "box": (np.stack([np.asarray(f["box"], dtype=np.float64) for f in part])
                    if periodic[lo] else None)}))
        lo = hi
    return runs


def atom_file_order(dataset: Any) -> np.ndarray:
    """File-order index of each atom in DeePMD-kit's type-sorted order."""
    return np.argsort(np.asarray(dataset.meta.atom_types), kind="stable")


def frames_by_set(dataset: Any, frames: Sequence[int] | None) -> list[tuple[str, np.ndarray]]:
    """The requested system frames (all when ``None``), grouped by set, sorted."""
    n = len(dataset)
    fids = np.arange(n) if frames is None else np.unique(np.asarray(frames, dtype=np.int64))
    if fids.size and (fids[0] < 0 or fids[-1] >= n):
        raise ConfigError(f"frame ids out of range [0, {n}) for system {dataset.meta.address}: "
                          f"{fids[(fids < 0) | (fids >= n)][:5].tolist()}")
    out = []
    for name, lo, hi in set_spans(dataset):
        mine = fids[(fids >= lo) & (fids < hi)]
        if mine.size:
            out.append((name, mine))
    return out
