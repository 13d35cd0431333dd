"""The statistics before training, sharded: each rank takes a disjoint share of the systems,
reuses or computes each system's partial result, and one all-gather gives every rank all parts.

Shares are balanced by work (frames x atoms, :mod:`mdloader.stats.shards`); every rank merges
the parts in system order, so the result is the same on every rank and at every world size.
Partial results are cached per system (:mod:`mdloader.catalog.stats_store`) under a key of the
system's content stamp and everything the statistic depends on (:mod:`mdloader.stats.cache`):
a restart or a data set with new systems computes only what is new or changed.

A failure on any rank (overlapping atoms, a non-finite or degenerate box, an unreadable file)
reaches every rank as the same one-line :class:`~mdloader.errors.RemoteError` naming the rank,
system and file, before the first step. Each pass logs one line on rank 0,
``<kind> statistics: N systems in X s (cached M, computed K on R ranks)``, for benchmarks to read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mdloader.catalog.stats_store import StatsStore, system_stamp
from mdloader.distributed.collectives import gather_from_every_rank
from mdloader.distributed.group import current_world
from mdloader.errors import CorruptFileError, MdloaderError
from mdloader.loading.system_list import natoms_of, nframes_of
from mdloader.settings import cache_folder, resolve
from mdloader.stats import cache, env_mat
from mdloader.stats.env_mat import EnvMatSettings, EnvMatSums, system_env_sums
from mdloader.stats.neighbours import (
    DEEPMD_BATCH_ATOMS,
    NeighbourStats,
    merge_all,
    system_neighbour_stats,
)
from mdloader.stats.output import OutputSamples, system_samples
from mdloader.stats.shards import share, system_weights

log = logging.getLogger(__name__)


def stats_store(mode: str | None = None, folder: str | None = None) -> tuple[StatsStore, str]:
    """The cache store and mode (``check``, ``refresh`` or ``off``; ``$MDLOADER_STATS``).

    ``folder`` defaults to ``$MDLOADER_CACHE_DIR/statistics``.
    """
    mode = str(resolve("stats_mode", mode, argument="stats_mode"))
    if mode == "off":
        return StatsStore(None), mode
    folder = folder or cache_folder("statistics")
    return StatsStore(folder), mode


def layout_of(meta: Any) -> tuple[bool, tuple[str, ...]]:
    """The catalog layout of a system (may have ``type_map.raw``; its set names)."""
    return True, tuple(s.name for s in meta.sets)


def _progress(items: Sequence[int], desc: str, show: bool | None) -> Any:
    if show is None:
        show = current_world().is_main and sys.stderr.isatty() and log.isEnabledFor(logging.INFO)
    if not show:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"mdloader: {desc}", unit="sys", file=sys.stderr,
                dynamic_ncols=True)


def sharded_pass(datasets: Sequence[Any], kind: str, settings: Mapping[str, Any],
                 type_map: Sequence[str] | None, compute: Callable[[Any], Any], *,
                 mode: str | None = None, folder: str | None = None,
                 progress: bool | None = None,
                 frames: Callable[[int], Sequence[int] | None] | None = None,
                 ) -> tuple[list[Any], dict[str, float]]:
    """Every system's partial ``kind`` statistics, in system order, on every rank.

    ``compute(dataset)`` gives one system's partial result (a type :mod:`mdloader.stats.cache`
    can store); ``settings`` and ``type_map`` key the cache with each system's stamp;
    ``frames(position)`` names the frames entering (``None``: all). Returns the parts and
    ``{"seconds", "systems", "cached", "computed"}`` summed over ranks.
    """
    world = current_world()
    start = time.monotonic()
    store, mode = stats_store(mode, folder)
    weights = system_weights(nframes_of(datasets), natoms_of(datasets))
    mine = share(weights, world.rank, world.world_size).tolist()
    parts: list[tuple[int, bytes]] = []
    cached = 0
    error, dataset = None, None
    try:
        for position in _progress(mine, f"{kind} statistics", progress):
            dataset = datasets[position]
            chosen = None if frames is None else frames(position)
            key = stamp = None
            if store.folder is not None:
                stamp = system_stamp(dataset.meta.address, layout_of(dataset.meta))
                key = cache.cache_key(stamp, kind, settings, type_map, chosen)
            payload = (store.get(stamp, key) if stamp is not None and key is not None
                       and mode == "check" else None)
            if payload is not None and not _readable(payload, store.path(stamp, key)):
                payload = None
            if payload is not None:
                cached += 1
            else:
                payload = cache.dumps(compute(dataset) if chosen is None
                                      else compute(dataset, chosen))
                if stamp is not None and key is not None:
                    store.put(stamp, key, payload)
            parts.append((position, payload))
    except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
        if not isinstance(exc, MdloaderError) and dataset is not None:  # a bug: say where
            exc.add_note(f"while computing the {kind} statistics of {dataset.meta.address}")
        error = exc
    store.report_failures()
    gathered = gather_from_every_rank((parts, cached), error, context=f"{kind} statistics")
    ordered = sorted((p for rank_parts, _ in gathered for p in rank_parts), key=lambda p: p[0])
    results = [cache.loads(payload) for _, payload in ordered]
    total_cached = sum(c for _, c in gathered)
    report = {"seconds": time.monotonic() - start, "systems": len(results),
              "cached": total_cached, "computed": len(results) - total_cached,
              "ranks": world.world_size}
    return results, report


def _readable(payload: bytes, source: str) -> bool:
    try:
        cache.loads(payload, source=source)
    except CorruptFileError as exc:
        log.warning("%s: computing it again", exc)
        return False
    return True


def report_line(kind: str, report: Mapping[str, float]) -> str:
    """The one line each pass logs (benchmarks parse it)."""
    return (f"{kind} statistics: {int(report['systems'])} systems in {report['seconds']:.2f} s "
            f"(cached {int(report['cached'])}, computed {int(report['computed'])} on "
            f"{int(report['ranks'])} ranks)")


def neighbour_statistics(datasets: Sequence[Any], rcut: float, *,
                         type_map: Sequence[str] | None, mixed_type: bool,
                         ntypes: int | None = None, mode: str | None = None,
                         folder: str | None = None, progress: bool | None = None,
                         ) -> NeighbourStats:
    """DeePMD-kit's neighbour statistics of all ``datasets``, sharded over the ranks.

    ``ntypes`` defaults to DeePMD-kit's ``max(len(type_map), data types)``. Atoms without a
    neighbour are logged as a warning on rank 0 (DeePMD-kit warns too); overlapping atoms and
    bad boxes raise on every rank.
    """
    if ntypes is None:
        data_ntypes = max((d.meta.ntypes for d in datasets), default=0)
        ntypes = max(len(type_map or ()), data_ntypes)
    settings = {"rcut": float(rcut), "mixed_type": bool(mixed_type), "ntypes": int(ntypes),
                "batch_atoms": DEEPMD_BATCH_ATOMS}
    parts, report = sharded_pass(
        datasets, "neighbour", settings, type_map,
        lambda ds: system_neighbour_stats(ds, rcut, ntypes, mixed_type=mixed_type),
        mode=mode, folder=folder, progress=progress)
    stats = merge_all([NeighbourStats.empty(rcut, ntypes, mixed_type), *parts])
    if current_world().is_main:
        log.info(report_line("neighbour", report))
        for finding in stats.findings[:10]:
            log.warning("%s", finding)
        if len(stats.findings) > 10:
            log.warning("%d more systems have atoms without neighbours",
                        len(stats.findings) - 10)
        log.info("neighbour statistics: minimal distance %.6f, maximal neighbours %s "
                 "(rcut %g)", stats.min_distance, list(stats.max_neighbours), rcut)
    return stats



def input_statistics(datasets: Sequence[Any], blocks: Sequence[EnvMatSettings], *,
                     type_map: Sequence[str] | None, key: str = "energy",
                     mode: str | None = None, folder: str | None = None,
                     progress: bool | None = None,
                     frames: Callable[[int], Sequence[int] | None] | None = None,
                     ) -> tuple[list[EnvMatSums], list[OutputSamples]]:
    """The input statistics of the frames of ``datasets``, sharded over the ranks.

    Returns, on every rank, the merged environment-matrix sums of each descriptor block in
    ``blocks`` and each system's output samples of ``key`` (system order), from which
    DeePMD-kit's ``davg``/``dstd`` and output bias follow. The datasets must require ``key``.
    ``frames(position)`` names the frames of a system that enter (``None``: all of them, the
    default for every system), so a subset drawn from the job's seed is computed in shares too.
    """
    sums = []
    for block in blocks:
        parts, report = sharded_pass(
            datasets, "environment", dataclasses.asdict(block), type_map,
            lambda ds, chosen=None, block=block: system_env_sums(ds, block, frames=chosen),
            mode=mode, folder=folder, progress=progress, frames=frames)
        sums.append(env_mat.merge_all([EnvMatSums.zeros(block.ntypes), *parts]))
        if current_world().is_main:
            log.info(report_line("environment", report))
    parts, report = sharded_pass(
        datasets, "output", {"key": key}, type_map,
        lambda ds, chosen=None: system_samples(ds, 0, key=key, frames=chosen),
        mode=mode, folder=folder, progress=progress, frames=frames)
    if current_world().is_main:
        log.info(report_line("output", report))
    # a cached entry may come from another job, where the system had another position
    samples = [dataclasses.replace(part, positions=np.column_stack(
        [np.full(len(part.positions), i, dtype=np.int64), part.positions[:, 1]]))
        for i, part in enumerate(parts)]
    return sums, samples


#: Atom-frames per second of the neighbour pass on one rank, a rounded measurement (see
#: docs/statistics.md); ``mdloader check`` turns it into an estimate, never a promise.
NEIGHBOUR_RATE = 20_000.0


def cached_systems(metas: Sequence[Any], rcut: float, *, type_map: Sequence[str] | None,
                   mixed_type: bool, ntypes: int, folder: str | None = None) -> int:
    """How many of the systems ``metas`` have a neighbour-statistics cache entry at ``rcut``
    (0 when the cache is off); reads file status only."""
    store, mode = stats_store(None, folder)
    if store.folder is None or mode != "check":
        return 0
    settings = {"rcut": float(rcut), "mixed_type": bool(mixed_type), "ntypes": int(ntypes),
                "batch_atoms": DEEPMD_BATCH_ATOMS}
    found = 0
    for meta in metas:
        stamp = system_stamp(meta.address, layout_of(meta))
        key = cache.cache_key(stamp, "neighbour", settings, type_map)
        found += os.path.isfile(store.path(stamp, key))
    return found
