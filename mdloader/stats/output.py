"""The output (energy) bias from frame labels: DeePMD-kit's least squares over per-frame type
counts, computed once the tiny per-frame pieces of every share are gathered.

Each rank reads its systems' per-frame type counts and reduced labels (:func:`system_samples`);
the shares merge by concatenation in a fixed global order (system position, then frame), which
is DeePMD-kit's order of its sampled systems, so :func:`output_bias` run on the merged samples is
``compute_stats_from_redu``: ``lstsq(counts, labels, rcond)`` for the bias, the standard deviation
of the residuals broadcast to every type, with preset (``atom_ener``) biases subtracted first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mdloader.errors import ConfigError, NonFiniteError
from mdloader.stats.frames import CHUNK_ATOM_FRAMES, chunk_frames, file_of, frames_by_set


@dataclass(frozen=True)
class OutputSamples:
    """Per-frame type counts ``(nf, ntypes)``, labels ``(nf, ndim)`` and global positions
    ``(nf, 2)`` (system position, frame) of one output key."""

    key: str
    counts: np.ndarray
    labels: np.ndarray
    positions: np.ndarray

    @classmethod
    def empty(cls, key: str, ntypes: int, ndim: int = 1) -> OutputSamples:
        return cls(key, np.zeros((0, ntypes), np.int64), np.zeros((0, ndim)),
                   np.zeros((0, 2), np.int64))

    def merge(self, other: OutputSamples) -> OutputSamples:
        """Both shares, in global order (the same whatever the grouping into shares)."""
        if self.key != other.key or self.counts.shape[1] != other.counts.shape[1] or \
                self.labels.shape[1] != other.labels.shape[1]:
            raise ConfigError(
                f"output samples cannot be merged: key {self.key!r} / {other.key!r}, "
                f"{self.counts.shape[1]} / {other.counts.shape[1]} types, "
                f"{self.labels.shape[1]} / {other.labels.shape[1]} values per frame")
        positions = np.concatenate([self.positions, other.positions])
        order = np.lexsort((positions[:, 1], positions[:, 0]))
        return OutputSamples(self.key, np.concatenate([self.counts, other.counts])[order],
                             np.concatenate([self.labels, other.labels])[order],
                             positions[order])


def system_samples(dataset: Any, position: int, *, key: str = "energy", ndim: int = 1,
                   frames: Sequence[int] | None = None,
                   chunk_atom_frames: int | None = CHUNK_ATOM_FRAMES) -> OutputSamples:
    """Type counts and labels of a system's frames that carry ``key`` (``find_<key>`` set).

    ``dataset`` is a :class:`~mdloader.data.dataset.DeepmdDataSetForLoader` that already
    requires ``key`` (``add_data_requirement``); ``position`` is the system's place in the
    training systems. Mixed-type frames count their real atom types (``real_natoms_vec``).
    Frames are read ``chunk_atom_frames`` atom-frames at a time (``None``: a set at once).
    """
    counts, labels, fids = [], [], []
    ntypes = dataset.meta.ntypes
    step = chunk_frames(dataset.meta.natoms, chunk_atom_frames)
    for _set_name, set_fids in frames_by_set(dataset, frames):
        size = step or len(set_fids)
        for lo in range(0, len(set_fids), size):
            chunk = _chunk_samples(dataset, set_fids[lo:lo + size], key, ntypes)
            if chunk is not None:
                counts.append(chunk[0])
                labels.append(chunk[1])
                fids.append(chunk[2])
    if not fids:
        return OutputSamples.empty(key, ntypes, ndim)
    return OutputSamples(key, np.concatenate(counts), np.concatenate(labels),
                         np.stack([np.full(sum(map(len, fids)), position),
                                   np.concatenate(fids)], axis=1))


def _chunk_samples(dataset: Any, chunk: np.ndarray, key: str, ntypes: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Type counts, labels and frame ids of the frames of ``chunk`` that carry ``key``."""
    counts, labels, fids = [], [], []
    for fid, frame in zip(chunk.tolist(), dataset.get_frames(chunk.tolist())):
        if key not in frame:
            raise ConfigError(f"the dataset of {dataset.meta.address} does not require "
                              f"{key!r}: add it with add_data_requirement")
        if not float(frame["find_" + key]) > 0:
            continue
        vec = frame.get("real_natoms_vec", frame["natoms"])
        counts.append(np.asarray(vec, dtype=np.int64)[2:2 + ntypes])
        labels.append(np.asarray(frame[key], dtype=np.float64).reshape(-1))
        fids.append(fid)
    if not fids:
        return None
    labels = np.stack(labels)
    bad = ~np.isfinite(labels).all(axis=1)
    if bad.any():
        k = int(np.argmax(bad))
        raise NonFiniteError(f"{key} of frame {fids[k]} is not finite",
                             system=dataset.meta.address,
                             file=file_of(dataset, key, fids[k]),
                             expected="finite labels", found=labels[k].tolist())
    return np.stack(counts), labels, np.asarray(fids, dtype=np.int64)


def output_bias(samples: OutputSamples, *, rcond: float | None = None,
                assigned_bias: np.ndarray | None = None,
                intensive: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """DeePMD-kit's bias ``(ntypes, ndim)`` and standard deviation ``(ntypes, ndim)``.

    ``assigned_bias`` ``(ntypes, ndim)`` holds preset biases, NaN rows for types to fit.
    """
    if samples.counts.shape[0] == 0:
        raise ConfigError(f"no frame carries {samples.key!r}: the output bias cannot be fitted")
    natoms = samples.counts.astype(np.float64)
    labels = samples.labels.copy()
    if intensive:
        natoms = natoms / np.sum(natoms, axis=1, keepdims=True)
    preset = None
    if assigned_bias is not None:
        assigned = np.asarray(assigned_bias, dtype=np.float64).reshape(natoms.shape[1], -1)
        preset = ~np.isnan(assigned).any(axis=1)
        labels -= natoms[:, preset] @ assigned[preset]
        natoms[:, preset] = 0
    bias = np.linalg.lstsq(natoms, labels, rcond=rcond)[0]
    if preset is not None:
        bias[preset] = assigned[preset]
    std = (labels - natoms @ bias).std(axis=0)
    return bias, np.tile(std, (natoms.shape[1], 1))
