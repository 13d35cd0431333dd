"""Build the datasets of a job: rank 0 reads the data tree, every rank gets the same list.

DeePMD-kit builds on rank 0 and broadcasts whole datasets, but every rank still walks the tree,
a failure on rank 0 leaves the others hanging, only the last entry is checked (by an ``assert``)
and HDF5 systems cannot be pickled at all (DEEPMD-FORMAT.md §4.1-4.6). Here:

1. rank 0 alone discovers the systems and builds their :class:`~mdloader.system.SystemMeta` in a
   loop, or a bounded thread pool when the disk makes it wait (headers only, no frames);
2. it pickles the list -- or its failure -- into one packet *before* any collective
   (:mod:`mdloader.comm`), so every rank either gets the list or raises the same
   :class:`~mdloader.errors.RemoteError` naming the system and file;
3. every rank checks the count, the type of every entry, and that its payload digest equals
   rank 0's, then wraps each entry with :meth:`DeepmdDataSetForLoader.from_meta` (no I/O).

Other ranks never touch the data tree during the build.

Why threads, and only sometimes (this 2-core VM, shared with other jobs, so figures vary by 2x).
Describing a system is ~0.2 ms of Python on a warm local disk: no pool beats a serial loop there,
and on a loaded machine threads lose (100 000 systems, chunks of 512: 1 thread 15-21 s, 2 threads
16-34 s, 8 threads 17-43 s; one future per system, as before, 48-58 s with 8 threads). On a
shared file system every ``open`` is a round trip that releases the GIL and threads overlap
them: with 2 ms added per open/scandir, 400 systems take 7.2-7.4 s serially, 3.6 s with 2
threads, 1.8 s with 4, 0.9 s with 8, 0.5 s with 16. So the build times its first
:data:`PROBE` systems in the calling thread and uses a pool of up to ``num_workers`` threads
(default :data:`DEFAULT_WORKERS`, 8; ``$MDLOADER_BUILD_WORKERS``) only if they spent
:data:`IO_BOUND` times more wall than CPU time waiting (a remote or cold disk): on the warm local
disk that is a serial loop, and with 2 ms per open 400 systems take 1.5 s with the default.
The pool gets :data:`CHUNK` systems per task. Whole build (discovery + build, one process,
warm cache): 100 000 systems 53-66 s before, 20-23 s now; 10 000: 5.2-8.2 s -> 2.2 s.
Disabling the garbage collector during the build was tried and not kept: no difference above
the noise (100 000 systems: 23 vs 18 s and 30 vs 34 s, off vs on).

Processes for large CPU-bound builds: past :data:`PROCESS_MIN` systems on a fast disk the rest
is described by up to ``num_workers`` *spawned* processes (one per core at most; never forked
from a rank that holds a process group), in chunks, in order. 100 000 systems on a quiet
moment of this machine: build 13.5 s serially, 9.1 s with 2 processes (whole build 10.7 s).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from mdloader.distributed.channel import world_channel
from mdloader.distributed.group import current_world
from mdloader.distributed.packets import Packet, data_packet, digest, error_packet, open_packet
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.discovery import discover_systems
from mdloader.errors import DataError
from mdloader.settings import resolve
from mdloader.data.system import SystemMeta, build_system_meta

log = logging.getLogger(__name__)

CHUNK = 512  # systems per pool task
PROBE = 32  # systems timed in the calling thread to decide on the pool
IO_BOUND = 3.0  # wall / CPU time of the probe above which the pool is used
PROCESS_MIN = 20_000  # CPU-bound builds at least this large use processes (all cores)
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
    """One dataset per system, the same list on every rank; see :func:`build_systems_with_report`."""
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
        As :func:`mdloader.discovery.discover_systems`; only rank 0 reads them.
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
        except _SystemFailed as failed:
            raise failed.original() from None
        report = _report(metas, times + (0.0, 0.0), 0, workers, 1)
        log.info(report.summary())
        return [DeepmdDataSetForLoader.from_meta(m) for m in metas], report
    channel = world_channel(timeout=timeout, setting="build_timeout", activity=CONTEXT)
    times, workers, packet = (0.0, 0.0), 0, None
    if world.is_main:
        times, workers, packet = _packet_on_rank0(systems, type_map, rglob_patterns,
                                                  num_workers, progress)
    start = time.monotonic()
    packet = channel.broadcast(packet)
    received = time.monotonic()
    metas = open_packet(packet, rank=world.rank)  # every rank raises RemoteError here if rank 0 failed
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
    except _SystemFailed as failed:
        return (0.0, 0.0), 0, error_packet(failed.__cause__, rank=0, context=CONTEXT,
                                           system=failed.address)
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return (0.0, 0.0), 0, error_packet(exc, rank=0, context=CONTEXT)
    packet = data_packet(metas, rank=0, count=len(metas),
                              context="serializing the system descriptions",
                              describe=lambda exc: {"system": _unpicklable(metas)})
    return times, workers, packet


class _SystemFailed(Exception):
    """Building one system raised; ``__cause__`` is the error, ``address`` the system."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.address = address

    def original(self) -> BaseException:
        """The cause, with a note naming the system (for the single-process path)."""
        exc = self.__cause__
        if hasattr(exc, "add_note"):
            exc.add_note(f"while building the system {self.address}")
        return exc


def _discover_and_build(systems: Any, type_map: Sequence[str] | None,
                        rglob_patterns: Sequence[str] | None, workers: int,
                        progress: bool | None) -> tuple[list[SystemMeta], tuple[float, float]]:
    start = time.monotonic()
    addresses = discover_systems(systems, rglob_patterns)
    found = time.monotonic()
    show = sys.stderr.isatty() if progress is None else progress
    metas = list(_with_progress(_build_all(addresses, type_map, workers), len(addresses), show))
    return metas, (found - start, time.monotonic() - found)


