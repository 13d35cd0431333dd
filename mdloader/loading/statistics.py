"""The statistics before training, sharded: each rank takes a disjoint share of the systems,
reuses or computes each system's partial result, and one all-gather gives every rank all parts.

Shares are balanced by work (frames x atoms, :mod:`mdloader.stats.shards`); every rank merges
the parts in system order, so the result is the same on every rank and at every world size.
Partial results are cached per system (:mod:`mdloader.stats.store`) under a key of the
system's content stamp and everything the statistic depends on (:mod:`mdloader.stats.cache`):
a restart or a data set with new systems computes only what is new or changed.

A failure on any rank (overlapping atoms, a non-finite or degenerate box, an unreadable file)
reaches every rank as the same one-line :class:`~mdloader.errors.RemoteError` naming the rank,
system and file, before the first step. Each pass logs one line on rank 0,
``<kind> statistics: N systems in X s (cached M, computed K on R ranks)``, for benchmarks to read.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mdloader import logs
from mdloader.distributed.collectives import gather_from_every_rank
from mdloader.distributed.group import current_world
from mdloader.errors import CorruptFileError, MdloaderError, add_note
from mdloader.loading.system_list import natoms_of, nframes_of
from mdloader.settings import cache_folder, resolve
from mdloader.stats import cache
from mdloader.stats.env_mat import EnvMatSettings, EnvMatSums, system_env_sums
from mdloader.stats.merging import merge_all
from mdloader.stats.neighbours import DEEPMD_BATCH_ATOMS, NeighbourStats, system_neighbour_stats
from mdloader.stats.output import OutputSamples, system_samples
from mdloader.stats.shards import share, system_weights
from mdloader.stats.store import StatsStore, system_stamp

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


@dataclasses.dataclass(frozen=True)
class StatPass:
    """One statistic over one list of systems, a part of a joint pass (:func:`joint_pass`).

    ``compute(dataset)`` (``compute(dataset, chosen)`` when ``frames(position)`` names frames)
    gives one system's partial result, a type :mod:`mdloader.stats.cache` can store;
    ``settings`` and ``type_map`` key it with the system's stamp. A pass not ``cached`` (its
    result depends on more than the system, e.g. a model's weights) is computed each time and
    may return any picklable object.
    """

    datasets: Sequence[Any]
    kind: str
    settings: Mapping[str, Any]
    type_map: Sequence[str] | None
    compute: Callable[..., Any]
    frames: Callable[[int], Sequence[int] | None] | None = None
    cached: bool = True


@dataclasses.dataclass
class JointReport:
    """What one joint pass did: per kind ``{"seconds", "systems", "cached", "computed",
    "ranks"}`` over its distinct parts, and the pass as a whole (one all-gather)."""

    kinds: dict[str, dict[str, float]]
    passes: int
    parts: int
    systems: int
    seconds: float
    ranks: int

    def line(self) -> str:
        """The one line of the pass (tests and benchmarks read it)."""
        return (f"statistics pass: {self.passes} statistics, {self.parts} parts of "
                f"{self.systems} systems in {self.seconds:.2f} s, one all-gather on "
                f"{self.ranks} ranks")


def joint_pass(passes: Sequence[StatPass], *, mode: str | None = None,
               folder: str | None = None, progress: bool = True,
               ) -> tuple[list[list[Any]], JointReport]:
    """Every pass's partial results (system order), on every rank, from ONE all-gather.

    A part is one statistic of one system; parts equal in system, kind, settings, type map and
    frames (two tasks on the same systems) are computed once. Each rank takes a disjoint share
    of the distinct systems, balanced by work (frames x atoms x parts), and does all of their
    parts, each reused from the per-system cache when it holds it. With ``progress``, rank 0
    reports how far its share is (:func:`mdloader.logs.progress`).
    """
    world = current_world()
    start = time.monotonic()
    store, mode = stats_store(mode, folder)
    units: dict[str, int] = {}  # identity of a part -> its index
    unit_rows: list[tuple[int, int, Sequence[int] | None]] = []  # (pass, position, frames)
    where: list[list[int]] = []
    systems: dict[str, int] = {}
    unit_system: list[int] = []
    for p, spec in enumerate(passes):
        row = []
        for position, dataset in enumerate(spec.datasets):
            chosen = None if spec.frames is None else spec.frames(position)
            address = dataset.meta.address
            identity = cache.cache_key(address, spec.kind, spec.settings, spec.type_map, chosen)
            if identity not in units:
                units[identity] = len(unit_rows)
                unit_rows.append((p, position, chosen))
                unit_system.append(systems.setdefault(address, len(systems)))
            row.append(units[identity])
        where.append(row)
    first: dict[int, Any] = {}
    parts_of = np.zeros(len(systems), dtype=np.int64)
    for u, (p, position, _) in enumerate(unit_rows):
        first.setdefault(unit_system[u], passes[p].datasets[position])
        parts_of[unit_system[u]] += 1
    order = [first[i] for i in range(len(systems))]
    weights = system_weights(nframes_of(order), natoms_of(order)) * parts_of
    mine = set(share(weights, world.rank, world.world_size).tolist())
    todo = [u for u in range(len(unit_rows)) if unit_system[u] in mine]
    parts: list[tuple[int, bytes]] = []
    cached: list[int] = []
    stamps: dict[int, Any] = {}
    error, dataset, kind = None, None, ""
    try:
        with logs.progress(len(todo), "statistics", enabled=progress) as bar:
            for u in todo:
                p, position, chosen = unit_rows[u]
                spec = passes[p]
                dataset, kind = spec.datasets[position], spec.kind
                key = stamp = None
                if store.folder is not None and spec.cached:
                    system = unit_system[u]
                    if system not in stamps:
                        stamps[system] = system_stamp(dataset.meta.address,
                                                      layout_of(dataset.meta))
                    stamp = stamps[system]
                    key = cache.cache_key(stamp, spec.kind, spec.settings, spec.type_map,
                                          chosen)
                payload = (store.get(stamp, key) if stamp is not None and key is not None
                           and mode == "check" else None)
                if payload is not None and not _readable(payload, store.path(stamp, key)):
                    payload = None
                if payload is not None:
                    cached.append(u)
                else:
                    result = (spec.compute(dataset) if chosen is None
                              else spec.compute(dataset, chosen))
                    payload = cache.dumps(result) if spec.cached else result
                    if stamp is not None and key is not None:
                        store.put(stamp, key, payload)
                parts.append((u, payload))
                bar.update()
    except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
        if not isinstance(exc, MdloaderError) and dataset is not None:  # a bug: say where
            add_note(exc, f"while computing the {kind} statistics of {dataset.meta.address}")
        error = exc
    store.report_failures()
    kinds = sorted({s.kind for s in passes})
    gathered = gather_from_every_rank((parts, cached), error,
                                      context=f"{'/'.join(kinds) or 'no'} statistics")
    payloads: dict[int, bytes] = {}
    all_cached: set[int] = set()
    for rank_parts, rank_cached in gathered:
        payloads.update(rank_parts)
        all_cached.update(rank_cached)
    decoded = {u: cache.loads(payload) if passes[unit_rows[u][0]].cached else payload
               for u, payload in payloads.items()}
    seconds = time.monotonic() - start
    by_kind: dict[str, dict[str, float]] = {}
    for u, (p, _, _) in enumerate(unit_rows):
        entry = by_kind.setdefault(passes[p].kind, {"seconds": seconds, "systems": 0,
                                                    "cached": 0, "computed": 0,
                                                    "ranks": world.world_size})
        entry["systems"] += 1
        entry["cached" if u in all_cached else "computed"] += 1
    report = JointReport(by_kind, len(passes), len(unit_rows), len(systems), seconds,
                         world.world_size)
    return [[decoded[u] for u in row] for row in where], report


def sharded_pass(datasets: Sequence[Any], kind: str, settings: Mapping[str, Any],
                 type_map: Sequence[str] | None, compute: Callable[[Any], Any], *,
                 mode: str | None = None, folder: str | None = None,
                 progress: bool = True,
                 frames: Callable[[int], Sequence[int] | None] | None = None,
                 ) -> tuple[list[Any], dict[str, float]]:
    """Every system's partial ``kind`` statistics, in system order, on every rank.

    :func:`joint_pass` of one :class:`StatPass`. Returns the parts and
    ``{"seconds", "systems", "cached", "computed", "ranks"}`` summed over ranks.
    """
    results, report = joint_pass(
        [StatPass(datasets, kind, settings, type_map, compute, frames)],
        mode=mode, folder=folder, progress=progress)
    counts = report.kinds.get(kind, {"systems": 0, "cached": 0, "computed": 0})
    return results[0], {"seconds": report.seconds, "systems": len(results[0]),
                        "cached": counts["cached"],
                        "computed": len(results[0]) - counts["cached"],
                        "ranks": report.ranks}


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
                         folder: str | None = None, progress: bool = True,
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



@dataclasses.dataclass(frozen=True)
class InputRequest:
    """The input statistics one model asks of its training systems: the environment settings
    of each descriptor block, the type map, the output ``key`` and the frames that enter
    (``frames(position)``, ``None``: all)."""

    datasets: Sequence[Any]
    blocks: Sequence[EnvMatSettings]
    type_map: Sequence[str] | None
    key: str = "energy"
    frames: Callable[[int], Sequence[int] | None] | None = None

    def passes(self) -> list[StatPass]:
        """One environment pass per block, then the output pass."""
        env = [StatPass(self.datasets, "environment", dataclasses.asdict(block), self.type_map,
                        functools.partial(_env_sums, block=block), self.frames)
               for block in self.blocks]
        return [*env, StatPass(self.datasets, "output", {"key": self.key}, self.type_map,
                               functools.partial(_samples, key=self.key), self.frames)]


def _env_sums(dataset: Any, chosen: Sequence[int] | None = None, *,
              block: EnvMatSettings) -> EnvMatSums:
    return system_env_sums(dataset, block, frames=chosen)


def _samples(dataset: Any, chosen: Sequence[int] | None = None, *, key: str) -> OutputSamples:
    return system_samples(dataset, 0, key=key, frames=chosen)


def job_input_statistics(requests: Sequence[InputRequest], *, mode: str | None = None,
                         folder: str | None = None, progress: bool = True,
                         ) -> list[tuple[list[EnvMatSums], list[OutputSamples]]]:
    """The input statistics of every request (every task of a job) from one joint pass.

    Returns, per request and on every rank, the merged environment-matrix sums of each block
    and each system's output samples (system order), from which DeePMD-kit's ``davg``/``dstd``
    and output bias follow. The datasets must require each request's ``key``. Rank 0 logs a
    line per kind and :meth:`JointReport.line`.
    """
    passes = [request.passes() for request in requests]
    results, report = joint_pass([p for group in passes for p in group], mode=mode,
                                 folder=folder, progress=progress)
    if current_world().is_main:
        for kind, counts in report.kinds.items():
            log.info(report_line(kind, counts))
        log.info(report.line())
    out, at = [], 0
    for request in requests:
        nblocks = len(request.blocks)
        sums = [merge_all([EnvMatSums.zeros(block.ntypes), *results[at + b]])
                for b, block in enumerate(request.blocks)]
        out.append((sums, placed_samples(results[at + nblocks])))
        at += nblocks + 1
    return out


def placed_samples(parts: Sequence[OutputSamples]) -> list[OutputSamples]:
    """Each system's output samples with its position in this list (a part may come from the
    cache of another job or task, where the system had another position)."""
    return [dataclasses.replace(part, positions=np.column_stack(
        [np.full(len(part.positions), i, dtype=np.int64), part.positions[:, 1]]))
        for i, part in enumerate(parts)]


def input_statistics(datasets: Sequence[Any], blocks: Sequence[EnvMatSettings], *,
                     type_map: Sequence[str] | None, key: str = "energy",
                     mode: str | None = None, folder: str | None = None,
                     progress: bool = True,
                     frames: Callable[[int], Sequence[int] | None] | None = None,
                     ) -> tuple[list[EnvMatSums], list[OutputSamples]]:
    """The input statistics of the frames of ``datasets``, sharded over the ranks: the one
    request of :func:`job_input_statistics` (one all-gather for every block and the output).

    ``frames(position)`` names the frames of a system that enter (``None``: all of them, the
    default for every system), so a subset drawn from the job's seed is computed in shares too.
    """
    return job_input_statistics([InputRequest(datasets, blocks, type_map, key, frames)],
                                mode=mode, folder=folder, progress=progress)[0]


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
