"""Build the systems of a job: rank 0 reads the data tree, every rank gets the same lists.

A job names one or more ``systems`` lists (:class:`Section`: the training and validation data of
every task). The build is one road for all of them:

1. Rank 0 alone obtains the catalog (:func:`mdloader.catalog.catalog.catalog_for`) of each
   distinct request (sections with the same entries, patterns, type map and index file share
   one): from its system index when that is still true, else by discovering the systems and
   describing them from headers only (no frames), in a loop, in threads when the file system
   makes it wait, or in spawned processes for very large CPU-bound builds (never forked: rank 0
   holds a process group).
2. It pickles their :class:`~mdloader.catalog.table.SystemTable` s -- or its failure -- into one
   packet *before* any collective, so every rank either gets the tables or raises the same
   :class:`~mdloader.errors.RemoteError` naming the system and the file.
3. Every rank checks the count and that its payload digest equals rank 0's; the datasets are
   made from the tables when first used (no I/O). Rank 0 then saves the catalogs as indexes.
4. With ``$MDLOADER_STAGE_DIR``, the first rank of each node copies the systems to that
   node-local folder, or reuses the copies still fresh, and every rank reads the copies
   (:func:`stage_tables`, :mod:`mdloader.catalog.staging`).

Other ranks never touch the data tree, nor the index, during the build (the stagers of step 4
read each file once, after it). One list of systems
(:func:`build_systems`) is the job of one section. ``docs/benchmarks.md`` gives the
measurements behind the choice of loop, threads or processes.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mdloader.catalog.catalog import Catalog, catalog_for
from mdloader.catalog.describe import SystemFailed
from mdloader.catalog.staging import relocate, sources_of, stage
from mdloader.catalog.table import SystemTable
from mdloader.distributed.channel import world_channel
from mdloader.distributed.collectives import gather_from_every_rank
from mdloader.distributed.group import current_world
from mdloader.distributed.packets import Packet, data_packet, digest, error_packet, open_packet
from mdloader.errors import (
    CollectiveTimeoutError,
    ConfigError,
    DistributedError,
    RemoteError,
)
from mdloader.loading.system_list import SystemDatasets
from mdloader.settings import resolve
from mdloader.world import World

log = logging.getLogger(__name__)

CONTEXT = "discovering and building the systems"
STAGING = "staging the data to each node's $MDLOADER_STAGE_DIR"


@dataclass(frozen=True)
class Section:
    """One ``systems`` list of a job: its task (``None`` single-task), role (``"training"``,
    ``"validation"``), entries, ``rglob_patterns``, type map, index file, and the JSON path of
    its ``systems`` (named by the error for an entry that does not exist)."""

    task: str | None
    role: str
    systems: tuple[str, ...]
    rglob_patterns: tuple[str, ...] | None = None
    type_map: tuple[str, ...] | None = None
    index_file: str | None = None
    key: str = "systems"

    @classmethod
    def of(cls, task: str | None, role: str, systems: str | Sequence[str],
           rglob_patterns: Sequence[str] | None = None, type_map: Sequence[str] | None = None,
           *, index_file: str | os.PathLike[str] | None = None,
           key: str = "systems") -> Section:
        """A section from the input's values (a single path counts as a one-entry list)."""
        entries = (systems,) if isinstance(systems, str) else tuple(systems)
        return cls(task, role, entries, tuple(rglob_patterns) if rglob_patterns else None,
                   tuple(type_map) if type_map else None,
                   None if index_file is None else os.fspath(index_file), key)

    @property
    def request(self) -> tuple[Any, ...]:
        """What the catalog depends on: sections with equal requests share their systems."""
        return self.systems, self.rglob_patterns, self.type_map, self.index_file


def _catalogs_sum(attribute: str, default: Any) -> Any:
    """A report field summed over rank 0's catalogs (``default`` where none was built)."""

    def read(report: BuildReport) -> Any:
        if not report.catalogs:
            return default
        return sum(getattr(c, attribute) for c in report.catalogs)

    return property(read)


def _catalogs_one(attribute: str, default: Any) -> Any:
    """A report field of rank 0's catalogs: their common value (``default`` where none was
    built; a mixed value joins the distinct ones)."""

    def read(report: BuildReport) -> Any:
        values = [getattr(c, attribute) for c in report.catalogs]
        distinct = list(dict.fromkeys(v for v in values if v is not None))
        if not distinct:
            return default
        return distinct[0] if len(distinct) == 1 else ", ".join(map(str, distinct))

    return property(read)


