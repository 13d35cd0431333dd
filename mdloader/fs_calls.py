"""File-system calls: a meter of how long they wait, and a pool that overlaps them when they do.

Walking a tree, reading headers and checking an index are mostly file-system calls. On a warm
local disk they return at once and a plain loop is fastest; on a cold disk or a network file
system each one waits, and threads overlap the waits (a waiting call releases the GIL). The
decision times the first calls themselves: overlap pays when most of the wall time is spent
inside file-system calls *and* an average call takes far longer than the kernel needs to answer
from its caches. CPU contention on a busy node slows the calls and the Python around them alike
and rarely preempts a call that short, so it moves neither figure the way it moved the older
wall-over-CPU-time ratio; only waiting does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

IO_SHARE = 0.5  # share of the probe's wall time inside file-system calls above which to overlap
WAIT = 30e-6  # mean seconds per call above which a call waited (cached answers are far faster)
PROBE = 32  # calls of the probe (systems described, directories listed, paths checked)
CHUNK = 64  # items per submission: one future per item costs more than a small item's work

_state = threading.local()


def timed(call: Callable[..., T], *args: Any) -> T:
    """``call(*args)``; while this thread is measuring, its duration counts as waiting."""
    spent = getattr(_state, "spent", None)
    if spent is None:
        return call(*args)
    start = time.perf_counter()
    try:
        return call(*args)
    finally:
        spent[0] += time.perf_counter() - start
        spent[1] += 1


@dataclass
class Measurement:
    """Wall seconds of a measured stretch, and the seconds and number of :func:`timed` calls."""

    wall: float = 0.0
    in_calls: float = 0.0
    calls: int = 0

    @property
    def io_bound(self) -> bool:
        """Most of the time went into calls, and the calls waited."""
        return (self.calls > 0 and self.in_calls > IO_SHARE * self.wall
                and self.in_calls > WAIT * self.calls)

    def threads(self, most: int) -> int:
        """Threads that keep one core busy while the others wait: one per call in flight,
        ``waiting / working + 1``, at least 2 and at most ``most`` (1 when not waiting)."""
        if not self.io_bound or most <= 1:
            return 1
        working = max(self.wall - self.in_calls, 1e-9)
        return max(2, min(most, round(self.in_calls / working) + 1))

    def add(self, other: Measurement) -> None:
        self.wall += other.wall
        self.in_calls += other.in_calls
        self.calls += other.calls


@contextmanager
def measuring() -> Iterator[Measurement]:
    """Measure this thread's stretch (nested measurements count for the outermost only)."""
    result = Measurement()
    outer = getattr(_state, "spent", None)
    spent: list[float] = [0.0, 0]
    _state.spent = spent if outer is None else outer
    start = time.perf_counter()
    try:
        yield result
    finally:
        result.wall = time.perf_counter() - start
        if outer is None:
            result.in_calls, result.calls = spent[0], int(spent[1])
        _state.spent = outer


class Overlap:
    """Maps a function over items in order: in this thread, or in threads once measured useful.

    The first :data:`PROBE` items (over all calls of :meth:`map`) run here and are timed; the
    rest run in threads if the probe was waiting on the file system, as many as
    :meth:`Measurement.threads` says, at most ``workers``.
    """

    def __init__(self, workers: int, probe: int | None = None) -> None:
        self.workers = max(1, int(workers))
        self.probe = PROBE if probe is None else probe
        self.measured = Measurement()
        self.probed = 0
        self.threads: int | None = None if self.workers > 1 else 1

    def map(self, call: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``[call(item) for item in items]``; ``call`` times its own file-system calls."""
        return self._map(call, lambda chunk: [call(x) for x in chunk], items)

    def map_batches(self, call: Callable[[Sequence[T]], list[R]], items: Sequence[T]
                    ) -> list[R]:
        """:meth:`map` for a ``call`` that takes a list of items and gives their results: the
        probe times it item by item, the rest runs as whole chunks (a check of half a million
        paths must not pay a Python call per path)."""
        return self._map(lambda item: timed(call, [item])[0], call, items)

    def _map(self, one: Callable[[T], R], chunk: Callable[[Sequence[T]], list[R]],
             items: Sequence[T]) -> list[R]:
        head = max(0, min(len(items), self.probe - self.probed)) if self.threads is None else 0
        with measuring() as m:
            out = [one(item) for item in items[:head]]
        self.measured.add(m)
        self.probed += head
        rest = items[head:]
        if rest and self.threads is None:
            self.threads = self.measured.threads(self.workers)
        if not rest:
            return out
        if self.threads == 1:
            return out + chunk(rest)
        return out + list(_in_threads(chunk, rest, self.threads))


def _in_threads(chunk: Callable[[Sequence[T]], list[R]], items: Sequence[T], threads: int
                ) -> Iterable[R]:
    size = max(1, min(CHUNK, -(-len(items) // (4 * threads))))
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mdloader-io") as pool:
        futures = [pool.submit(chunk, part) for part in chunks]
        try:
            for future in futures:
                yield from future.result()
        finally:  # a failure: do not start what nobody will read
            for future in futures:
                future.cancel()
