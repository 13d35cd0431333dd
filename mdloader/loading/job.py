"""The systems of a whole job, every task and role at once: one build, one broadcast.

A multi-task DeePMD-kit input names a training (and maybe a validation) ``systems`` list per
task. :func:`build_job` takes all of them as :class:`JobSection` s, lets rank 0 obtain the
catalog of each distinct request (two sections with the same systems, patterns and type map
share one), sends every table in one packet -- one broadcast and one verification for the job --
and returns a view per section: the datasets its ``DpLoaderSet`` takes in place of a build.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mdloader.catalog.catalog import Catalog, catalog_for
from mdloader.catalog.describe import SystemFailed
from mdloader.catalog.table import SystemTable
from mdloader.distributed.channel import world_channel
from mdloader.distributed.group import current_world
from mdloader.distributed.packets import data_packet, digest, error_packet, open_packet
from mdloader.errors import DistributedError
from mdloader.loading.build import CONTEXT, resolve_workers
from mdloader.loading.system_list import SystemDatasets

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSection:
    """One ``systems`` list of the input: its task (``None`` single-task), role
    (``"training"``/``"validation"``), entries, ``rglob_patterns``, type map and JSON path."""

    task: str | None
    role: str
    systems: tuple[str, ...]
    rglob_patterns: tuple[str, ...] | None
    type_map: tuple[str, ...] | None
    key: str = "systems"

    @classmethod
    def of(cls, task: str | None, role: str, systems: str | Sequence[str],
           rglob_patterns: Sequence[str] | None, type_map: Sequence[str] | None,
           key: str = "systems") -> JobSection:
        """A section from the input's values (a single path counts as a one-entry list)."""
        entries = (systems,) if isinstance(systems, str) else tuple(systems)
        return cls(task, role, entries, tuple(rglob_patterns) if rglob_patterns else None,
                   tuple(type_map) if type_map else None, key)

    @property
    def request(self) -> tuple[Any, ...]:
        """What the catalog depends on: sections with equal requests share their systems."""
        return self.systems, self.rglob_patterns, self.type_map


@dataclass
class JobSystems:
    """The job's catalogs (rank 0; ``None`` elsewhere) and the datasets of every section."""

    sections: tuple[JobSection, ...]
    views: dict[JobSection, SystemDatasets]
    catalogs: tuple[Catalog, ...] | None

    def view(self, section: JobSection) -> SystemDatasets:
        """The datasets of ``section`` (sections with equal requests share one list)."""
        return self.views[section]

    def find(self, systems: str | Sequence[str], rglob_patterns: Sequence[str] | None,
             type_map: Sequence[str] | None) -> SystemDatasets | None:
        """The datasets of the section with these values, or ``None`` when the job has none."""
        wanted = JobSection.of(None, "", systems, rglob_patterns, type_map).request
        for section in self.sections:
            if section.request == wanted:
                return self.views[section]
        return None


def build_job(sections: Sequence[JobSection], *, num_workers: int | None = None,
              timeout: float | None = None, index_mode: str | None = None) -> JobSystems:
    """Obtain every section's systems with one rank-0 build and one broadcast.

    Parameters
    ----------
    sections
        Every ``systems`` list of the job (all tasks, training and validation).
    num_workers, timeout, index_mode
        As :func:`mdloader.loading.build.build_systems_with_report`.

    Raises
    ------
    DataError
        Without a process group: rank 0's error, naming the system and file.
    RemoteError
        With several ranks, on every rank, when rank 0 failed.
    """
    sections = tuple(sections)
    requests: list[JobSection] = []
    for section in sections:
        if all(section.request != seen.request for seen in requests):
            requests.append(section)
    world = current_world()
    options = {"workers": resolve_workers(num_workers), "progress": False, "mode": index_mode}
    start = time.monotonic()
    catalogs: tuple[Catalog, ...] | None = None
    if not world.distributed:
        try:
            catalogs = tuple(catalog_for(list(r.systems), r.type_map, r.rglob_patterns,
                                         key=r.key, **options) for r in requests)
        except SystemFailed as failed:
            raise failed.original() from None
        tables = [c.table for c in catalogs]
        payload_bytes = 0
    else:
        channel = world_channel(timeout=timeout, setting="build_timeout", activity=CONTEXT)
        packet = None
        if world.is_main:
            catalogs, packet = _packet_on_rank0(requests, options)
        packet = channel.broadcast(packet)
        tables = open_packet(packet, rank=world.rank)
        problem = None
        if not (isinstance(tables, list) and len(tables) == packet.count
                and all(isinstance(t, SystemTable) for t in tables)):
            problem = f"expected {packet.count} system tables from rank 0"
        channel.agree(digest(packet.payload), problem)
        if problem is not None:
            raise DistributedError(problem)
        payload_bytes = len(packet.payload)
    for catalog in catalogs or ():
        catalog.save()
    by_request = {r.request: SystemDatasets(t) for r, t in zip(requests, tables, strict=True)}
    views = {s: by_request[s.request] for s in sections}
    if world.is_main:
        nsys = sum(len(t) for t in tables)
        log.info("job systems: one build of %d sections (%d distinct requests, %d systems) in "
                 "%.2f s, one broadcast of %d bytes to %d ranks", len(sections), len(requests),
                 nsys, time.monotonic() - start, payload_bytes, world.world_size)
    return JobSystems(sections, views, catalogs)


def _packet_on_rank0(requests: Sequence[JobSection], options: dict[str, Any]) -> tuple[Any, Any]:
    """Rank 0's catalogs and the packet of their tables, or the packet of the first failure."""
    try:
        catalogs = tuple(catalog_for(list(r.systems), r.type_map, r.rglob_patterns, key=r.key,
                                     **options) for r in requests)
        tables = [c.table for c in catalogs]
    except SystemFailed as failed:
        return None, error_packet(failed.__cause__, rank=0, context=CONTEXT,
                                  system=failed.address)
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return None, error_packet(exc, rank=0, context=CONTEXT)
    return catalogs, data_packet(tables, rank=0, count=len(tables),
                                 context="serializing the system descriptions")