@dataclass(frozen=True)
class BuildReport:
    """What the build did and how long each phase took (seconds as seen by this rank).

    The catalogs' fields (discovery, description, index) are read from rank 0's
    :class:`~mdloader.catalog.catalog.Catalog` s; other ranks report their defaults.
    """

    nsys: int
    nframes: int
    broadcast_seconds: float  # on other ranks: includes the wait for rank 0
    verify_seconds: float  # unpickle, check every entry, wrap, compare digests
    payload_bytes: int
    num_workers: int  # the most threads the build may use (it runs serially on a fast disk)
    world_size: int
    catalogs: tuple[Catalog, ...] = field(default=(), repr=False, compare=False)  # rank 0's

    discovery_seconds = _catalogs_sum("discovery_seconds", 0.0)
    build_seconds = _catalogs_sum("build_seconds", 0.0)
    index_seconds = _catalogs_sum("check_seconds", 0.0)  # loading and checking the indexes
    described = _catalogs_sum("described", 0)  # systems whose headers rank 0 read
    reused = _catalogs_sum("reused", 0)  # systems taken from an index
    source = _catalogs_one("source", "received")  # "built", "index", "index (updated)", ...
    index_file = _catalogs_one("index_file", None)  # the index file read or written (rank 0)

    def summary(self) -> str:
        verb = "built" if self.source == "built" else "loaded"
        line = (f"{verb} {self.nsys} systems ({self.nframes} frames), up to {self.num_workers} "
                f"threads: discovery {self.discovery_seconds:.2f} s, build "
                f"{self.build_seconds:.2f} s, broadcast {self.broadcast_seconds:.2f} s of "
                f"{self.payload_bytes} bytes to {self.world_size} ranks, verification "
                f"{self.verify_seconds:.2f} s")
        if self.index_file is not None:
            line += (f"; {self.source} {self.index_file}: checked in {self.index_seconds:.2f} s, "
                     f"{self.reused} reused, {self.described} described")
        return line


@dataclass(frozen=True)
class JobSystems:
    """The datasets of every section of a job (sections with equal requests share one list),
    and the report of its one build."""

    sections: tuple[Section, ...]
    views: dict[Section, SystemDatasets]
    report: BuildReport

    def view(self, section: Section) -> SystemDatasets:
        """The datasets of ``section``."""
        return self.views[section]

    def find(self, systems: str | Sequence[str], rglob_patterns: Sequence[str] | None,
             type_map: Sequence[str] | None) -> SystemDatasets | None:
        """The datasets of the first section with these values (any index file), or ``None``
        when the job has none."""
        wanted = Section.of(None, "", systems, rglob_patterns, type_map).request[:3]
        for section in self.sections:
            if section.request[:3] == wanted:
                return self.views[section]
        return None


