"""``collate_batch``: DeePMD-kit's rules for stacking frames of one system into a batch."""

from __future__ import annotations

from typing import Any

import torch


def collate_batch(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack frame dicts the way DeePMD-kit's trainer expects.

    ``find_*`` flags are taken from the first frame, a ``None`` in the first frame stays
    ``None`` (``box`` of non-periodic systems), ``fid`` becomes a list, the redundant ``type``
    key is dropped, and everything else is stacked on a new first dimension.
    """
    if not batch:
        raise ValueError("collate_batch needs at least one frame")
    first = batch[0]
    result: dict[str, Any] = {}
    for key, value in first.items():
        if "find_" in key:
            result[key] = value
        elif value is None:
            result[key] = None
        elif key == "fid":
            result[key] = [frame[key] for frame in batch]
        elif key == "type":
            continue
        else:
            result[key] = torch.stack([torch.as_tensor(frame[key]) for frame in batch])
    return result
