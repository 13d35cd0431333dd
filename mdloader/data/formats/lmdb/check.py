"""``check --deep`` for an LMDB group: decode every frame, as training would, and collect every
problem instead of stopping at the first.

Reported: frames that cannot be decoded or disagree with the metadata (each error names the
frame), NaN/inf values per field, cells of volume 0, and a group whose frames are partly
periodic (with ``cells``) and partly not, which a batch cannot mix.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from mdloader.data.formats.base import SystemMeta
from mdloader.data.formats.diagnostics import SHOWN
from mdloader.data.formats.geometry import degenerate_boxes
from mdloader.data.formats.lmdb.reader import LmdbGroupReader
from mdloader.errors import MdloaderError


def check_group(meta: SystemMeta) -> list[str]:
    """Problems found in the frames of one LMDB group (an empty list when all is well)."""
    reader = LmdbGroupReader(meta, ())
    reader.check_cells = False  # collected here, one line for all frames
    problems: list[str] = []
    nonfinite: dict[str, list[int]] = defaultdict(list)
    periodic: dict[bool, list[int]] = defaultdict(list)
    flat: list[int] = []
    for index in reader.keys(np.arange(meta.nframes)).tolist():
        try:
            frame = reader.decode(index, copy=False)
        except MdloaderError as exc:
            problems.append(str(exc))
            continue
        periodic["box" in frame].append(index)
        box = frame.get("box")
        if isinstance(box, np.ndarray) and np.isfinite(box).all() and len(degenerate_boxes(box)):
            flat.append(index)
        for name, value in frame.items():
            if isinstance(value, np.ndarray) and value.dtype.kind in "fc" \
                    and not np.isfinite(value).all():
                nonfinite[name].append(index)
    if len(periodic) == 2:
        problems.append(f"frames with cells {_few(periodic[True])} and without "
                        f"{_few(periodic[False])} share the group {meta.address}: a batch "
                        "cannot mix them")
    if flat:
        problems.append(f"a box of volume 0 (degenerate cell) in {len(flat)} frame(s) of "
                        f"{meta.address}: frames {_few(flat)}")
    for name, frames in nonfinite.items():
        problems.append(f"NaN/inf in field '{name}' of {len(frames)} frame(s) of "
                        f"{meta.location.path}: frames {_few(frames)}")
    return problems


def _few(frames: list[int]) -> str:
    more = f" and {len(frames) - SHOWN} more" if len(frames) > SHOWN else ""
    return f"{frames[:SHOWN]}{more}"
