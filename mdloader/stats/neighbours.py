"""Neighbour statistics of training frames: the minimal pair distance and the maximal number of
neighbours within ``rcut``, exactly as DeePMD-kit's ``NeighborStat`` computes them.

DeePMD-kit compares every atom with every atom of a ghost-extended frame; here a vesin neighbour
list finds the candidate pairs and each pair's squared distance is recomputed from the
coordinates with DeePMD-kit's own floating-point formula, so the results are bit-identical.
DeePMD-kit's semantics that the statistics depend on, all reproduced:

* coordinates are not wrapped into the cell: the ghosts are the images ``n`` with
  ``|n_d| <= ceil(rcut / face distance_d)`` (the maximum over the frames DeePMD-kit evaluates
  in one batch), so a neighbour of an unwrapped atom beyond that range is not seen;
* a neighbour is counted when its squared distance is strictly below ``rcut**2``; counts are
  per neighbour type (types ``0 .. ntypes-1``; virtual atoms of type ``-1`` are never counted),
  or one total over types ``>= 0`` for mixed-type descriptors; every atom, virtual or not, is a
  centre, and an atom's own periodic images are its neighbours;
* the minimal distance is over every pair of the extended frame, also beyond ``rcut``.

:class:`NeighbourStats` merges by min of minima and max of maxima, which is what a collective
over ranks calls. :func:`min_nbor_dist` and :func:`resolve_sel` turn merged statistics into what
DeePMD-kit stores in the model (``min_nbor_dist``) and writes into the descriptor (``sel``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import vesin

from mdloader.errors import ConfigError, DataError, NonFiniteError
from mdloader.stats.frames import (
    CHUNK_ATOM_FRAMES,
    FramePlace,
    atom_file_order,
    frames_by_set,
    place_of,
    read_chunks,
)
from mdloader.stats.merging import merge_all

#: DeePMD-kit's neighbour statistics start from this squared distance (``min_nbor_dist = 100``).
DEEPMD_MIN_DIST2_START = 100.0
#: Atoms per batch of DeePMD-kit's neighbour statistics on a CPU (``AutoBatchSize`` default).
DEEPMD_BATCH_ATOMS = 1024
#: vesin searches a hair beyond ``rcut``; the exact ``< rcut**2`` test is made afterwards.
_SEARCH_MARGIN = 1e-6


class OverlappingAtomsError(DataError):
    """Two atoms (or an atom and a periodic image) sit at distance zero: training would
    produce NaN."""


class DegenerateBoxError(DataError):
    """A periodic frame's box has no positive volume (all zeros, flat, or left-handed)."""


@dataclass(frozen=True)
class Finding:
    """A warning-level fact about the data (not an error): where it is and what it is."""

    system: str
    file: str | None
    frame: int
    message: str

    def __str__(self) -> str:
        where = f"system: {self.system}" + (f"; file: {self.file}" if self.file else "")
        return f"{self.message}; {where}; frame {self.frame}"


@dataclass(frozen=True)
class NeighbourStats:
    """Minimal squared pair distance and maximal neighbour counts over some frames.

    ``max_neighbours`` has one entry per type, or a single total when ``mixed_type``.
    ``min_distance2`` is ``inf`` before any pair is seen. Merging is exact and associative.
    """

    rcut: float
    mixed_type: bool
    max_neighbours: tuple[int, ...]
    min_distance2: float = math.inf
    findings: tuple[Finding, ...] = field(default=(), compare=False)

    @classmethod
    def empty(cls, rcut: float, ntypes: int, mixed_type: bool) -> NeighbourStats:
        """The neutral element of :meth:`merge`."""
        return cls(float(rcut), bool(mixed_type), (0,) * (1 if mixed_type else int(ntypes)))

    @property
    def min_distance(self) -> float:
        return math.sqrt(self.min_distance2)

    def merge(self, other: NeighbourStats) -> NeighbourStats:
        """Statistics of the union of both frame sets (min of minima, max of maxima)."""
        if (self.rcut, self.mixed_type, len(self.max_neighbours)) != (
                other.rcut, other.mixed_type, len(other.max_neighbours)):
            raise ConfigError(
                "neighbour statistics of different settings cannot be merged: "
                f"rcut {self.rcut} / {other.rcut}, mixed_type {self.mixed_type} / "
                f"{other.mixed_type}, {len(self.max_neighbours)} / "
                f"{len(other.max_neighbours)} counts")
        return NeighbourStats(
            self.rcut, self.mixed_type,
            tuple(max(a, b) for a, b in zip(self.max_neighbours, other.max_neighbours)),
            min(self.min_distance2, other.min_distance2), self.findings + other.findings)


