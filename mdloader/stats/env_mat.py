"""Descriptor environment-matrix statistics (``davg``/``dstd``) as sums that merge by addition.

DeePMD-kit's ``EnvMatStatSe`` (used by se_e2_a, se_atten/DPA-1, DPA-2's repinit and repformer
and DPA-3's repflow blocks) keeps, per centre type ``t``, a ``StatItem`` (number, sum, squared
sum) of the radial column ``r_t`` and of the three angular columns ``a_t`` of the environment
matrix with zero mean and unit deviation. Its semantics, reproduced here with a vesin
neighbour list instead of its all-pairs one:

* coordinates are wrapped into the cell first; a neighbour is kept when its distance is at most
  ``rcut`` (``rr > rcut`` is dropped); virtual atoms (type ``-1``) are neither centres nor
  neighbours;
* each centre keeps its ``sum(sel)`` nearest neighbours; with per-type ``sel`` (not mixed
  type) it then keeps, of those, the first ``sel[t]`` of each type ``t`` in order of distance;
* the row of a kept neighbour is ``sw(r) * (1/(r+p), d/(r+p)**2)`` with DeePMD-kit's quintic
  switch between ``rcut_smth`` and ``rcut`` and ``p = env_protection``; excluded type pairs
  give zero rows;
* every slot counts, empty ones included: ``number`` of ``r_t`` is (centres of type ``t``) x
  ``sum(sel)``, of ``a_t`` three times that;
* ``davg`` is ``sum / number`` (0 without data) in the radial column, zero elsewhere;
  ``dstd`` is ``sqrt(max(sq/n - (s/n)**2, 0))`` raised to at least 1e-2 (0.1 without data).

Sums are accumulated in float64: per frame with ``numpy.sum``, then frame after frame, then
system after system in the order given to :func:`~mdloader.stats.merging.merge_all`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import vesin

from mdloader.errors import ConfigError
from mdloader.stats.frames import (
    CHUNK_ATOM_FRAMES,
    FramePlace,
    frames_by_set,
    place_of,
    read_chunks,
)
from mdloader.stats.merging import merge_all
from mdloader.stats.neighbours import check_frames

#: ``StatItem.compute_std``'s default (no data) and protection (lower bound).
DEFAULT_STD = 1e-1
STD_PROTECTION = 1e-2


@dataclass(frozen=True)
class EnvMatSettings:
    """What the statistics depend on: one descriptor block's cut-offs, ``sel`` and types.

    ``sel`` is per type (``mixed_types=False``, se_e2_a) or a one-entry list of the total
    (``mixed_types=True``: se_atten/DPA-1, DPA-2 repinit/repformer, DPA-3 repflow).
    ``radial_only`` is se_e2_r's one-column matrix.
    """

    rcut: float
    rcut_smth: float
    sel: tuple[int, ...]
    ntypes: int
    mixed_types: bool = False
    env_protection: float = 0.0
    radial_only: bool = False
    exclude_types: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.rcut_smth < self.rcut:
            raise ConfigError(f"rcut_smth must be below rcut, got rcut_smth={self.rcut_smth} "
                              f"and rcut={self.rcut}")
        if not self.mixed_types and len(self.sel) != self.ntypes:
            raise ConfigError(f"a per-type sel needs one entry per type: {self.ntypes} types, "
                              f"sel={list(self.sel)}")
        if self.mixed_types and len(self.sel) != 1:
            raise ConfigError(f"a mixed-type descriptor has one sel, got {list(self.sel)}")

    @property
    def nsel(self) -> int:
        return int(sum(self.sel))

    @property
    def ncol(self) -> int:
        return 1 if self.radial_only else 4


@dataclass(frozen=True)
class EnvMatSums:
    """Per centre type: number, sum and squared sum of the radial (``r``) and angular (``a``)
    columns, each of shape ``(ntypes, 2)`` (column 0: ``r``, column 1: ``a``)."""

    number: np.ndarray
    total: np.ndarray
    squared: np.ndarray
    frames: int = field(default=0, compare=False)

    @classmethod
    def zeros(cls, ntypes: int) -> EnvMatSums:
        z = np.zeros((ntypes, 2))
        return cls(z, z.copy(), z.copy())

    def merge(self, other: EnvMatSums) -> EnvMatSums:
        if self.number.shape != other.number.shape:
            raise ConfigError(f"environment statistics of {self.number.shape[0]} and "
                              f"{other.number.shape[0]} types cannot be merged")
        return EnvMatSums(self.number + other.number, self.total + other.total,
                          self.squared + other.squared, self.frames + other.frames)

    def items(self) -> dict[str, tuple[float, float, float]]:
        """DeePMD-kit's stat-file items: ``r_t``/``a_t`` -> (number, sum, squared sum)."""
        out = {}
        for t in range(self.number.shape[0]):
            for c, name in enumerate(("r", "a")):
                out[f"{name}_{t}"] = (float(self.number[t, c]), float(self.total[t, c]),
                                      float(self.squared[t, c]))
        return out


