"""What the reference job checks so that bad numbers stop it with a line that says where.

* A non-finite loss names the step, the rank, the system and frames of its batch, and the label
  (or input) file that holds NaN/inf, when one does (:func:`nonfinite_loss`).
* A checkpoint is never written with non-finite weights (:func:`nonfinite_weights`).
* Every frame's box is checked against the model cutoff before the first step, each rank
  checking its share of the systems (:func:`check_boxes`), instead of at the first batch that
  happens to draw a small box, possibly hours in; a flat or all-zero cell (NaN heights) is
  an error too. LMDB frames hold their box with everything else, so reading their boxes would
  read the whole database: they are checked as they are read (finite, volume > 0), and a box
  under ``2 * rcut`` is named with its system and frame at the step that draws it
  (:func:`small_box_in_batch`). A ``mix:N`` batch's frames are named by their database and
  database entries (:func:`batch_source`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats import backend_of, diagnostics
from mdloader.data.formats.base import SystemMeta
from mdloader.data.formats.geometry import degenerate_boxes
from mdloader.distributed.collectives import fail_together
from mdloader.errors import DataError, NonFiniteError
from mdloader.train.model import box_heights, box_too_small
from mdloader.world import World

CHECKED_KEYS = ("coord", "box", "energy", "force")


@dataclass(frozen=True)
class DatabaseFrames:
    """What a ``mix:N`` batch's errors name: its LMDB database (the batch crosses the groups
    the loader set calls systems) and a group's metadata, which maps a frame id (a database
    index) to its database entry."""

    system: str
    meta: SystemMeta


def batch_source(systems: Sequence[DeepmdDataSetForLoader], batch: dict[str, Any],
                 database: str | None = None) -> DeepmdDataSetForLoader | DatabaseFrames:
    """The system a batch's errors name: ``systems[sid]``, or under ``mix:N`` (``database``
    given) the database."""
    if database is not None:
        return DatabaseFrames(database, systems[0].meta)
    return systems[int(batch["sid"])]


def frame_file(system: DeepmdDataSetForLoader, key: str, fid: int) -> str | None:
    """The file that holds ``key`` for frame ``fid`` of ``system`` (``None`` when none does);
    for an LMDB group, the database entry of frame ``fid`` (a database index)."""
    return diagnostics.frame_file(system.meta, key, fid)


def nonfinite_loss(batch: dict[str, Any], system: DeepmdDataSetForLoader, *, loss: float,
                   step: int, rank: int) -> NonFiniteError:
    """Why the loss of ``batch`` is ``loss`` (NaN or inf) at ``step``: the first of its arrays
    that holds NaN/inf, with the file and the frames, or else a model that diverged."""
    where = f"the loss is not finite ({loss}) at step {step} on rank {rank}"
    found = nonfinite_data(batch, system, where)
    return found or NonFiniteError(
        f"{where}, with finite data: the model diverged (try a smaller learning_rate.start_lr)",
        system=system.system, found=f"batch frames {[int(f) for f in batch['fid']]}")


def nonfinite_data(batch: dict[str, Any], system: DeepmdDataSetForLoader, where: str,
                   keys: Sequence[str] = CHECKED_KEYS) -> NonFiniteError | None:
    """The first of ``keys`` whose values in ``batch`` hold NaN/inf, as an error naming the
    frames and the file; ``where`` starts its message."""
    fids = [int(f) for f in batch["fid"]]
    for key in keys:
        value = batch.get(key)
        if value is None:
            continue
        rows = torch.as_tensor(value).reshape(len(fids), -1)
        bad = [fid for fid, ok in zip(fids, torch.isfinite(rows).all(dim=1).tolist()) if not ok]
        if bad:
            return NonFiniteError(f"{where}: {key} holds NaN/inf in frames {bad} of the batch",
                                  system=system.system, file=frame_file(system, key, bad[0]),
                                  found=f"batch frames {fids}")
    return None


def small_box_in_batch(exc: DataError, batch: dict[str, Any],
                       system: DeepmdDataSetForLoader) -> DataError:
    """The model's box error ``exc`` (it knows no file) with the system, the frame of the batch
    whose box is smallest and the file (or database entry) holding it."""
    fids = [int(f) for f in batch["fid"]]
    heights = box_heights(torch.as_tensor(batch["box"], dtype=torch.float64).reshape(-1, 3, 3))
    fid = fids[int(torch.argmin(heights.min(dim=1).values))]
    return type(exc)(f"{exc.message}; frame {fid} of the batch {fids}", system=system.system,
                     file=frame_file(system, "box", fid), expected=exc.expected,
                     found=exc.found)


def nonfinite_weights(model: torch.nn.Module, step: int) -> NonFiniteError | None:
    """An error naming the first parameter or buffer that holds NaN/inf, else ``None``."""
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        if not bool(torch.isfinite(value).all()):
            return NonFiniteError(f"the weights are not finite after step {step} ({name}): no "
                                  "checkpoint written; restart from the last one")
    return None


def check_boxes(systems: Sequence[DeepmdDataSetForLoader], rcut: float, world: World) -> None:
    """Every frame's box is finite, encloses a volume and is at least ``2 * rcut`` high, or
    every rank raises the first failure.

    Rank ``r`` reads the boxes of systems ``r, r + W, ...`` once (a few floats per frame); the
    ranks then agree in one framed exchange, so every rank prints the same line.
    """
    problem = None
    for sid in range(world.rank, len(systems), world.world_size):
        try:
            problem = _box_problem(systems[sid], rcut)
        except DataError as exc:  # a box file that changed or vanished: still a shared failure
            problem = exc
        if problem is not None:
            break
    fail_together(problem, context="checking every box against the model cutoff")


def _box_problem(system: DeepmdDataSetForLoader, rcut: float) -> DataError | None:
    meta = system.meta
    backend = backend_of(meta.location)
    if not meta.pbc or backend.pbc_per_frame:  # boxes in the frames (LMDB): checked as read
        return None
    for file, start, block in diagnostics.box_blocks(meta):
        rows = torch.as_tensor(block, dtype=torch.float64)
        bad = torch.nonzero(~torch.isfinite(rows).all(dim=1)).flatten().tolist()
        if bad:
            return NonFiniteError(f"the box of frame {start + bad[0]} holds NaN/inf",
                                  system=meta.address, file=file)
        flat = degenerate_boxes(block)
        if len(flat):
            return DataError(f"the box of frame {start + int(flat[0])} encloses no volume "
                             f"(a degenerate cell); {len(flat)} frame(s) of this set",
                             system=meta.address, file=file, expected="a cell of volume > 0",
                             found=f"box {np.asarray(block)[flat[0]].tolist()}")
        heights = box_heights(rows.reshape(-1, 3, 3))
        small = torch.nonzero(~(heights.min(dim=1).values >= 2 * rcut)).flatten().tolist()
        if small:
            return box_too_small(float(heights[small[0]].min()), rcut,
                                 what=f"the box of frame {start + small[0]}",
                                 note=f"; {len(small)} frame(s) of this set",
                                 system=meta.address, file=file)
    return None
