"""How an array's shape maps to frames and values per frame: DeePMD-kit's rules, pure.

A set's ``coord.npy`` gives its frame count. Every other array is read as ``(frames, width)``:
its first axis is normally the frames; a one-frame set may store 0-D/1-D arrays; and an array
stored flat -- its size a multiple of the frames, its first axis not (DeePMD-kit's
``examples/fparam`` stores ``aparam.npy`` as ``(1, F*N)``) -- is reshaped to ``(frames, -1)``,
as DeePMD-kit's whole-set reader does. Some widths are fixed by the format (``KNOWN_WIDTHS``).
"""

from __future__ import annotations

import math

from mdloader.data.schema import KNOWN_WIDTHS


def frames_and_width(shape: tuple[int, ...], set_frames: int | None) -> tuple[int, int]:
    """(frames, values per frame) of an array of ``shape`` in a set of ``set_frames`` frames.

    ``set_frames=None`` is ``coord.npy`` itself: a 0-D or 1-D array is one frame. When the
    array cannot be read as ``set_frames`` frames, the frame count found is its first axis.
    """
    if set_frames is None:
        return (1, math.prod(shape)) if len(shape) < 2 else (shape[0], math.prod(shape[1:]))
    if shape and shape[0] == set_frames:
        return set_frames, math.prod(shape[1:])
    total = math.prod(shape)
    if set_frames > 0 and total % set_frames == 0:
        return set_frames, total // set_frames
    return (shape[0] if shape else 1), math.prod(shape[1:])


def stored_flat(shape: tuple[int, ...], set_frames: int) -> bool:
    """Whether an array of ``shape`` is read reshaped to ``(set_frames, -1)`` because its first
    axis is not the frames (the 0-D/1-D arrays of a one-frame set do not count)."""
    if set_frames == 1 and len(shape) <= 1:
        return False
    return not (shape and shape[0] == set_frames)


def known_width(key: str, natoms: int) -> tuple[int, str] | None:
    """The values per frame the format fixes for ``key`` and how to say it, else ``None``."""
    if key == "hessian":
        return 9 * natoms * natoms, str(9 * natoms * natoms)
    if key not in KNOWN_WIDTHS:
        return None
    kind, per = KNOWN_WIDTHS[key]
    if kind == "atoms":
        return per * natoms, f"{per} x {natoms} atoms of type.raw"
    return per, str(per)
