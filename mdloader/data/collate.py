"""DeePMD-kit's rules for stacking frames of one system into a batch, stated once.

A key's rule (:func:`rule_of`): ``find_*`` flags come from the first frame, a ``None`` in the
first frame stays ``None`` (``box`` of non-periodic systems), ``fid`` becomes a list, the
redundant ``type`` key is dropped, and everything else is stacked on a new first dimension.
:func:`collate_batch` applies it to frame dicts; :func:`batch_from_blocks` to arrays already
read for the whole batch, as the datasets do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def rule_of(key: str, first: Any) -> str:
    """``flag``, ``none``, ``list``, ``drop`` or ``stack``: how ``key`` enters a batch."""
    if "find_" in key:
        return "flag"
    if first is None:
        return "none"
    if key == "fid":
        return "list"
    if key == "type":
        return "drop"
    return "stack"


def collate_batch(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack frame dicts the way DeePMD-kit's trainer expects (see :func:`rule_of`)."""
    if not batch:
        raise ValueError("collate_batch needs at least one frame")
    result: dict[str, Any] = {}
    for key, value in batch[0].items():
        rule = rule_of(key, value)
        if rule == "flag":
            result[key] = value
        elif rule == "none":
            result[key] = None
        elif rule == "list":
            result[key] = [frame[key] for frame in batch]
        elif rule == "stack":
            result[key] = torch.stack([torch.as_tensor(frame[key], device="cpu")
                                       for frame in batch])
    return result


def batch_from_blocks(blocks: dict[str, np.ndarray | None], flags: dict[str, Sequence[Any]],
                      fids: Sequence[int]) -> dict[str, Any]:
    """The batch :func:`collate_batch` would give for frames whose stacked arrays are
    ``blocks`` (first dimension = frame), whose flags are ``flags`` and whose ids are ``fids``."""
    batch: dict[str, Any] = {key: values[0] for key, values in flags.items()}
    for key, block in blocks.items():
        rule = rule_of(key, block)
        if rule == "none":
            batch[key] = None
        elif rule == "stack":
            batch[key] = torch.from_numpy(block)
    batch["fid"] = [int(f) for f in fids]
    return batch
