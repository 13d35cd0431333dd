"""Build the datasets of a job: rank 0 reads the data tree, every rank gets the same list.

1. Rank 0 alone obtains the catalog (:func:`mdloader.catalog.catalog.catalog_for`): from its
   system index when that is still true, else by discovering the systems and describing them
   from headers only (no frames), in a loop, in threads when the file system makes it wait, or
   in spawned processes for very large CPU-bound builds (never forked: rank 0 holds a process
   group).
2. It pickles them as one :class:`~mdloader.catalog.table.SystemTable` -- or its failure -- into
   one packet *before* any collective, so every rank either gets the table or raises the same
   :class:`~mdloader.errors.RemoteError` naming the system and the file.
3. Every rank checks the type and count and that its payload digest equals rank 0's; the
   datasets are made from the table when first used (no I/O). Rank 0 then saves the catalog
   as its index.

Other ranks never touch the data tree, nor the index, during the build. ``docs/benchmarks.md``
gives the measurements behind the choice of loop, threads or processes.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mdloader.catalog.catalog import Catalog, catalog_for
from mdloader.catalog.describe import SystemFailed
from mdloader.catalog.table import SystemTable
from mdloader.distributed.channel import world_channel
from mdloader.distributed.group import current_world
from mdloader.distributed.packets import Packet, data_packet, digest, error_packet, open_packet
from mdloader.loading.system_list import SystemDatasets
from mdloader.settings import resolve

log = logging.getLogger(__name__)

CONTEXT = "discovering and building the systems"


class _FromCatalog:
    """A report field read from rank 0's catalog; ``default`` on the ranks that received it."""

    def __init__(self, default: Any, attribute: str | None = None) -> None:
        self.default, self.attribute = default, attribute

    def __set_name__(self, owner: type, name: str) -> None:
        self.attribute = self.attribute or name

    def __get__(self, report: BuildReport | None, owner: type | None = None) -> Any:
        if report is None:
            return self
        return self.default if report.catalog is None else getattr(report.catalog, self.attribute)


@dataclass(frozen=True)
class BuildReport:
    """What the build did and how long each phase took (seconds as seen by this rank).

    The catalog's fields (discovery, description, index) are read from rank 0's
    :class:`~mdloader.catalog.catalog.Catalog`; other ranks report their defaults.
    """

    nsys: int
    nframes: int
    broadcast_seconds: float  # on other ranks: includes the wait for rank 0
    verify_seconds: float  # unpickle, check every entry, wrap, compare digests
    payload_bytes: int
    num_workers: int  # the most threads the build may use (it runs serially on a fast disk)
    world_size: int
    catalog: Catalog | None = field(default=None, repr=False, compare=False)  # rank 0's

    discovery_seconds = _FromCatalog(0.0)
    build_seconds = _FromCatalog(0.0)
    source = _FromCatalog("received")  # "built", "index", "index (updated)", "index (trusted)"
    index_file = _FromCatalog(None)  # the index file read or written (rank 0)
    index_seconds = _FromCatalog(0.0, "check_seconds")  # loading and checking the index
    described = _FromCatalog(0)  # systems whose headers rank 0 read
    reused = _FromCatalog(0)  # systems taken from the index

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


