"""One pool of DataLoader workers for every stream of a job: the one place mdloader makes a
``torch.utils.data.DataLoader``.

A trainer holds several streams (training, validation and display data of every task); one
DataLoader per stream would start ``streams x num_workers`` worker processes per rank, each with
its own copy of the pages it writes. :class:`WorkerPool` reads all of them through one
DataLoader: its keys are ``(stream, key)`` pairs, drawn in the order a *forecast* of the
consumer's requests says (:class:`PoolKeys`), so the workers read ahead exactly what will be
asked next.
With workers, one DataLoader item carries up to :data:`GROUP` consecutive keys of one stream:
the DataLoader's cost in the main process (putting an index, waiting for and unpickling a
result) is paid once per item, not once per batch.

A request the forecast did not foresee is still served in its stream's order: a batch of
another stream that arrives first is held for that stream, and a stream with nothing on its way
is asked for at once. Each stream's batches are therefore always its key source's keys in
order, whatever the forecast said; a wrong forecast only costs held batches, and a stream that
holds too many is no longer forecast (it is read on demand). A finite pass (a full validation)
is asked for whole (:meth:`WorkerPool.ask`), and can be cut (:meth:`WorkerPool.cancel`).

Errors travel as objects on every path: a worker's mdloader error comes back in place of its
batch (:class:`~mdloader.transport.CarriedError`) and is raised, with its system and file, when
its stream asks for that batch; a worker that died is a :class:`~mdloader.errors.WorkerLostError`
found from the worker processes themselves (:func:`lost_worker_error`), never from torch's
message text. Workers live as long as their rank and no longer
(:func:`~mdloader.loading.worker_lifetime.bind_to_rank`).
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import signal
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mdloader.errors import ConfigError, MdloaderError, WorkerLostError
from mdloader.loading.stalls import WorkerIO, io_snapshot
from mdloader.loading.worker_lifetime import bind_to_rank
from mdloader.settings import raise_open_file_limit
from mdloader.transport import CarriedError, TransportBatch

log = logging.getLogger(__name__)

#: The pools of this process whose workers may be running (a lost worker is looked for there).
_OPEN: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
#: Most keys of one stream in one DataLoader item (with workers; one without).
GROUP = 4


class KeySource(Protocol):
    """What a stream draws its keys from (a sampler's endless key stream, or a pass's keys)."""

    def next_key(self) -> Any: ...


class TaggedSets(Dataset):
    """The datasets of the streams behind one DataLoader: ``(stream, keys)`` reads each key
    from the stream's dataset and the batches come back tagged with ``stream`` and the reading
    process's I/O counters (:func:`~mdloader.loading.stalls.io_snapshot`); an mdloader error
    comes back as a :class:`~mdloader.transport.CarriedError` in place of its batch."""

    def __init__(self, datasets: Sequence[Any]) -> None:
        self.datasets = list(datasets)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, tagged: tuple[int, list[Any]]) -> tuple[int, list[Any], Any]:
        stream, keys = tagged
        batches = []
        for key in keys:
            try:
                batches.append(self.datasets[stream][key])
            except MdloaderError as exc:
                batches.append(CarriedError(exc))
        return stream, batches, io_snapshot(batches)


def _transport(item: tuple[int, list[Any], Any]) -> tuple[int, list[Any], Any]:
    """The pool's collate function: a plain batch dict leaves a worker with its tensors as
    numpy arrays (:class:`~mdloader.transport.TransportBatch`)."""
    stream, batches, io = item
    return stream, [TransportBatch(b) if type(b) is dict else b for b in batches], io


class PoolKeys(Sampler):
    """The pool's keys: first the streams asked for, then the forecast's (until it ends), as
    ``(stream, keys)`` items of up to ``group`` consecutive keys of one stream.

    ``pending[s]`` counts the keys of stream ``s`` asked for or drawn whose batches have not
    come back yet; the pool uses it to tell a foreseen request from an unforeseen one.
    """

    def __init__(self, sources: Sequence[KeySource], forecast: Iterator[int],
                 group: int = 1) -> None:
        self.sources = list(sources)
        self.forecast = forecast
        self.group = max(1, int(group))
        self.asked: collections.deque[int] = collections.deque()
        self.on_demand: set[int] = set()
        self.pending = [0] * len(self.sources)
        self._ahead: collections.deque[int] = collections.deque()  # forecast seen, not drawn

    def _forecast_next(self, only: int | None = None) -> int | None:
        """The forecast's next stream to read (``only``: the next entry if it is ``only``)."""
        while True:
            if not self._ahead:
                stream = next(self.forecast, None)
                if stream is None:
                    return None
                self._ahead.append(stream)
            if self._ahead[0] in self.on_demand:
                self._ahead.popleft()
                continue
            if only is not None and self._ahead[0] != only:
                return None
            stream = self._ahead.popleft()
            self.pending[stream] += 1
            return stream

    def _next_item(self) -> tuple[int, int] | None:
        """``(stream, count)`` of the next item, or ``None`` when the forecast has ended."""
        if self.asked:
            stream, count = self.asked.popleft(), 1
            while count < self.group and self.asked and self.asked[0] == stream:
                self.asked.popleft()
                count += 1
            return stream, count
        stream = self._forecast_next()
        if stream is None:
            return None
        count = 1
        while count < self.group and self._forecast_next(only=stream) is not None:
            count += 1
        return stream, count

    def __iter__(self) -> Iterator[tuple[int, list[Any]]]:
        while True:
            item = self._next_item()
            if item is None:
                return
            stream, count = item
            yield stream, [self.sources[stream].next_key() for _ in range(count)]


