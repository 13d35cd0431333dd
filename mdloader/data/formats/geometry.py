"""Simulation cells: which stored boxes enclose no volume, for the checks of every format."""

from __future__ import annotations

import numpy as np

#: A cell whose volume is at most this fraction of the product of its edge lengths is flat.
FLAT_CELL = 1e-10


def degenerate_boxes(boxes: np.ndarray) -> np.ndarray:
    """Indices of the ``(n, 9)`` cells that hold NaN/inf or enclose no volume (zero, or
    ``FLAT_CELL`` of their edge lengths' product): heights, inverse and minimum image of such
    a cell are NaN or undefined, and ``NaN < 2 * rcut`` is false."""
    cells = np.asarray(boxes, dtype=np.float64).reshape(-1, 3, 3)
    finite = np.isfinite(cells).all(axis=(1, 2))
    safe = np.where(finite[:, None, None], cells, 0.0)
    volume = np.abs(np.linalg.det(safe))
    edges = np.linalg.norm(safe, axis=2).prod(axis=1)
    return np.flatnonzero(~finite | ~(volume > FLAT_CELL * edges))