# -- what DeePMD-kit derives from the statistics -----------------------------------------------

def min_nbor_dist(stats: NeighbourStats) -> float:
    """DeePMD-kit's ``min_nbor_dist``: the minimal distance, capped at 10 (its start value)."""
    return math.sqrt(min(stats.min_distance2, DEEPMD_MIN_DIST2_START))


def auto_sel_ratio(sel: Any) -> float | None:
    """The ratio of ``"auto"`` (1.1) or ``"auto:R"``; ``None`` when ``sel`` is not automatic."""
    if not isinstance(sel, str) or sel.split(":")[0] != "auto":
        return None
    words = sel.split(":")
    if len(words) == 1:
        return 1.1
    if len(words) == 2:
        try:
            return float(words[1])
        except ValueError:
            pass
    raise ConfigError(f"invalid automatic sel {sel!r}: expected 'auto' or 'auto:<ratio>'")


def wrap_up_4(value: float) -> int:
    """The multiple of 4 at or above ``int(value)`` (DeePMD-kit's rounding of automatic sel)."""
    return 4 * ((int(value) + 3) // 4)


def resolve_sel(sel: int | Sequence[int] | str,
                stats: NeighbourStats) -> tuple[list[int], list[str]]:
    """DeePMD-kit's ``update_one_sel``: the ``sel`` list and the warnings it logs.

    ``"auto[:R]"`` gives ``wrap_up_4(int(max * R))`` per entry; an int becomes a one-entry list;
    a user list is kept, with a warning for every nonzero entry below the observed maximum.
    Mixed-type descriptors (DPA-1/2/3) then take the single entry ``sel[0]``.
    """
    observed = list(stats.max_neighbours)
    ratio = auto_sel_ratio(sel)
    if ratio is not None:
        return [int(wrap_up_4(n * ratio)) for n in observed], []
    chosen = [sel] if isinstance(sel, int) else list(sel)  # type: ignore[arg-type]
    warnings = [f"sel of type {i} is not enough! The expected value is not less than {t}, but "
                f"you set it to {d}. The accuracy of your model may get worse."
                for i, (t, d) in enumerate(zip(observed, chosen)) if d and t > d]
    return chosen, warnings


# -- computation ---------------------------------------------------------------------------------

def face_distances(cells: np.ndarray) -> np.ndarray:
    """Distances between opposite faces of each cell ``(nf, 3, 3)`` -> ``(nf, 3)``."""
    volume = np.linalg.det(cells)
    faces = [np.cross(cells[:, 1], cells[:, 2]), np.cross(cells[:, 2], cells[:, 0]),
             np.cross(cells[:, 0], cells[:, 1])]
    return np.stack([volume / np.linalg.norm(f, axis=-1) for f in faces], axis=1)


def image_range(cells: np.ndarray, rcut: float) -> np.ndarray:
    """DeePMD-kit's ghost images per direction for a batch of cells: ``max ceil(rcut / face)``."""
    return np.ceil(rcut / face_distances(cells)).astype(np.int64).max(axis=0)


def check_frames(coord: np.ndarray, cells: np.ndarray | None, place: FramePlace) -> None:
    """Raise on non-finite coordinates or boxes and on boxes without positive volume."""
    bad = ~np.isfinite(coord).all(axis=(1, 2))
    if bad.any():
        k = int(np.argmax(bad))
        raise NonFiniteError(f"coordinates of frame {place.frame(k)} are not finite",
                             system=place.system, file=place.file("coord", k),
                             expected="finite coordinates", found="NaN or infinity")
    if cells is None:
        return
    bad = ~np.isfinite(cells).all(axis=(1, 2))
    if bad.any():
        k = int(np.argmax(bad))
        raise NonFiniteError(f"the box of frame {place.frame(k)} is not finite",
                             system=place.system, file=place.file("box", k),
                             expected="a finite box", found=cells[k].reshape(-1).tolist())
    volume = np.linalg.det(cells)
    bad = ~(volume > 0)
    if bad.any():
        k = int(np.argmax(bad))
        what = ("is left-handed (negative determinant; DeePMD-kit's neighbour search needs "
                "right-handed box vectors: swap two of them)" if volume[k] < 0 else
                "has no volume (add an empty 'nopbc' file to the system if it is not periodic)")
        raise DegenerateBoxError(
            f"the box of frame {place.frame(k)} {what}", system=place.system,
            file=place.file("box", k), expected="box vectors (rows) with a positive determinant",
            found=f"volume {float(volume[k])!r}, box {cells[k].reshape(-1).tolist()}")


def pair_distance2(coord: np.ndarray, i: np.ndarray, j: np.ndarray, shifts: np.ndarray | None,
                   cell: np.ndarray | None) -> np.ndarray:
    """Squared distances of pairs ``(i, j + shifts)`` with DeePMD-kit's rounding.

    DeePMD-kit forms the ghost ``coord[j] + shift @ cell`` (the shift summed over the cell rows
    in order), subtracts ``coord[i]`` and sums the squares over x, y, z in order.
    """
    if shifts is None or cell is None:
        diff = coord[j] - coord[i]
    else:
        s = shifts.astype(coord.dtype)
        vec = s[:, 0:1] * cell[0] + s[:, 1:2] * cell[1] + s[:, 2:3] * cell[2]
        diff = (coord[j] + vec) - coord[i]
    return diff[:, 0] * diff[:, 0] + diff[:, 1] * diff[:, 1] + diff[:, 2] * diff[:, 2]


def _all_pairs_min(coord: np.ndarray, cell: np.ndarray | None,
                   nbuff: np.ndarray | None) -> tuple[float, tuple[int, int, tuple[int, ...]]]:
    """The minimal squared distance over every pair of the extended frame (DeePMD-kit's search
    when no pair lies within ``rcut``) and the pair ``(i, j, shift)``."""
    n = coord.shape[0]
    if cell is None or nbuff is None:
        shifts = np.zeros((1, 3), dtype=np.int64)
    else:
        axes = [np.arange(-b, b + 1) for b in nbuff]
        shifts = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)
    best, where = math.inf, (0, 0, (0, 0, 0))
    ii, jj = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    ii, jj = ii.reshape(-1), jj.reshape(-1)
    for shift in shifts:
        keep = (ii != jj) | bool(shift.any())
        if not keep.any():
            continue
        s = np.broadcast_to(shift, (int(keep.sum()), 3))
        rr2 = pair_distance2(coord, ii[keep], jj[keep], s if cell is not None else None, cell)
        k = int(np.argmin(rr2))
        if rr2[k] < best:
            best, where = float(rr2[k]), (int(ii[keep][k]), int(jj[keep][k]),
                                          tuple(int(v) for v in shift))
    return best, where