class WorkerPool:
    """One DataLoader (``num_workers`` processes) serving the batches of every stream.

    Parameters
    ----------
    datasets, sources
        Per stream: the dataset that reads a key, and what hands out its keys.
    names
        Per stream, a name for the log.
    forecast
        The streams in the order the consumer is expected to ask for them (endless, or finite:
        then nothing is read ahead once it ends; none: every stream is read when asked).
    num_workers, pin_memory
        As for a DataLoader (0 reads in this process).
    max_held
        Most batches one stream may hold before it is no longer forecast.
    worker_init_fn, **loader_options
        Passed to the DataLoader (``worker_init_fn`` runs after the worker is bound to its rank).
    """

    def __init__(self, datasets: Sequence[Any], sources: Sequence[KeySource],
                 names: Sequence[str], forecast: Iterator[int] | None = None, *, num_workers: int,
                 pin_memory: bool = False, max_held: int | None = None,
                 worker_init_fn: Callable[[int], None] | None = None,
                 **loader_options: Any) -> None:
        if not (len(datasets) == len(sources) == len(names)):
            raise ConfigError(f"a worker pool needs a dataset, a key source and a name per "
                              f"stream, got {len(datasets)}, {len(sources)} and {len(names)}")
        self.names = list(names)
        self.num_workers = int(num_workers)
        group = GROUP if self.num_workers else 1
        self.keys = PoolKeys(sources, iter(()) if forecast is None else forecast, group)
        if group > 1:  # a worker's item is several batches: one ahead is as deep as two were
            loader_options.setdefault("prefetch_factor", 1)
        self.loader = DataLoader(TaggedSets(datasets), sampler=self.keys, batch_size=None,
                                 num_workers=self.num_workers, collate_fn=_transport,
                                 pin_memory=pin_memory,
                                 worker_init_fn=_BoundWorker(worker_init_fn),
                                 **loader_options)
        self.prefetched = (self.loader.prefetch_factor * self.num_workers * group
                           if num_workers else 0)
        self.max_held = int(max_held) if max_held is not None else 4 * self.prefetched + 16
        self.held: list[collections.deque[Any]] = [collections.deque() for _ in names]
        self.dropping = [0] * len(self.names)  # batches of a cut pass still on their way
        self.served = 0
        self.unforeseen = 0  # requests with nothing of their stream read ahead (with workers)
        self.most_held = 0  # the most batches held at once: 0 when the forecast was exact
        self.io = WorkerIO()  # what the workers read, for the stall report
        self._batches: Iterator[tuple[int, Any]] | None = None
        self._workers: list[Any] = []

    def next_batch(self, stream: int) -> Any:
        """The next batch of ``stream``, in its key source's order.

        Raises
        ------
        MdloaderError
            The error a worker met reading this batch (its system and file included).
        WorkerLostError
            A worker process of this pool died.
        StopIteration
            The forecast ended and nothing of ``stream`` is on its way.
        """
        self.served += 1
        held = self.held[stream]
        if self._batches is None:
            self._start()
        if not held and self.keys.pending[stream] == self.dropping[stream]:
            self.unforeseen += bool(self.num_workers)  # not foreseen (nothing read ahead)
            self.ask(stream)
        while not held:
            tag, batches = self._receive()
            self.keys.pending[tag] -= len(batches)
            for batch in batches:
                if self.dropping[tag]:  # a stream delivers in order: a cut pass's come first
                    self.dropping[tag] -= 1
                    continue
                self.held[tag].append(batch)
                if tag != stream:
                    self._note_held(tag)
        batch = held.popleft()
        if isinstance(batch, CarriedError):
            raise batch.error
        return batch

    def ask(self, stream: int, count: int = 1) -> None:
        """Read ``count`` batches of ``stream`` before anything the forecast has not drawn yet
        (a finite pass asks for all of its batches at once)."""
        self.keys.asked.extend([stream] * int(count))
        self.keys.pending[stream] += int(count)

    def cancel(self, stream: int) -> None:
        """Forget what ``stream`` asked for and holds: what is on its way is dropped on
        arrival (a pass cut short)."""
        left = [s for s in self.keys.asked if s != stream]
        self.keys.pending[stream] -= len(self.keys.asked) - len(left)
        self.keys.asked = collections.deque(left)
        self.held[stream].clear()
        self.dropping[stream] = self.keys.pending[stream]

    def summary(self) -> str:
        """What the pool did, in one line (a forecast that was right: none out of turn, none
        held)."""
        return (f"{self.served} batches served, {self.unforeseen} asked for out of turn, at "
                f"most {self.most_held} held")

    def close(self) -> None:
        """End the workers now (they also end with the pool, and with the process). What was
        on its way is dropped: the key sources are past it, so an owner that reads on seeks them
        back first."""
        if self._batches is not None:
            end_workers(self._batches)
        self._batches = None
        self._workers = []
        _OPEN.discard(self)
        self.keys.asked.clear()
        self.keys.pending = [0] * len(self.names)
        self.dropping = [0] * len(self.names)
        for held in self.held:
            held.clear()

    def lost(self) -> WorkerLostError | None:
        """A worker of this pool that died, as an error that says what may have happened."""
        for worker in self._workers:
            code = worker.exitcode
            if code:  # None: alive; 0: ended as asked
                return WorkerLostError(f"DataLoader worker (pid {worker.pid}) {_death(code)}")
        return None

    def _start(self) -> None:
        """Start the workers: they read ahead from the forecast at once, with the open-file
        limit raised first, so that they inherit it and keep their data files open."""
        raise_open_file_limit()
        before = set(multiprocessing.active_children())
        with torch.device("cpu"):  # the pool's own tensors never go to the default device
            self._batches = iter(self.loader)
        self._workers = [p for p in multiprocessing.active_children() if p not in before]
        _OPEN.add(self)

    def _receive(self) -> tuple[int, list[Any]]:
        """The next item the DataLoader delivers: a stream and batches of it, in its order (the
        workers start on first use)."""
        if self._batches is None:
            self._start()
        try:
            stream, batches, io = next(self._batches)
        except StopIteration:
            self.close()
            raise
        except RuntimeError as exc:  # torch noticed a dead worker
            lost = self.lost()
            self.close()
            if lost is None:
                raise
            raise lost from exc
        except BaseException:
            self.close()
            raise
        self.io.note(io)
        return stream, batches

    def _note_held(self, stream: int) -> None:
        held = self.held[stream]
        self.most_held = max(self.most_held, sum(map(len, self.held)))
        if len(held) > self.max_held and stream not in self.keys.on_demand:
            self.keys.on_demand.add(stream)
            log.warning("the stream %s was asked for less often than forecast (%d batches "
                        "held): it is read on demand from now on", self.names[stream], len(held))