def smooth_weight(r: np.ndarray, rmin: float, rmax: float) -> np.ndarray:
    """DeePMD-kit's quintic switch: 1 below ``rmin``, 0 above ``rmax``, C2 in between."""
    u = (np.clip(r, rmin, rmax) - rmin) / (rmax - rmin)
    u2 = u * u
    return u2 * u * (-6.0 * u2 + 15.0 * u - 10.0) + 1.0


def wrap(coord: np.ndarray, cell: np.ndarray) -> np.ndarray:
    """Coordinates ``(n, 3)`` wrapped into the cell (DeePMD-kit's ``normalize_coord``)."""
    frac = np.remainder(coord @ np.linalg.inv(cell), 1.0)
    return frac @ cell


def _kept(i: np.ndarray, tj: np.ndarray, rr: np.ndarray, settings: EnvMatSettings) -> np.ndarray:
    """Positions of the pairs each centre keeps: its ``nsel`` nearest, then per type.

    When no centre has more neighbours than it may keep, every pair is kept (and nothing needs
    sorting, which is most of the cost of a frame).
    """
    if not i.size:
        return np.arange(0)
    centres = int(i.max()) + 1
    if np.bincount(i, minlength=centres).max() <= settings.nsel:
        if settings.mixed_types:
            return np.arange(i.size)
        per_type = np.bincount(i * settings.ntypes + tj, minlength=centres * settings.ntypes)
        if (per_type.reshape(centres, settings.ntypes) <= np.asarray(settings.sel)).all():
            return np.arange(i.size)
    order = np.lexsort((rr, i))
    i_sorted = i[order]
    starts = np.searchsorted(i_sorted, i_sorted, side="left")
    order = order[np.arange(order.size) - starts < settings.nsel]
    if settings.mixed_types:
        return order
    by_type = order[np.lexsort((np.arange(order.size), tj[order], i[order]))]
    key = i[by_type] * settings.ntypes + tj[by_type]
    starts = np.searchsorted(key, key, side="left")
    rank = np.arange(by_type.size) - starts
    limit = np.asarray(settings.sel)[tj[by_type]]
    return by_type[rank < limit]


def frame_sums(nlist: Any, coord: np.ndarray, types: np.ndarray, cell: np.ndarray | None,
               settings: EnvMatSettings) -> EnvMatSums:
    """The statistics of one frame: ``coord`` ``(n, 3)``, ``types`` ``(n,)``, ``cell`` or
    ``None``."""
    ntypes = settings.ntypes
    periodic = cell is not None
    pos = wrap(coord, cell) if periodic else coord
    i, j, shifts = nlist.compute(pos, cell if periodic else np.zeros((3, 3)), periodic, "ijS")
    i, j = i.astype(np.int64), j.astype(np.int64)
    diff = pos[j] - pos[i]
    if periodic:
        diff = diff + shifts.astype(np.float64) @ cell
    rr = np.linalg.norm(diff, axis=-1)
    ti, tj = types[i], types[j]
    ok = (rr <= settings.rcut) & (ti >= 0) & (tj >= 0)
    i, ti, tj, rr, diff = i[ok], ti[ok], tj[ok], rr[ok], diff[ok]
    keep = _kept(i, tj, rr, settings)
    ti, tj, rr, diff = ti[keep], tj[keep], rr[keep], diff[keep]
    if settings.exclude_types:
        excluded = {(a, b) for a, b in settings.exclude_types} | {
            (b, a) for a, b in settings.exclude_types}
        on = np.array([(a, b) not in excluded for a, b in zip(ti.tolist(), tj.tolist())],
                      dtype=bool)
        ti, rr, diff = ti[on], rr[on], diff[on]
    p = settings.env_protection
    sw = smooth_weight(rr, settings.rcut_smth, settings.rcut)
    radial = sw / (rr + p)
    angular = diff * (sw / (rr + p) ** 2)[:, None]
    centres = np.bincount(types[types >= 0], minlength=ntypes)[:ntypes].astype(np.float64)
    number = np.stack([centres * settings.nsel, centres * settings.nsel * 3], axis=1)
    total, squared = np.zeros((ntypes, 2)), np.zeros((ntypes, 2))
    for t in np.unique(ti).tolist():
        mine = ti == t
        total[t, 0], squared[t, 0] = np.sum(radial[mine]), np.sum(radial[mine] ** 2)
        if not settings.radial_only:
            total[t, 1], squared[t, 1] = np.sum(angular[mine]), np.sum(angular[mine] ** 2)
    if settings.radial_only:
        number[:, 1] = 0.0
    return EnvMatSums(number, total, squared, 1)