def build_job(sections: Sequence[Section], *, num_workers: int | None = None,
              timeout: float | None = None, progress: bool = True,
              index_mode: str | None = None) -> JobSystems:
    """Obtain every section's systems with one rank-0 build and one broadcast.

    Parameters
    ----------
    sections
        Every ``systems`` list of the job (all tasks, training and validation).
    num_workers
        Most threads rank 0 uses to walk, describe and check (``$MDLOADER_BUILD_WORKERS``,
        default 32), only when the file system makes them wait (see the module docstring).
    timeout
        Seconds the other ranks wait for rank 0 (``$MDLOADER_BUILD_TIMEOUT``, default 1800).
    progress
        Report the progress of describing on rank 0 (:func:`mdloader.logs.progress`: a bar
        on a terminal, else log lines).
    index_mode
        What to do with each section's system index (its ``index_file``, else one in
        ``$MDLOADER_CACHE_DIR`` named after the request): ``check``, ``refresh``, ``trust`` or
        ``off`` (``$MDLOADER_INDEX``, default ``check``); see :mod:`mdloader.catalog.catalog`.

    Raises
    ------
    DataError, ConfigError
        Without a process group (or with one rank): rank 0's error, naming the system and file.
    RemoteError
        With several ranks, on every rank, when rank 0 failed; it names the system and file.
    DistributedError, CollectiveTimeoutError
        Verification failed on some rank, or rank 0 did not answer in time.
    """
    sections = tuple(sections)
    requests: list[Section] = []
    for section in sections:
        if all(section.request != seen.request for seen in requests):
            requests.append(section)
    world = current_world()
    workers = resolve_workers(num_workers)
    options = {"workers": workers, "mode": index_mode, "progress": progress}
    catalogs: tuple[Catalog, ...] = ()
    if not world.distributed:
        try:
            catalogs = _catalogs(requests, options)
        except SystemFailed as failed:
            raise failed.original() from None
        tables = [c.table for c in catalogs]
        broadcast = verify = 0.0
        payload_bytes = 0
    else:
        channel = world_channel(timeout=timeout, setting="build_timeout", activity=CONTEXT)
        packet = None
        if world.is_main:
            catalogs, packet = _packet_on_rank0(requests, options)
        start = time.monotonic()
        packet = channel.broadcast(packet)
        received = time.monotonic()
        tables = open_packet(packet, rank=world.rank)  # raises rank 0's failure on every rank
        problem = _problem(tables, len(requests), packet.count)
        channel.agree(digest(packet.payload), problem)
        broadcast, verify = received - start, time.monotonic() - received
        payload_bytes = len(packet.payload)
    for catalog in catalogs:
        catalog.save()
    tables = stage_tables(tables, world)
    by_request = {r.request: SystemDatasets(t) for r, t in zip(requests, tables, strict=True)}
    report = BuildReport(sum(len(t) for t in tables), sum(int(t.nframes().sum()) for t in tables),
                         broadcast, verify, payload_bytes,
                         workers if world.is_main else 0, world.world_size, catalogs)
    if world.is_main:
        log.info(report.summary())
        log.info("job systems: one build of %d sections (%d distinct requests, %d systems), "
                 "one broadcast of %d bytes to %d ranks", len(sections), len(requests),
                 report.nsys, payload_bytes, world.world_size)
    return JobSystems(sections, {s: by_request[s.request] for s in sections}, report)


def stage_tables(tables: Sequence[SystemTable], world: World) -> list[SystemTable]:
    """The tables read from node-local copies when ``$MDLOADER_STAGE_DIR`` names a folder
    (:mod:`mdloader.catalog.staging`), else unchanged.

    The first rank of each node (``LOCAL_RANK`` 0) copies every system's container there, or
    reuses a copy still fresh; every rank of every node then waits in one gather, bounded by
    ``$MDLOADER_BUILD_TIMEOUT``, which hands a stager's failure to every rank as the same
    :class:`~mdloader.errors.RemoteError`. The ranks of one node must name one folder.
    """
    stage_dir = str(resolve("stage_dir"))
    if not stage_dir:
        return list(tables)
    stage_dir = os.path.abspath(os.path.expanduser(stage_dir))
    report, error = None, None
    if world.local_rank == 0:
        try:
            report = stage(sources_of(tables), stage_dir,
                           limit_bytes=int(resolve("stage_bytes")))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = exc
    try:
        # the node and its folder only: a stager's report (its list of copied sources) stays
        # in its own log, so what each rank receives is a few bytes per rank
        parts = gather_from_every_rank((world.node, stage_dir), error,
                                       timeout=float(resolve("build_timeout")), context=STAGING)
    except (RemoteError, CollectiveTimeoutError):
        raise
    except DistributedError as exc:  # a peer left: a stager died, or its node was lost
        raise DistributedError(
            f"rank {world.rank}: another rank left the job while the nodes staged their data "
            "(a node's stager, its LOCAL_RANK 0, copying to its $MDLOADER_STAGE_DIR, failed or "
            "was killed: see its own output and the launcher's)") from exc
    folders: dict[int, set[str]] = {}
    for node, folder in parts:
        folders.setdefault(node, set()).add(folder)
    mixed = {node: sorted(f) for node, f in folders.items() if len(f) > 1}
    if mixed:
        raise ConfigError(f"the ranks of a node name different stage folders: {mixed}; give "
                          "every rank of a node the same MDLOADER_STAGE_DIR",
                          path="MDLOADER_STAGE_DIR")
    if report is not None:
        log.info("node %d: %s", world.node, report.summary())
    return [relocate(t, stage_dir) for t in tables]