class _BoundWorker:
    """A pool worker's ``worker_init_fn``: bound to its rank first, then the caller's own."""

    def __init__(self, then: Callable[[int], None] | None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        bind_to_rank()
        if self.then is not None:
            self.then(worker_id)


def _death(code: int) -> str:
    """How a worker process ended, with what may have caused it."""
    if code < 0:
        name = signal.Signals(-code).name
        hint = ("a memory-mapped file may have been truncated while it was read"
                if -code == signal.SIGBUS else "killed from outside or out of memory: see the "
                "kernel log (dmesg)")
        return f"is killed by signal {name} ({hint})"
    return f"exited unexpectedly with code {code}"


def end_workers(batches: Iterator[Any]) -> None:
    """End the workers of a DataLoader iterator now. An iterator referenced by an error's
    traceback lives as long as the error, its workers (and their open files) with it."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # absent without workers
    if shutdown is not None:
        shutdown()


def lost_worker_error() -> WorkerLostError | None:
    """A worker of an open pool of this process that died, as an error; ``None`` when none did.

    torch notices a dead worker where the main process happens to be (its SIGCHLD handler), so
    code outside a pool's own reads asks here what the failure it caught was.
    """
    for pool in list(_OPEN):
        lost = pool.lost()
        if lost is not None:
            return lost
    return None


__all__ = ["KeySource", "WorkerPool", "end_workers", "lost_worker_error"]
