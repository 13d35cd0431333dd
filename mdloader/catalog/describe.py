"""Describe many systems on rank 0: in a loop, a thread pool, or spawned processes.

:func:`fan_out` is the one way mdloader runs a per-system job over many systems (the build's
descriptions, ``mdloader check``'s inspections, ``mdloader pack``'s). Describing a system is a
little Python and a few small reads. On a warm local disk a loop is
fastest; where every ``open`` waits on the disk (a shared file system, a cold cache) threads
overlap the waits -- decided by timing the calls themselves (:mod:`mdloader.fs_calls`); a
very large CPU-bound build runs in spawned processes, one per core (never forked: rank 0 holds
a process group). Results come back in input order, and the first failing system in that order
stops the build. ``docs/benchmarks.md`` has the measurements behind the thresholds.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from mdloader.data.formats import Listing
from mdloader.data.formats.base import SystemMeta
from mdloader.data.system import build_system_meta
from mdloader.errors import DataError, add_note
from mdloader.fs_calls import PROBE, measuring

log = logging.getLogger(__name__)

CHUNK = 512  # systems per submission to the pool
PROCESS_MIN = 20_000  # CPU-bound builds at least this large use processes (all cores)
PROCESS_CPU = 50e-6  # ... unless a system takes less CPU than this (LMDB groups, from memory)

T = TypeVar("T")
#: A per-system job: ``work(address, listing)``, ``listing`` being discovery's listing or None.
Work = Callable[[str, "Listing | None"], T]


class SystemFailed(Exception):
    """Building one system raised; ``__cause__`` is the error, ``address`` the system."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.address = address

    def original(self) -> BaseException:
        """The cause, with a note naming the system (for the single-process path)."""
        exc = self.__cause__
        add_note(exc, f"while building the system {self.address}")
        return exc


def describe_systems(addresses: list[str], type_map: Sequence[str] | None, workers: int,
                     listings: Mapping[str, Listing] | None = None) -> Iterator[SystemMeta]:
    """Descriptions in input order; the first failing system (in order) stops the build.

    ``listings`` are the system folders' listings made by discovery (see :func:`fan_out`).
    """
    return fan_out(addresses, partial(describe_one, type_map=type_map), workers, listings)


def describe_one(address: str, listing: Listing | None = None, *,
                 type_map: Sequence[str] | None = None) -> SystemMeta:
    """One system's description, from the listing discovery made when there is one."""
    if listing:
        return build_system_meta(address, type_map, listing=listing)
    return build_system_meta(address, type_map)


def fan_out(addresses: list[str], work: Work[T], workers: int,
            listings: Mapping[str, Listing] | None = None) -> Iterator[T]:
    """``work`` of every address, in input order; the first failing system (in order) stops.

    The first :data:`~mdloader.fs_calls.PROBE` systems run in this thread; the rest go to a
    pool of threads only if more than half of that time was spent waiting inside file-system
    calls (as many threads as keep this core busy, at most ``workers``), else they run here too
    (or in spawned processes, for a very large CPU-bound job: ``work`` must then pickle). The
    pool gets the addresses in chunks: one future per system cost more than the work.

    Raises
    ------
    DataError
        As the failing system raised it (it names its system and file).
    SystemFailed
        Any other failure; ``__cause__`` is the error.
    """
    stop, listings = _Stop(), listings or {}
    cpu = time.thread_time()
    with measuring() as probe_time:
        probe = _run_chunk(0, addresses[:PROBE], work, stop, listings)
    cpu = time.thread_time() - cpu
    yield from _in_order(iter([probe]))
    rest = addresses[PROBE:]
    threads = probe_time.threads(workers) if rest else 1
    log.debug("the first %d systems took %.3f s, %.3f s of it in file-system calls: %d "
              "thread(s) for the other %d", PROBE, probe_time.wall, probe_time.in_calls, threads,
              len(rest))
    size = _chunk_size(len(rest), threads)
    chunks = [rest[i:i + size] for i in range(0, len(rest), size)]
    processes = min(workers, os.cpu_count() or 1)
    heavy = cpu > PROCESS_CPU * max(1, len(probe.results))  # spawning costs seconds
    if threads == 1 and len(rest) >= PROCESS_MIN and processes > 1 and heavy:
        yield from _in_processes(rest, work, processes, stop, listings)
        return
    if threads == 1:
        yield from _in_order(_run_chunk(0, c, work, stop, listings) for c in chunks)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mdloader-build") as pool:
        futures = [pool.submit(_run_chunk, i, c, work, stop, listings)
                   for i, c in enumerate(chunks)]
        try:
            yield from _in_order(f.result() for f in futures)
        finally:  # a failure, or the consumer stopped: do not run what nobody will read
            stop.after(-1)
            pool.shutdown(wait=True, cancel_futures=True)


def _in_processes(addresses: list[str], work: Work[T], processes: int, stop: _Stop,
                  listings: Mapping[str, Listing]) -> Iterator[T]:
    """A large CPU-bound job on every core: spawned processes, chunks in order.

    If the pool itself breaks (e.g. an unguarded ``__main__`` that cannot be re-imported), the
    build falls back to this process.
    """
    chunks = [addresses[i:i + CHUNK] for i in range(0, len(addresses), CHUNK)]
    done = 0
    try:
        with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn")) as pool:
            parts = [{a: listings[a] for a in c if a in listings} for c in chunks]
            for chunk in pool.map(_process_chunk, chunks, [work] * len(chunks), parts):
                yield from _in_order(iter([chunk]))
                done += 1
        return
    except BrokenProcessPool as exc:
        log.warning("the build's process pool failed (%s); building in this process", exc)
    yield from _in_order(_run_chunk(0, c, work, stop, listings) for c in chunks[done:])


def _process_chunk(addresses: list[str], work: Work[Any],
                   listings: Mapping[str, Listing]) -> _Chunk:
    """Runs in a pool process: a chunk whose failure, if any, can travel back by pickle."""
    chunk = _run_chunk(0, addresses, work, _Stop(), listings)
    if chunk.failed is not None:
        address, exc = chunk.failed
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - send what can be sent
            chunk.failed = (address, RuntimeError(f"{type(exc).__name__}: {exc}"))
    return chunk


def _chunk_size(count: int, workers: int) -> int:
    """:data:`CHUNK` systems per submission, smaller when that would leave threads idle."""
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
class _Chunk(Generic[T]):
    results: list[T] = field(default_factory=list)
    failed: tuple[str, BaseException] | None = None  # the system and its error


def _run_chunk(index: int, addresses: list[str], work: Work[T], stop: _Stop,
               listings: Mapping[str, Listing]) -> _Chunk[T]:
    """``work`` of ``addresses`` in order, up to the first failure."""
    chunk: _Chunk[T] = _Chunk()
    for address in addresses:
        if stop.stopped(index):
            break
        try:
            chunk.results.append(work(address, listings.get(address)))
        except Exception as exc:  # noqa: BLE001 - raised again, in order, by _in_order
            stop.after(index)
            chunk.failed = (address, exc)
            break
    return chunk


def _in_order(chunks: Iterator[_Chunk[T]]) -> Iterator[T]:
    for chunk in chunks:
        yield from chunk.results
        if chunk.failed is not None:
            address, exc = chunk.failed
            if isinstance(exc, DataError):
                raise exc  # already names its system and file
            raise SystemFailed(address) from exc
