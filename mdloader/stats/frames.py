"""Reading the frames statistics need (coordinates, types, boxes) through mdloader's public
dataset API, grouped by set and read in chunks of bounded size, with what error messages name:
system, file, frame and atom."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mdloader.errors import ConfigError

#: Atom-frames a statistics pass reads at once (2**18: 6 MiB of float64 coordinates, a few
#: times that while read), so its memory is bounded by one chunk, not by a set of 10**5 frames.
CHUNK_ATOM_FRAMES = 2 ** 18


@dataclass(frozen=True)
class FramePlace:
    """Where frames come from, for messages: the system, the file of each frame's coordinates
    and box, the system frame index of each frame, and the file-order index of each
    (type-sorted) atom.

    ``files(name, fid)`` names the file (or database entry) holding ``name`` (``"coord"``,
    ``"box"``) of system frame ``fid``; without it, ``coord_file`` and ``box_file`` hold for
    every frame.
    """

    system: str
    coord_file: str | None = None
    box_file: str | None = None
    frame_ids: np.ndarray | None = None
    atom_ids: np.ndarray | None = None
    files: Callable[[str, int], str | None] | None = None

    def frame(self, k: int) -> int:
        return int(self.frame_ids[k]) if self.frame_ids is not None else k

    def atom(self, p: int) -> int:
        return int(self.atom_ids[p]) if self.atom_ids is not None else p

    def file(self, name: str, k: int) -> str | None:
        """The file holding ``name`` (``"coord"`` or ``"box"``) of the ``k``-th frame."""
        if self.files is not None:
            return self.files(name, self.frame(k))
        return self.coord_file if name == "coord" else self.box_file


def place_of(dataset: Any, fids: np.ndarray, atom_ids: np.ndarray | None = None) -> FramePlace:
    """The place of the system frames ``fids`` of a dataset, each frame's file named by its
    format (a set's file, an LMDB frame's own entry)."""
    return FramePlace(dataset.meta.address, frame_ids=np.asarray(fids), atom_ids=atom_ids,
                      files=lambda name, fid: file_of(dataset, name, fid))


def set_spans(dataset: Any) -> list[tuple[str, int, int]]:
    """``(set name, first system frame, end)`` of every set of a dataset's system."""
    spans, start = [], 0
    for s in dataset.meta.sets:
        spans.append((s.name, start, start + s.nframes))
        start += s.nframes
    return spans


def file_of(dataset: Any, name: str, fid: int = 0) -> str:
    """The file (or database entry) a message should name for ``name`` of system frame ``fid``
    of the dataset's system, as its format says."""
    from mdloader.data.formats.diagnostics import position_file

    meta = dataset.meta
    return position_file(meta, name.removesuffix(".npy"), fid) or meta.address


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


def chunk_frames(natoms: int, budget: int | None, align: int = 1) -> int | None:
    """Frames read at once: as many whole ``align``-frame batches as ``budget`` atom-frames
    hold, at least one batch; ``None`` (no budget): all at once."""
    if budget is None:
        return None
    align = max(int(align), 1)
    return max(int(budget) // (max(int(natoms), 1) * align), 1) * align


def read_chunks(dataset: Any, fids: np.ndarray, *, budget: int | None = CHUNK_ATOM_FRAMES,
                align: int = 1) -> Iterator[tuple[np.ndarray, dict[str, Any], bool]]:
    """The runs of :func:`read_frames` over ``fids`` (sorted frames of one set), read at most
    ``budget`` atom-frames (rounded down to whole batches of ``align`` frames) at a time.

    Yields ``(fids, arrays, starts_run)`` in order; the pieces of one run joined are the run.
    A piece that does not end its run holds whole ``align``-frame batches counted from the
    run's first frame (a run's last incomplete batch waits for the next read), so work done per
    batch within a piece is the work done per batch over the whole run. A piece's ``arrays``
    are emptied when the next piece is asked for, so that one chunk at a time is in memory.
    """
    fids = np.asarray(fids, dtype=np.int64)
    align = max(int(align), 1)
    step = chunk_frames(dataset.meta.natoms, budget, align) or max(len(fids), 1)
    open_run = None  # (fids, arrays, starts_run) of the last run read, which may go on
    for lo in range(0, len(fids), step):
        runs = [(f, a, True) for f, a in read_frames(dataset, fids[lo:lo + step])]
        if open_run is not None:
            if (open_run[1]["box"] is None) == (runs[0][1]["box"] is None):
                runs[0] = (*_joined(open_run[:2], runs[0][:2]), open_run[2])
            elif len(open_run[0]):
                runs.insert(0, open_run)
            open_run = None
        if lo + step < len(fids):  # the last run may go on in the next read
            run_fids, arrays, starts = runs.pop()
            whole = len(run_fids) // align * align  # its incomplete batch waits, copied
            if whole:
                runs.append((run_fids[:whole], _rows(arrays, slice(0, whole)), starts))
            open_run = (run_fids[whole:], _rows(arrays, slice(whole, None), copy=True),
                        starts and not whole)
            del arrays
        for piece in runs:
            yield piece
            piece[1].clear()  # the caller is done with it


def _rows(arrays: dict[str, Any], rows: slice, copy: bool = False) -> dict[str, Any]:
    return {k: None if v is None else (v[rows].copy() if copy else v[rows])
            for k, v in arrays.items()}


def _joined(first: tuple[np.ndarray, dict[str, Any]], then: tuple[np.ndarray, dict[str, Any]]
            ) -> tuple[np.ndarray, dict[str, Any]]:
    return (np.concatenate([first[0], then[0]]),
            {k: None if v is None else np.concatenate([v, then[1][k]])
             for k, v in first[1].items()})
