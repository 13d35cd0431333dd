"""Build the datasets of a job: rank 0 reads the data tree, every rank gets the same list.

1. Rank 0 alone discovers the systems and describes them from headers only (no frames), in a
   loop, a thread pool when the disk makes it wait, or spawned processes for very large
   CPU-bound builds (never forked: rank 0 holds a process group).
2. It pickles the list -- or its failure -- into one packet *before* any collective, so every
   rank either gets the list or raises the same :class:`~mdloader.errors.RemoteError` naming the
   system and the file.
3. Every rank checks the count, the type of every entry, and that its payload digest equals rank
   0's, then wraps each entry in a :class:`DeepmdDataSetForLoader` (no I/O).

Other ranks never touch the data tree during the build. ``docs/benchmarks.md`` gives the
measurements behind the choice of loop, threads or processes.
"""

from __future__ import annotations

import logging
import pickle
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.describe import SystemFailed, describe_systems
from mdloader.data.discovery import discover_systems
from mdloader.data.system import SystemMeta
from mdloader.distributed.channel import world_channel
from mdloader.distributed.group import current_world
from mdloader.distributed.packets import Packet, data_packet, digest, error_packet, open_packet
from mdloader.settings import resolve

log = logging.getLogger(__name__)

CONTEXT = "discovering and building the systems"


@dataclass(frozen=True)
class BuildReport:
    """What the build did and how long each phase took (seconds as seen by this rank)."""

    nsys: int
    nframes: int
    discovery_seconds: float
    build_seconds: float
    broadcast_seconds: float  # on other ranks: includes the wait for rank 0
    verify_seconds: float  # unpickle, check every entry, wrap, compare digests
    payload_bytes: int
    num_workers: int  # the most threads the build may use (it runs serially on a fast disk)
    world_size: int

    def summary(self) -> str:
        return (f"built {self.nsys} systems ({self.nframes} frames), up to {self.num_workers} "
                f"threads: discovery {self.discovery_seconds:.2f} s, build "
                f"{self.build_seconds:.2f} s, broadcast {self.broadcast_seconds:.2f} s of "
                f"{self.payload_bytes} bytes to {self.world_size} ranks, verification "
                f"{self.verify_seconds:.2f} s")


def resolve_workers(num_workers: int | None = None) -> int:
    """The argument, else ``$MDLOADER_BUILD_WORKERS``, else 8."""
    return int(resolve("build_workers", num_workers, argument="num_workers"))


def build_systems(systems: str | Sequence[str], type_map: Sequence[str] | None = None, *,
                  rglob_patterns: Sequence[str] | None = None, num_workers: int | None = None,
                  timeout: float | None = None,
                  progress: bool | None = None) -> list[DeepmdDataSetForLoader]:
    """One dataset per system, the same list on every rank (:func:`build_systems_with_report`)."""
    return build_systems_with_report(systems, type_map, rglob_patterns=rglob_patterns,
                                     num_workers=num_workers, timeout=timeout,
                                     progress=progress)[0]