def frames_env_sums(coord: np.ndarray, atype: np.ndarray, box: np.ndarray | None,
                    settings: EnvMatSettings, *, place: FramePlace | None = None,
                    threads: int = 1, start: EnvMatSums | None = None) -> EnvMatSums:
    """The statistics of frames ``coord`` ``(nf, natoms, 3)``, ``atype`` ``(nf, natoms)``,
    ``box`` ``(nf, 9)`` or ``None``, added frame after frame (to ``start``, the sums of the
    frames before them, when given)."""
    place = place or FramePlace(system="<arrays>")
    coord = np.asarray(coord, dtype=np.float64)
    nf = coord.shape[0]
    coord = coord.reshape(nf, -1, 3)
    atype = np.asarray(atype, dtype=np.int64).reshape(nf, -1)
    cells = None if box is None else np.asarray(box, dtype=np.float64).reshape(nf, 3, 3)
    check_frames(coord, cells, place)
    nlist = vesin.NeighborList(cutoff=settings.rcut * (1 + 1e-9), full_list=True,
                               n_threads=threads)
    first = EnvMatSums.zeros(settings.ntypes) if start is None else start
    return merge_all(chain([first], (frame_sums(nlist, coord[k], atype[k],
                                                None if cells is None else cells[k], settings)
                                     for k in range(nf))))


def system_env_sums(dataset: Any, settings: EnvMatSettings, *,
                    frames: Sequence[int] | None = None, threads: int = 1,
                    chunk_atom_frames: int | None = CHUNK_ATOM_FRAMES) -> EnvMatSums:
    """The statistics of one system's frames (all, or ``frames``), read through a
    :class:`~mdloader.data.dataset.DeepmdDataSetForLoader`, ``chunk_atom_frames`` atom-frames
    at a time (``None``: a set at once).

    Each run of frames (of a set, with or without a box) is summed frame after frame across the
    chunks, and the runs are then added in order, so the sums do not depend on the chunks.
    """
    sums = EnvMatSums.zeros(settings.ntypes)
    run = None
    for _set_name, set_fids in frames_by_set(dataset, frames):
        for fids, arrays, starts_run in read_chunks(dataset, set_fids, budget=chunk_atom_frames):
            if starts_run and run is not None:
                sums, run = sums.merge(run), None
            run = frames_env_sums(arrays["coord"], arrays["atype"], arrays["box"], settings,
                                  place=place_of(dataset, fids), threads=threads, start=run)
    return sums if run is None else sums.merge(run)


def davg_dstd(sums: EnvMatSums, settings: EnvMatSettings, *,
              set_davg_zero: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """DeePMD-kit's ``mean`` and ``stddev`` buffers ``(ntypes, nsel, 4 or 1)`` from merged
    sums; with ``set_davg_zero`` the mean stays zero (the descriptor keeps its initial one)."""
    n, s, q = sums.number, sums.total, sums.squared
    with np.errstate(divide="ignore", invalid="ignore"):
        avg = np.where(n > 0, s / np.where(n > 0, n, 1), 0.0)
        var = q / np.where(n > 0, n, 1) - (s / np.where(n > 0, n, 1)) ** 2
    std = np.sqrt(np.clip(var, 0, None))
    std = np.where(np.abs(std) < STD_PROTECTION, STD_PROTECTION, std)
    std = np.where(n > 0, std, DEFAULT_STD)
    ntypes, ncol, nsel = settings.ntypes, settings.ncol, settings.nsel
    mean = np.zeros((ntypes, nsel, ncol))
    if not set_davg_zero:
        mean[:, :, 0] = avg[:, 0:1]
    stddev = np.empty((ntypes, nsel, ncol))
    stddev[:, :, 0] = std[:, 0:1]
    if ncol == 4:
        stddev[:, :, 1:] = std[:, 1:2, None]
    return mean, stddev
