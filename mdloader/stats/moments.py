"""Per-column moments of a share of rows (count, sum, sum of squares, float64), merged by
addition: shares computed on different ranks give the mean and standard deviation of all the
rows, whatever the split, up to float reassociation.

``mdloader train`` keeps one per system for its reference model's feature scales (the rows are
the atoms of the system's statistics frames, the columns the model's radial features).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mdloader.errors import ConfigError


@dataclass(frozen=True)
class FeatureMoments:
    """``count`` rows, the sum ``total`` (F,) and the sum of squares ``squared`` (F,) of each of
    their F columns."""

    count: int
    total: np.ndarray
    squared: np.ndarray

    @classmethod
    def zeros(cls, nfeat: int) -> FeatureMoments:
        return cls(0, np.zeros(nfeat), np.zeros(nfeat))

    @classmethod
    def of_rows(cls, rows: np.ndarray) -> FeatureMoments:
        """The moments of ``rows`` (M, F)."""
        rows = np.asarray(rows, dtype=np.float64)
        if rows.ndim != 2:
            raise ConfigError(f"feature rows must be (rows, features), got shape {rows.shape}")
        return cls(int(rows.shape[0]), rows.sum(axis=0), np.square(rows).sum(axis=0))

    def merge(self, other: FeatureMoments) -> FeatureMoments:
        """The moments of both shares' rows."""
        if self.total.shape != other.total.shape:
            raise ConfigError(f"feature moments cannot be merged: {self.total.shape[0]} / "
                              f"{other.total.shape[0]} features")
        return FeatureMoments(self.count + other.count, self.total + other.total,
                              self.squared + other.squared)

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation (with ``count - 1``, as ``torch.std``) of each column;
        the deviation of a single row is 0."""
        if self.count < 1:
            raise ConfigError("no atoms in the statistics frames: the feature scales cannot be "
                              "computed")
        mean = self.total / self.count
        if self.count == 1:
            return mean, np.zeros_like(mean)
        variance = (self.squared - self.total * mean) / (self.count - 1)
        return mean, np.sqrt(np.maximum(variance, 0.0))