def build_systems_with_report(
    systems: str | Sequence[str], type_map: Sequence[str] | None = None, *,
    rglob_patterns: Sequence[str] | None = None, num_workers: int | None = None,
    timeout: float | None = None, progress: bool | None = None,
) -> tuple[list[DeepmdDataSetForLoader], BuildReport]:
    """Discover and describe the systems on rank 0, share them, verify them on every rank.

    Parameters
    ----------
    systems, rglob_patterns
        As :func:`mdloader.data.discovery.discover_systems`; only rank 0 reads them.
    type_map
        The model's type map (rank 0's value is used).
    num_workers
        Most threads building descriptions on rank 0 (``$MDLOADER_BUILD_WORKERS``, default
        8), used only when the disk makes them wait (see the module docstring).
    timeout
        Seconds the other ranks wait for rank 0 (``$MDLOADER_BUILD_TIMEOUT``, default 1800).
    progress
        Show a progress bar on rank 0; default: when stderr is a terminal.

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
    if not world.distributed:
        workers = resolve_workers(num_workers)
        try:
            metas, times = _discover_and_build(systems, type_map, rglob_patterns, workers,
                                               progress)
        except SystemFailed as failed:
            raise failed.original() from None
        report = _report(metas, times + (0.0, 0.0), 0, workers, 1)
        log.info(report.summary())
        return [DeepmdDataSetForLoader(m) for m in metas], report
    channel = world_channel(timeout=timeout, setting="build_timeout", activity=CONTEXT)
    times, workers, packet = (0.0, 0.0), 0, None
    if world.is_main:
        times, workers, packet = _packet_on_rank0(systems, type_map, rglob_patterns,
                                                  num_workers, progress)
    start = time.monotonic()
    packet = channel.broadcast(packet)
    received = time.monotonic()
    metas = open_packet(packet, rank=world.rank)  # raises rank 0's failure on every rank
    datasets, problem = _verify(metas, packet.count)
    channel.agree(digest(packet.payload), problem)
    report = _report(metas, times + (received - start, time.monotonic() - received),
                     len(packet.payload), workers, world.world_size)
    if world.is_main:
        log.info(report.summary())
    return datasets, report


def _packet_on_rank0(systems: Any, type_map: Sequence[str] | None,
                     rglob_patterns: Sequence[str] | None, num_workers: int | None,
                     progress: bool | None) -> tuple[tuple[float, float], int, Packet]:
    """Rank 0's outcome as one packet: the list of descriptions, or the first failure."""
    try:
        workers = resolve_workers(num_workers)
        metas, times = _discover_and_build(systems, type_map, rglob_patterns, workers, progress)
    except SystemFailed as failed:
        return (0.0, 0.0), 0, error_packet(failed.__cause__, rank=0, context=CONTEXT,
                                           system=failed.address)
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return (0.0, 0.0), 0, error_packet(exc, rank=0, context=CONTEXT)
    packet = data_packet(metas, rank=0, count=len(metas),
                              context="serializing the system descriptions",
                              describe=lambda exc: {"system": _unpicklable(metas)})
    return times, workers, packet


def _discover_and_build(systems: Any, type_map: Sequence[str] | None,
                        rglob_patterns: Sequence[str] | None, workers: int,
                        progress: bool | None) -> tuple[list[SystemMeta], tuple[float, float]]:
    start = time.monotonic()
    addresses = discover_systems(systems, rglob_patterns)
    found = time.monotonic()
    show = sys.stderr.isatty() if progress is None else progress
    unique = list(dict.fromkeys(addresses))  # a repeated entry is described (and sent) once
    described = describe_systems(unique, type_map, workers)
    by_address = dict(zip(unique, list(_with_progress(described, len(unique), show))))
    return [by_address[a] for a in addresses], (found - start, time.monotonic() - found)


def _with_progress(items: Iterator[SystemMeta], total: int, show: bool) -> Iterator[SystemMeta]:
    if not show:
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc="mdloader: building systems", unit="sys",
                    file=sys.stderr, dynamic_ncols=True)


def _unpicklable(metas: list[Any]) -> str | None:
    """The address (or repr) of the first entry pickle refuses, to name it in the error."""
    for meta in metas:
        try:
            pickle.dumps(meta)
        except Exception:  # noqa: BLE001 - looking for the culprit
            return getattr(meta, "address", None) or repr(meta)[:200]
    return None


def _verify(received: Any, count: int) -> tuple[list[DeepmdDataSetForLoader], str | None]:
    """This rank's datasets and its verification problem (``None`` when all is well)."""
    if not isinstance(received, list):
        return [], f"expected a list of SystemMeta from rank 0, found {type(received).__name__}"
    if len(received) != count:
        return [], f"received {len(received)} system descriptions, rank 0 sent {count}"
    bad = [i for i, m in enumerate(received) if not isinstance(m, SystemMeta)]
    if bad:
        kinds = sorted({type(received[i]).__name__ for i in bad})
        return [], (f"{len(bad)} of {count} entries are missing or not SystemMeta: indices "
                    f"{bad[:20]}{' ...' if len(bad) > 20 else ''} (found {', '.join(kinds)})")
    return [DeepmdDataSetForLoader(meta) for meta in received], None


def _report(metas: list[SystemMeta], times: tuple[float, ...], nbytes: int, workers: int,
            world_size: int) -> BuildReport:
    """``times``: discovery, build, broadcast (with the wait for rank 0), verification."""
    return BuildReport(len(metas), sum(m.nframes for m in metas), *times, payload_bytes=nbytes,
                       num_workers=workers, world_size=world_size)