def frames_neighbour_stats(
    coord: np.ndarray, atype: np.ndarray, box: np.ndarray | None, rcut: float, ntypes: int,
    *, mixed_type: bool = False, batch_frames: int | None = None,
    place: FramePlace | None = None, threads: int = 1,
) -> NeighbourStats:
    """Neighbour statistics of frames of one set.

    Parameters
    ----------
    coord
        ``(nf, natoms, 3)`` (or ``(nf, natoms*3)``) float64 coordinates.
    atype
        ``(nf, natoms)`` model type ids (``-1`` for virtual atoms).
    box
        ``(nf, 9)`` box rows, or ``None`` for a non-periodic system.
    rcut, ntypes, mixed_type
        As DeePMD-kit's ``NeighborStat(ntypes, rcut, mixed_type)``.
    batch_frames
        Frames DeePMD-kit evaluates together; the periodic images searched are those its batch
        needs (``None``: all frames at once). :func:`system_neighbour_stats` passes DeePMD-kit's
        CPU batch.
    place
        Where the frames come from, named by errors and findings.
    threads
        vesin's threads.
    """
    place = place or FramePlace(system="<arrays>")
    stats, isolated = _scan(coord, atype, box, rcut, ntypes, mixed_type, batch_frames, place,
                            threads)
    return _with_finding(stats, isolated, len(coord))


