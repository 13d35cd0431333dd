"""Several batch streams read by one pool of DataLoader workers.

A multi-task trainer holds a training (and maybe a validation) stream per task; one DataLoader
per stream means ``streams x num_workers`` worker processes per rank, each with its own copy of
the pages it writes. :class:`StreamPool` reads all of them through one DataLoader: its keys are
``(stream, key)`` pairs, drawn in the order a *forecast* of the consumer's requests says
(:class:`ForecastKeys`), so the workers read ahead exactly what will be asked next.

A request the forecast did not foresee is still served in its stream's order: a batch of another
stream that arrives first is held for that stream, and a stream with nothing in flight is asked
for at once. Each stream's batches are therefore always its sampler's keys in order, whatever the
forecast said; a wrong forecast only costs held batches, and a stream that holds too many is no
longer forecast (it is read on demand).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mdloader.errors import ConfigError
from mdloader.loading.stateful_loader import end_workers

log = logging.getLogger(__name__)


class KeySource(Protocol):
    """What a stream draws its keys from (a sampler's endless key stream)."""

    def next_key(self) -> Any: ...


class TaggedSets(Dataset):
    """The datasets of several streams behind one DataLoader: ``(stream, key)`` reads ``key``
    from the stream's dataset and comes back tagged with ``stream``."""

    def __init__(self, datasets: Sequence[Any]) -> None:
        self.datasets = list(datasets)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, tagged: tuple[int, Any]) -> tuple[int, Any]:
        stream, key = tagged
        return stream, self.datasets[stream][key]


class ForecastKeys(Sampler):
    """The pool's keys: first the streams asked for out of turn, then the forecast's.

    ``in_flight[s]`` counts the keys of stream ``s`` handed to the DataLoader whose batches have
    not come back yet; the pool uses it to tell a foreseen request from an unforeseen one.
    """

    def __init__(self, sources: Sequence[KeySource], forecast: Iterator[int]) -> None:
        self.sources = list(sources)
        self.forecast = forecast
        self.asked: collections.deque[int] = collections.deque()
        self.on_demand: set[int] = set()
        self.in_flight = [0] * len(self.sources)

    def _next_stream(self) -> int:
        if self.asked:
            return self.asked.popleft()
        while True:
            stream = next(self.forecast)
            if stream not in self.on_demand:
                return stream

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        while True:
            stream = self._next_stream()
            self.in_flight[stream] += 1
            yield stream, self.sources[stream].next_key()


def _as_is(batch: Any) -> Any:
    return batch


class StreamPool:
    """One DataLoader (``num_workers`` processes) serving the batches of every stream.

    Parameters
    ----------
    datasets, sources
        Per stream: the dataset that reads a key, and the sampler that hands out its keys.
    forecast
        The streams in the order the consumer is expected to ask for them (endless).
    names
        Per stream, a name for the log.
    num_workers, pin_memory
        As for a DataLoader of one stream (0 reads in this process).
    max_held
        Most batches one stream may hold before it is no longer forecast.
    """

    def __init__(self, datasets: Sequence[Any], sources: Sequence[KeySource],
                 forecast: Iterator[int], names: Sequence[str], *, num_workers: int,
                 pin_memory: bool = False, max_held: int | None = None) -> None:
        if not (len(datasets) == len(sources) == len(names)):
            raise ConfigError(f"a stream pool needs a dataset, a key source and a name per "
                              f"stream, got {len(datasets)}, {len(sources)} and {len(names)}")
        self.names = list(names)
        self.num_workers = int(num_workers)
        self.keys = ForecastKeys(sources, forecast)
        self.loader = DataLoader(TaggedSets(datasets), sampler=self.keys, batch_size=None,
                                 num_workers=self.num_workers, collate_fn=_as_is,
                                 pin_memory=pin_memory)
        self.prefetched = self.loader.prefetch_factor * self.num_workers if num_workers else 0
        self.max_held = int(max_held) if max_held is not None else 4 * self.prefetched + 16
        self.held: list[collections.deque[Any]] = [collections.deque() for _ in names]
        self.served = 0
        self.unforeseen = 0  # requests with nothing of their stream in flight
        self.most_held = 0  # the most batches held at once: 0 when the forecast was exact
        self._batches: Iterator[tuple[int, Any]] | None = None

    def stream(self, index: int) -> PooledStream:
        """The iterator of stream ``index``'s batches."""
        return PooledStream(self, index)

    def next_batch(self, stream: int) -> Any:
        """The next batch of ``stream``, in its sampler's order."""
        self.served += 1
        if self.held[stream]:
            return self.held[stream].popleft()
        if self._batches is None:
            with torch.device("cpu"):  # the pool's own tensors never go to the default device
                self._batches = iter(self.loader)
        if self.keys.in_flight[stream] == 0:  # not foreseen: ask for it now
            self.unforeseen += 1
            self.keys.asked.append(stream)
        while True:
            try:
                tag, batch = next(self._batches)
            except BaseException:
                self.close()
                raise
            self.keys.in_flight[tag] -= 1
            if tag == stream:
                return batch
            self._hold(tag, batch)

    def summary(self) -> str:
        """What the pool did, in one line (a forecast that was right: none out of turn, none
        held)."""
        return (f"{self.served} batches served, {self.unforeseen} asked for out of turn, at "
                f"most {self.most_held} held")

    def close(self) -> None:
        """End the workers (they end with the pool too; this ends them now)."""
        if self._batches is not None:
            end_workers(self._batches)
        self._batches = None

    def _hold(self, stream: int, batch: Any) -> None:
        held = self.held[stream]
        held.append(batch)
        self.most_held = max(self.most_held, sum(map(len, self.held)))
        if len(held) > self.max_held and stream not in self.keys.on_demand:
            self.keys.on_demand.add(stream)
            log.warning("the stream %s was asked for less often than forecast (%d batches "
                        "held): it is read on demand from now on", self.names[stream], len(held))


class PooledStream:
    """One stream of a :class:`StreamPool`: an endless iterator of its batches."""

    def __init__(self, pool: StreamPool, index: int) -> None:
        self.pool = pool
        self.index = int(index)

    @property
    def name(self) -> str:
        return self.pool.names[self.index]

    def __iter__(self) -> PooledStream:
        return self

    def __next__(self) -> Any:
        return self.pool.next_batch(self.index)