def build_systems(systems: str | Sequence[str], type_map: Sequence[str] | None = None, *,
                  rglob_patterns: Sequence[str] | None = None, num_workers: int | None = None,
                  timeout: float | None = None, progress: bool | None = None,
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
    timeout: float | None = None, progress: bool | None = None,
    index_file: str | os.PathLike[str] | None = None, index_mode: str | None = None,
    key: str = "systems",
) -> tuple[SystemDatasets, BuildReport]:
    """Discover and describe the systems on rank 0, share them, verify them on every rank.

    Parameters
    ----------
    systems, rglob_patterns
        As :func:`mdloader.catalog.discover.discover_systems`; only rank 0 reads them.
    type_map
        The model's type map (rank 0's value is used).
    num_workers
        Most threads rank 0 uses to walk, describe and check (``$MDLOADER_BUILD_WORKERS``,
        default 32), only when the file system makes them wait (see the module docstring).
    timeout
        Seconds the other ranks wait for rank 0 (``$MDLOADER_BUILD_TIMEOUT``, default 1800).
    progress
        Show a progress bar on rank 0; default: when stderr is a terminal.
    index_file, index_mode
        The system index file (default: one in ``$MDLOADER_CACHE_DIR`` named after the
        request) and what to do with it: ``check``, ``refresh``, ``trust`` or ``off``
        (``$MDLOADER_INDEX``, default ``check``); see :mod:`mdloader.catalog.catalog`.
    key
        The JSON path of ``systems``, named by the error for an entry that does not exist.

    Returns
    -------
    The datasets, as a list-like :class:`~mdloader.loading.system_list.SystemDatasets` that makes
    each :class:`~mdloader.data.dataset.DeepmdDataSetForLoader` when first used, and the report.

    Raises
    ------
    DataError
        Without a process group (or with one rank): the original error.
    RemoteError
        With several ranks, on every rank, when rank 0 failed; it names the system and file.
    DistributedError, CollectiveTimeoutError
        Verification failed on some rank, or rank 0 did not answer in time.
    """
    world = current_world()
    show = sys.stderr.isatty() if progress is None else progress
    options = {"workers": resolve_workers(num_workers), "progress": show, "index_file": index_file,
               "mode": index_mode, "key": key}
    if not world.distributed:
        try:
            catalog = catalog_for(systems, type_map, rglob_patterns, **options)
        except SystemFailed as failed:
            raise failed.original() from None
        catalog.save()
        table = catalog.table
        report = BuildReport(len(table), int(table.nframes().sum()), broadcast_seconds=0.0,
                             verify_seconds=0.0, payload_bytes=0,
                             num_workers=options["workers"], world_size=1, catalog=catalog)
        log.info(report.summary())
        return SystemDatasets(table), report
    channel = world_channel(timeout=timeout, setting="build_timeout", activity=CONTEXT)
    catalog, packet = None, None
    if world.is_main:
        catalog, packet = _packet_on_rank0(systems, type_map, rglob_patterns, options)
    start = time.monotonic()
    packet = channel.broadcast(packet)
    received = time.monotonic()
    table = open_packet(packet, rank=world.rank)  # raises rank 0's failure on every rank
    datasets, problem = _verify(table, packet.count)
    channel.agree(digest(packet.payload), problem)
    if catalog is not None:
        catalog.save()
    report = BuildReport(len(table), int(table.nframes().sum()), received - start,
                         time.monotonic() - received, len(packet.payload),
                         options["workers"] if catalog is not None else 0, world.world_size,
                         catalog)
    if world.is_main:
        log.info(report.summary())
    return datasets, report


def resolve_workers(num_workers: int | None = None) -> int:
    """The argument, else ``$MDLOADER_BUILD_WORKERS``, else 32."""
    return int(resolve("build_workers", num_workers, argument="num_workers"))


def _packet_on_rank0(systems: Any, type_map: Sequence[str] | None,
                     rglob_patterns: Sequence[str] | None,
                     options: dict[str, Any]) -> tuple[Catalog | None, Packet]:
    """Rank 0's outcome as one packet: the catalog's table, or the first failure."""
    try:
        catalog = catalog_for(systems, type_map, rglob_patterns, **options)
        table = catalog.table
    except SystemFailed as failed:
        return None, error_packet(failed.__cause__, rank=0, context=CONTEXT,
                                  system=failed.address)
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return None, error_packet(exc, rank=0, context=CONTEXT)
    packet = data_packet(table, rank=0, count=len(table),
                         context="serializing the system descriptions",
                         describe=lambda exc: {"system": _unpicklable(table)})
    return catalog, packet


def _unpicklable(metas: SystemTable) -> str | None:
    """The address (or repr) of the first entry pickle refuses, to name it in the error."""
    for meta in metas:
        try:
            pickle.dumps(meta)
        except Exception:  # noqa: BLE001 - looking for the culprit
            return getattr(meta, "address", None) or repr(meta)[:200]
    return None


def _verify(received: Any, count: int) -> tuple[SystemDatasets, str | None]:
    """The calling rank's datasets and its verification problem (``None`` when all is well)."""
    if not isinstance(received, SystemTable):
        return SystemDatasets(SystemTable.from_metas([])), (
            f"expected a SystemTable from rank 0, found {type(received).__name__}")
    if len(received) != count:
        return SystemDatasets(received), (f"received {len(received)} system descriptions, rank "
                                          f"0 sent {count}")
    return SystemDatasets(received), None
