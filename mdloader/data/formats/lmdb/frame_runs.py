"""A sorted list of frame indices stored as runs of consecutive indices.

An LMDB group's frames (all frames of one source system with one atom count) are usually one
run, because writers store a system's frames together; so a group pickles to a few bytes
whatever its size, and a database of 10⁶ frames broadcasts in a few bytes per *group*. After the
first start, each run is (gap since the previous run's end, length); both columns are packed as
one array of the smallest unsigned integer type that holds them. Pure numpy, no file access.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

_WIDTHS = (np.uint8, np.uint16, np.uint32, np.uint64)


def run_bounds(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of consecutive values in sorted, unique ``indices``."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
    heads = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((heads, [idx.size])))
    return idx[heads], lengths


_LIMITS = np.array([np.iinfo(t).max for t in _WIDTHS[:-1]], dtype=np.uint64)


def encode_runs(starts: np.ndarray, lengths: np.ndarray) -> bytes:
    """A header byte (two integer widths), the first start, then (gap, length) pairs.

    The first start is stored apart, so that a group deep into a large database still packs
    its pairs in one or two bytes each.
    """
    return encode_groups(starts, lengths, np.array([0, len(starts)]))[0]


def encode_groups(starts: np.ndarray, lengths: np.ndarray, bounds: np.ndarray) -> list[bytes]:
    """:func:`encode_runs` of each slice ``bounds[g]:bounds[g + 1]`` of the runs (all
    non-empty), computed for all groups at once: 10⁴ groups cost one pass, not 10⁴."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    lo = np.asarray(bounds[:-1], dtype=np.int64)
    if len(starts) == 0:
        return [bytes([0]) + bytes(1)] * len(lo)
    gaps = starts - np.concatenate(([0], starts[:-1] + lengths[:-1]))
    gaps[lo] = 0
    pairs = np.stack([gaps, lengths], axis=1)
    wide = np.searchsorted(_LIMITS, np.maximum.reduceat(pairs.max(axis=1), lo).astype(np.uint64))
    first = starts[lo]
    head = np.searchsorted(_LIMITS, first.astype(np.uint64))
    cast = {int(w): pairs.astype(_WIDTHS[w]) for w in np.unique(wide)}
    firsts = {int(h): first.astype(_WIDTHS[h]) for h in np.unique(head)}
    ends = np.asarray(bounds[1:], dtype=np.int64)
    return [bytes([w | h << 4]) + firsts[h][g:g + 1].tobytes() + cast[w][a:b].tobytes()
            for g, (w, h, a, b) in enumerate(zip(wide.tolist(), head.tolist(), lo.tolist(),
                                                 ends.tolist()))]


def _layout(blob: bytes) -> tuple[type, int]:
    """(dtype of the pairs, byte offset where they begin)."""
    return _WIDTHS[blob[0] & 15], 1 + np.dtype(_WIDTHS[blob[0] >> 4]).itemsize


def decode_runs(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of :func:`encode_runs`'s output."""
    dtype, offset = _layout(blob)
    first = int(np.frombuffer(blob, dtype=_WIDTHS[blob[0] >> 4], count=1, offset=1)[0])
    pairs = np.frombuffer(blob, dtype=dtype, offset=offset).astype(np.int64)
    gaps, lengths = pairs[0::2], pairs[1::2]
    starts = first + np.cumsum(gaps + np.concatenate(([0], lengths[:-1])))
    return starts, lengths


@dataclass(frozen=True)
class FrameRuns:
    """The frames of one group: ``keys(positions)`` maps positions 0..n-1 to frame indices."""

    nframes: int
    blob: bytes

    @classmethod
    def of(cls, indices: np.ndarray) -> FrameRuns:
        return cls.from_runs(*run_bounds(indices))

    @classmethod
    def from_runs(cls, starts: np.ndarray, lengths: np.ndarray) -> FrameRuns:
        return cls(int(np.sum(lengths)), encode_runs(starts, lengths))

    @functools.cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        starts, lengths = decode_runs(self.blob)
        return starts, np.cumsum(lengths) - lengths  # run starts, and positions they begin at

    @property
    def nruns(self) -> int:
        dtype, offset = _layout(self.blob)
        return (len(self.blob) - offset) // (2 * np.dtype(dtype).itemsize)

    def keys(self, positions: Any) -> np.ndarray:
        """Frame indices at ``positions`` (in range ``[0, nframes)``)."""
        pos = np.asarray(positions, dtype=np.int64)
        starts, first = self._table
        if len(starts) == 1:
            return starts[0] + pos
        run = np.searchsorted(first, pos, side="right") - 1
        return starts[run] + (pos - first[run])

    def all_keys(self) -> np.ndarray:
        """Every frame index of the group, ascending."""
        return self.keys(np.arange(self.nframes))

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrameRuns, (self.nframes, self.blob))  # not the decoded table