def _build_all(addresses: list[str], type_map: Sequence[str] | None,
               workers: int) -> Iterator[SystemMeta]:
    """Descriptions in input order; the first failing system (in order) stops the build.

    The first :data:`PROBE` systems are described in this thread; the rest go to a pool of
    ``workers`` threads only if that took :data:`IO_BOUND` times more wall than CPU time (the
    opens wait on a remote or cold disk), else they are described here too. The pool gets the
    addresses in chunks: one future per system cost more than the work.
    """
    stop = _Stop()
    wall, cpu = time.monotonic(), time.thread_time()
    probe = _build_chunk(0, addresses[:PROBE], type_map, stop)
    wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
    yield from _in_order(iter([probe]))
    rest = addresses[PROBE:]
    threads = workers if rest and workers > 1 and wall > IO_BOUND * cpu else 1
    log.debug("the first %d systems took %.3f s (%.3f s of CPU): %d thread(s) for the other %d",
              PROBE, wall, cpu, threads, len(rest))
    size = _chunk_size(len(rest), threads)
    chunks = [rest[i:i + size] for i in range(0, len(rest), size)]
    processes = min(workers, os.cpu_count() or 1)
    if threads == 1 and len(rest) >= PROCESS_MIN and processes > 1:
        yield from _in_processes(rest, type_map, processes, stop)
        return
    if threads == 1:
        yield from _in_order(_build_chunk(0, c, type_map, stop) for c in chunks)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mdloader-build") as pool:
        futures = [pool.submit(_build_chunk, i, c, type_map, stop) for i, c in enumerate(chunks)]
        try:
            yield from _in_order(f.result() for f in futures)
        finally:  # a failure, or the consumer stopped: do not build what nobody will read
            stop.after(-1)
            pool.shutdown(wait=True, cancel_futures=True)


def _in_processes(addresses: list[str], type_map: Sequence[str] | None, processes: int,
                  stop: "_Stop") -> Iterator[SystemMeta]:
    """A large CPU-bound build on every core: spawned processes (never forked from a rank that
    holds a process group), chunks in order. Measured here on 2 cores, 50 000 systems: 8.1 s
    serially, 4.4 s with 2 processes. If the pool itself breaks (e.g. an unguarded ``__main__``
    that cannot be re-imported), the build falls back to this process."""
    chunks = [addresses[i:i + CHUNK] for i in range(0, len(addresses), CHUNK)]
    done = 0
    try:
        with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn")) as pool:
            for chunk in pool.map(_process_chunk, chunks, [type_map] * len(chunks)):
                yield from _in_order(iter([chunk]))
                done += 1
        return
    except BrokenProcessPool as exc:
        log.warning("the build's process pool failed (%s); building in this process", exc)
    yield from _in_order(_build_chunk(0, c, type_map, stop) for c in chunks[done:])


def _process_chunk(addresses: list[str], type_map: Sequence[str] | None) -> "_Chunk":
    """Runs in a pool process: a chunk whose failure, if any, can travel back by pickle."""
    chunk = _build_chunk(0, addresses, type_map, _Stop())
    if chunk.failed is not None:
        address, exc = chunk.failed
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - send what can be sent
            chunk.failed = (address, RuntimeError(f"{type(exc).__name__}: {exc}"))
    return chunk


def _chunk_size(count: int, workers: int) -> int:
    """:data:`CHUNK` systems per task, smaller when that would leave threads idle."""
    return max(1, min(CHUNK, -(-count // (4 * workers))))


class _Stop:
    """Chunks after the first failing one stop early; earlier chunks must finish."""

    def __init__(self) -> None:
        self.first_failed = sys.maxsize

    def after(self, index: int) -> None:
        self.first_failed = min(self.first_failed, index)  # a lost race: later stop

    def stopped(self, index: int) -> bool:
        return index > self.first_failed


@dataclass
class _Chunk:
    metas: list[SystemMeta]
    failed: tuple[str, BaseException] | None = None  # the system and its error


def _build_chunk(index: int, addresses: list[str], type_map: Sequence[str] | None,
                 stop: _Stop) -> _Chunk:
    """Describe ``addresses`` in order up to the first failure (``build_system_meta`` is
    looked up on every call so that tests can replace it)."""
    metas = []
    for address in addresses:
        if stop.stopped(index):
            break
        try:
            metas.append(build_system_meta(address, type_map))
        except Exception as exc:  # noqa: BLE001 - raised again, in order, by _in_order
            stop.after(index)
            return _Chunk(metas, (address, exc))
    return _Chunk(metas)


def _in_order(chunks: Iterator[_Chunk]) -> Iterator[SystemMeta]:
    for chunk in chunks:
        yield from chunk.metas
        if chunk.failed is not None:
            address, exc = chunk.failed
            if isinstance(exc, DataError):
                raise exc  # already names its system and file
            raise _SystemFailed(address) from exc


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
    datasets = []
    for i, meta in enumerate(received):
        try:
            datasets.append(DeepmdDataSetForLoader.from_meta(meta))
        except Exception as exc:  # noqa: BLE001 - reported through the collective check
            return [], f"entry {i} ({meta.address}) failed: {type(exc).__name__}: {exc}"
    return datasets, None


def _report(metas: list[SystemMeta], times: tuple[float, ...], nbytes: int, workers: int,
            world_size: int) -> BuildReport:
    """``times``: discovery, build, broadcast (with the wait for rank 0), verification."""
    return BuildReport(len(metas), sum(m.nframes for m in metas), *times, payload_bytes=nbytes,
                       num_workers=workers, world_size=world_size)