def build_systems(systems: str | Sequence[str], type_map: Sequence[str] | None = None, *,
                  rglob_patterns: Sequence[str] | None = None, num_workers: int | None = None,
                  timeout: float | None = None, progress: bool = True,
                  index_file: str | os.PathLike[str] | None = None,
                  index_mode: str | None = None, key: str = "systems") -> SystemDatasets:
    """One dataset per system, the same list on every rank (:func:`build_systems_with_report`)."""
    return build_systems_with_report(systems, type_map, rglob_patterns=rglob_patterns,
                                     num_workers=num_workers, timeout=timeout,
                                     progress=progress, index_file=index_file,
                                     index_mode=index_mode, key=key)[0]


def build_systems_with_report(
    systems: str | Sequence[str], type_map: Sequence[str] | None = None, *,
    rglob_patterns: Sequence[str] | None = None, num_workers: int | None = None,
    timeout: float | None = None, progress: bool = True,
    index_file: str | os.PathLike[str] | None = None, index_mode: str | None = None,
    key: str = "systems",
) -> tuple[SystemDatasets, BuildReport]:
    """The job of one ``systems`` list (:func:`build_job`): its datasets, as a list-like
    :class:`~mdloader.loading.system_list.SystemDatasets` that makes each
    :class:`~mdloader.data.dataset.DeepmdDataSetForLoader` when first used, and the report.

    ``systems`` and ``rglob_patterns`` are read as
    :func:`mdloader.catalog.discover.discover_systems` reads them (only on rank 0); ``type_map``
    is the model's; ``index_file`` the system index (default: one in ``$MDLOADER_CACHE_DIR``
    named after the request); ``key`` the JSON path of ``systems``. The other arguments and the
    errors are :func:`build_job`'s.
    """
    section = Section.of(None, "training", systems, rglob_patterns, type_map,
                         index_file=index_file, key=key)
    job = build_job([section], num_workers=num_workers, timeout=timeout, progress=progress,
                    index_mode=index_mode)
    return job.view(section), job.report


def resolve_workers(num_workers: int | None = None) -> int:
    """The argument, else ``$MDLOADER_BUILD_WORKERS``, else 32."""
    return int(resolve("build_workers", num_workers, argument="num_workers"))


def _catalogs(requests: Sequence[Section], options: dict[str, Any]) -> tuple[Catalog, ...]:
    """Rank 0's catalog of each request, in order."""
    return tuple(catalog_for(list(r.systems), r.type_map, r.rglob_patterns,
                             index_file=r.index_file, key=r.key, **options) for r in requests)


def _packet_on_rank0(requests: Sequence[Section],
                     options: dict[str, Any]) -> tuple[tuple[Catalog, ...], Packet]:
    """Rank 0's catalogs and the packet of their tables, or the packet of the first failure."""
    try:
        catalogs = _catalogs(requests, options)
    except SystemFailed as failed:
        return (), error_packet(failed.__cause__, rank=0, context=CONTEXT,
                                system=failed.address)
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return (), error_packet(exc, rank=0, context=CONTEXT)
    tables = [c.table for c in catalogs]
    packet = data_packet(tables, rank=0, count=sum(len(t) for t in tables),
                         context="serializing the system descriptions",
                         describe=lambda exc: {"system": _unpicklable(tables)})
    return catalogs, packet


def _unpicklable(tables: Sequence[SystemTable]) -> str | None:
    """The address (or repr) of the first entry pickle refuses, to name it in the error."""
    for table in tables:
        for meta in table:
            try:
                pickle.dumps(meta)
            except Exception:  # noqa: BLE001 - looking for the culprit
                return getattr(meta, "address", None) or repr(meta)[:200]
    return None


def _problem(received: Any, ntables: int, nsys: int) -> str | None:
    """The calling rank's verification problem (``None`` when all is well)."""
    if not (isinstance(received, list) and all(isinstance(t, SystemTable) for t in received)):
        return f"expected {ntables} system tables from rank 0, found {type(received).__name__}"
    if len(received) != ntables:
        return f"received {len(received)} system tables, this job has {ntables} requests"
    count = sum(len(t) for t in received)
    if count != nsys:
        return f"received {count} system descriptions, rank 0 sent {nsys}"
    return None
