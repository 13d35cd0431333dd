"""The reference model's statistics: energy bias and feature scales, computed in shares by every
rank on the path ``mdloader dp``'s input statistics take.

The frames are DeePMD-kit's ``make_stat_input`` frames of a one-rank job: of every training
system, the first ``data_stat_nbatch`` batches of pass 0 under the job's seed
(:func:`~mdloader.sampling.order.statistics_frames`) for the energy bias, and the first
``FEATURE_NBATCH`` of them for the feature scales (normalisation constants, for which a sample
of every system is enough, at a cost of all pairs of atoms per frame); every frame for both under
``MDLOADER_STAT_FRAMES=all``. Two passes of
:func:`~mdloader.loading.statistics.sharded_pass` give every rank each system's partial results,
cached per system: ``feature`` (the count, sum and sum of squares of the model's radial features
over the real atoms, :class:`~mdloader.stats.moments.FeatureMoments`) and ``output`` (the type
counts and energies of :func:`~mdloader.stats.output.system_samples`). Every rank merges them in
system order, so every rank sets the same statistics, at any world size; the bias is DeePMD-kit's
least squares (:func:`~mdloader.stats.output.output_bias`).

A failure on any rank (a non-finite coordinate, box or energy, an unreadable file) reaches every
rank as one line naming the rank, the system and the file, before the first step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mdloader import settings
from mdloader.distributed.collectives import fail_together
from mdloader.distributed.group import current_world
from mdloader.errors import DataError
from mdloader.loading.loader import DpLoaderSet
from mdloader.loading.statistics import report_line, sharded_pass
from mdloader.stats.merging import merge_all
from mdloader.stats.moments import FeatureMoments
from mdloader.stats.output import OutputSamples, output_bias, system_samples
from mdloader.train.guards import nonfinite_data, small_box_in_batch
from mdloader.train.model import RadialPotential
from mdloader.transport import to_device

log = logging.getLogger(__name__)

#: Bumped when :meth:`RadialPotential.features` changes: cached feature moments then miss.
FEATURES_VERSION = 1

#: Batches of every system whose frames give the feature scales (at most ``data_stat_nbatch``).
FEATURE_NBATCH = 1

#: Bytes of float64 intermediates one chunk of frames may take in ``RadialPotential.features``
#: (a few [frames, atoms, atoms, nbasis] arrays).
CHUNK_BYTES = 1 << 26


def frames_of(data: DpLoaderSet, nbatch: int) -> Callable[[int], np.ndarray]:
    """The statistics frames of each system position of ``data`` (its plan's seed and sizes);
    every frame under ``MDLOADER_STAT_FRAMES=all``."""
    plan = data.plan
    if settings.resolve("stat_frames") == "all":
        return lambda position: np.arange(int(plan.nframes[position]), dtype=np.int64)
    return lambda position: plan.statistics_frames(position, nbatch)


def feature_settings(model: RadialPotential) -> dict[str, Any]:
    """What the model's features depend on, besides the frames and the ``type_map``."""
    return {"model": "RadialPotential", "version": FEATURES_VERSION, "rcut": model.rcut,
            "nbasis": model.nbasis, "ntypes": model.ntypes}


def system_features(model: RadialPotential, dataset: Any, fids: Sequence[int], *,
                    device: torch.device) -> FeatureMoments:
    """The feature moments of the real atoms of frames ``fids`` of one system.

    The frames are first checked: a NaN/inf coordinate, box or energy raises an error naming
    the system, the file and the frame.
    """
    fids = np.sort(np.asarray(fids, dtype=np.int64)).tolist()
    natoms = max(int(dataset.meta.natoms), 1)
    chunk = max(1, CHUNK_BYTES // (4 * natoms * natoms * model.nbasis * 8))
    total = FeatureMoments.zeros(model.ntypes * model.nbasis)
    for lo in range(0, len(fids), chunk):
        batch = dataset.get_batch(fids[lo:lo + chunk])
        bad = nonfinite_data(batch, dataset, "the statistics cannot use these frames",
                             keys=("coord", "box", "energy"))
        if bad is not None:
            raise bad
        box = batch["box"]
        atype = to_device(batch["atype"], device, torch.long)
        try:
            with torch.no_grad():
                feats = model.features(to_device(batch["coord"], device, torch.float64), atype,
                                       None if box is None else to_device(box, device,
                                                                          torch.float64))
        except DataError as exc:  # a box too small for the cutoff (boxes read with the frames)
            if exc.system is not None or box is None:
                raise
            raise small_box_in_batch(exc, batch, dataset) from exc
        rows = feats[atype >= 0].cpu().numpy()
        total = total.merge(FeatureMoments.of_rows(rows))
    return total


def _merged(samples: Sequence[OutputSamples], ntypes: int) -> OutputSamples:
    """Every system's samples in global order (system position, frame), with a type count for
    each of the model's ``ntypes`` types; positions are set here, as a cached entry may come
    from another job. One concatenation: merging pairwise sorts everything again at each step."""
    counts, positions = [], []
    for position, part in enumerate(samples):
        counts.append(np.pad(part.counts, ((0, 0), (0, ntypes - part.counts.shape[1]))))
        positions.append(np.column_stack([np.full(len(part.positions), position, np.int64),
                                          part.positions[:, 1]]))
    return OutputSamples("energy", np.concatenate(counts),
                         np.concatenate([part.labels for part in samples]),
                         np.concatenate(positions))


def fit_statistics(model: RadialPotential, data: DpLoaderSet, *, nbatch: int,
                   device: torch.device) -> None:
    """Set the model's energy bias and feature scales from the statistics frames of every
    system of ``data`` (collective: every rank calls it and sets the same values)."""
    frames = frames_of(data, nbatch)
    main = current_world().is_main
    parts, report = sharded_pass(
        data.systems, "feature", feature_settings(model), data.type_map,
        lambda ds, fids: system_features(model, ds, fids, device=device),
        frames=frames_of(data, min(nbatch, FEATURE_NBATCH)))
    if main:
        log.info(report_line("feature", report))
    samples, report = sharded_pass(
        data.systems, "output", {"key": "energy"}, data.type_map,
        lambda ds, fids: system_samples(ds, 0, key="energy", frames=fids), frames=frames)
    if main:
        log.info(report_line("output", report))
    error = None
    try:  # the same on every rank: a failure here is every rank's
        merged = _merged(samples, model.ntypes)
        bias, _ = output_bias(merged)
        mean, std = merge_all([FeatureMoments.zeros(model.ntypes * model.nbasis),
                               *parts]).mean_std()
        model.set_statistics(bias[:, 0], mean, std)
    except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
        error = exc
    fail_together(error, context="setting the model statistics")
    if main:
        log.info("energy bias per type from %d frames: %s", len(merged.labels),
                 np.array2string(bias[:, 0], precision=4))