@dataclass(frozen=True)
class _Isolated:
    """Frames with atoms without a neighbour: how many, and where the first one is."""

    frames: int
    system: str
    file: str | None
    frame: int
    atoms: int
    atom: int

    def then(self, later: _Isolated | None) -> _Isolated:
        """These frames followed by the ``later`` ones."""
        return self if later is None else replace(self, frames=self.frames + later.frames)


def _with_finding(stats: NeighbourStats, isolated: _Isolated | None, nf: int) -> NeighbourStats:
    """``stats`` with the finding of the ``isolated`` frames among ``nf`` frames."""
    if isolated is None:
        return stats
    return replace(stats, findings=(Finding(
        isolated.system, isolated.file, isolated.frame,
        f"{isolated.atoms} atom(s) have no neighbour within rcut {stats.rcut} (first: atom "
        f"{isolated.atom}); {isolated.frames} frame(s) of {nf} are affected, this is the "
        "first"),))


def _scan(coord: np.ndarray, atype: np.ndarray, box: np.ndarray | None, rcut: float,
          ntypes: int, mixed_type: bool, batch_frames: int | None, place: FramePlace,
          threads: int) -> tuple[NeighbourStats, _Isolated | None]:
    """:func:`frames_neighbour_stats` without the finding: the statistics and the frames with
    isolated atoms."""
    coord = np.asarray(coord, dtype=np.float64)
    nf = coord.shape[0]
    coord = coord.reshape(nf, -1, 3)
    atype = np.asarray(atype).reshape(nf, -1)
    cells = None if box is None else np.asarray(box, dtype=np.float64).reshape(nf, 3, 3)
    check_frames(coord, cells, place)
    rcut = float(rcut)
    stats = NeighbourStats.empty(rcut, ntypes, mixed_type)
    if nf == 0:
        return stats, None
    nlist = vesin.NeighborList(cutoff=rcut * (1 + _SEARCH_MARGIN), full_list=True,
                               n_threads=threads)
    step = nf if not batch_frames else max(int(batch_frames), 1)
    counts = np.zeros(len(stats.max_neighbours), dtype=np.int64)
    min2, isolated = math.inf, []
    for start in range(0, nf, step):
        nbuff = None if cells is None else image_range(cells[start:start + step], rcut)
        for k in range(start, min(start + step, nf)):
            cell = None if cells is None else cells[k]
            frame_min2, frame_counts, lonely = _one_frame(
                nlist, coord[k], atype[k], cell, nbuff, rcut, ntypes, mixed_type, place, k)
            counts = np.maximum(counts, frame_counts)
            min2 = min(min2, frame_min2)
            if lonely is not None:
                isolated.append((k, lonely))
    first = None
    if isolated:
        k, (count, atom) = isolated[0]
        first = _Isolated(len(isolated), place.system, place.file("coord", k), place.frame(k),
                          count, place.atom(atom))
    return replace(stats, max_neighbours=tuple(int(c) for c in counts),
                   min_distance2=min2), first


