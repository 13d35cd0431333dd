"""The reference model's statistics: energy bias and feature scales, computed once on rank 0.

Rank 0 computes them and ``DistributedDataParallel`` broadcasts them with the weights; a failure
there (e.g. a system without ``energy.npy``) reaches every rank as one framed error instead of
leaving the others waiting in the DDP constructor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mdloader.distributed.collectives import fail_together
from mdloader.train.guards import nonfinite_data
from mdloader.train.model import RadialPotential, fit_energy_bias
from mdloader.world import World

log = logging.getLogger(__name__)


def on_main_for_all(fn: Callable[[], None], world: World, *, context: str) -> None:
    """Run ``fn`` on rank 0; every rank returns together, or raises rank 0's error."""
    error = None
    if world.is_main:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
            error = exc
    fail_together(error, context=context)


def fit_statistics(model: RadialPotential, systems: Sequence[Any], *, systems_max: int = 200,
                   frames: int = 10, device: torch.device) -> None:
    """Energy bias by least squares and feature scales from a few frames of evenly spread
    systems (at most ``systems_max`` systems and ``frames`` frames each)."""
    picks = np.unique(np.linspace(0, len(systems) - 1,
                                  min(len(systems), systems_max)).astype(int))
    counts, energies, batches = [], [], []
    for sid in picks:
        nf = min(len(systems[sid]), frames)
        batch = systems[sid].get_batch(list(range(nf)))
        bad = nonfinite_data(batch, systems[sid], "the statistics cannot use these frames",
                             keys=("coord", "box", "energy"))
        if bad is not None:
            raise bad
        natoms = batch.get("real_natoms_vec", batch["natoms"])
        counts.append(natoms[:, 2:].numpy())
        energies.append(batch["energy"].numpy().reshape(-1))
        batches.append(batch)
    bias = fit_energy_bias(np.concatenate(counts), np.concatenate(energies))
    feats = []
    with torch.no_grad():
        for batch in batches[:8]:
            box = batch["box"]
            f = model.features(batch["coord"][:1].to(device, torch.float64),
                               batch["atype"][:1].long().to(device),
                               None if box is None else box[:1].to(device, torch.float64))
            feats.append(f.reshape(-1, f.shape[-1]))
    model.set_statistics(bias, torch.cat(feats))
    log.info("energy bias per type from %d frames: %s", sum(len(e) for e in energies),
             np.array2string(bias, precision=4))