def _one_frame(nlist: Any, coord: np.ndarray, types: np.ndarray, cell: np.ndarray | None,
               nbuff: np.ndarray | None, rcut: float, ntypes: int, mixed_type: bool,
               place: FramePlace, k: int) -> tuple[float, np.ndarray, tuple[int, int] | None]:
    n = coord.shape[0]
    periodic = cell is not None
    i, j, shifts = nlist.compute(coord, cell if periodic else np.zeros((3, 3)), periodic, "ijS")
    i, j = i.astype(np.int64), j.astype(np.int64)
    if periodic:
        keep = (np.abs(shifts) <= nbuff).all(axis=1)
        i, j, shifts = i[keep], j[keep], shifts[keep]
    rr2 = pair_distance2(coord, i, j, shifts if periodic else None, cell)
    within = rr2 < rcut ** 2
    ci, tj = i[within], types[j[within]]
    if mixed_type:
        per_atom = np.bincount(ci[tj >= 0], minlength=n).reshape(n, 1)
    else:
        real = (tj >= 0) & (tj < ntypes)
        per_atom = np.bincount(ci[real] * ntypes + tj[real],
                               minlength=n * ntypes).reshape(n, ntypes)
    if rr2.size:
        p = int(np.argmin(rr2))
        min2 = float(rr2[p])
        pair = (int(i[p]), int(j[p]), tuple(int(v) for v in shifts[p]) if periodic else (0, 0, 0))
    else:
        min2, pair = _all_pairs_min(coord, cell, nbuff)
    if min2 == 0.0:
        a, b, shift = pair
        image = f" (periodic image {list(shift)})" if any(shift) else ""
        raise OverlappingAtomsError(
            f"atoms {place.atom(a)} and {place.atom(b)}{image} of frame {place.frame(k)} "
            "overlap; remove duplicated atoms from the data", system=place.system,
            file=place.file("coord", k), expected="distinct atom positions", found="distance 0")
    totals = np.bincount(ci, minlength=n)
    lonely = None
    if (totals == 0).any():
        lonely = (int((totals == 0).sum()), int(np.argmax(totals == 0)))
    return min2, per_atom.max(axis=0) if n else np.zeros(per_atom.shape[1], int), lonely


# -- on a dataset ------------------------------------------------------------------------------

def system_neighbour_stats(
    dataset: Any, rcut: float, ntypes: int | None = None, *, mixed_type: bool = False,
    frames: Sequence[int] | None = None, batch_atoms: int | None = DEEPMD_BATCH_ATOMS,
    threads: int = 1, chunk_atom_frames: int | None = CHUNK_ATOM_FRAMES,
) -> NeighbourStats:
    """Neighbour statistics of one system, read through a
    :class:`~mdloader.data.dataset.DeepmdDataSetForLoader`.

    ``ntypes`` defaults to the system's type count (DeePMD-kit uses
    ``max(len(type_map), data ntypes)``); ``frames`` restricts to some system frames.
    ``batch_atoms`` is DeePMD-kit's batch (frames of ``batch_atoms // natoms`` per batch within a
    set, which decides the images searched for unwrapped coordinates in boxes that change);
    ``None`` searches the images of a whole set at once, and so reads it at once.
    Frames are read ``chunk_atom_frames`` atom-frames at a time (whole DeePMD-kit batches;
    ``None``: a set at once); the result does not depend on it.
    """
    meta = dataset.meta
    ntypes = meta.ntypes if ntypes is None else int(ntypes)
    stats = NeighbourStats.empty(rcut, ntypes, mixed_type)
    atom_ids = atom_file_order(dataset)
    batch = None if not batch_atoms else max(int(batch_atoms) // max(meta.natoms, 1), 1)
    budget = chunk_atom_frames if batch else None
    parts = [stats]
    run: tuple[_Isolated | None, int] = (None, 0)  # a run's isolated frames and frame count
    for _set_name, set_fids in frames_by_set(dataset, frames):
        for fids, arrays, starts_run in read_chunks(dataset, set_fids, budget=budget,
                                                    align=batch or 1):
            if starts_run:  # a finding per run of frames, whatever the chunks
                parts.append(_with_finding(stats, *run))
                run = (None, 0)
            part, isolated = _scan(arrays["coord"], arrays["atype"], arrays["box"], rcut,
                                   ntypes, mixed_type, batch, place_of(dataset, fids, atom_ids),
                                   threads)
            parts.append(part)
            run = (isolated if run[0] is None else run[0].then(isolated), run[1] + len(fids))
    parts.append(_with_finding(stats, *run))
    return merge_all(parts)
