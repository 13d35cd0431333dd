"""One pool of DataLoader workers for several streams: each stream serves its own keys in order,
whatever order they are asked for in, with real worker processes; a finite pass is asked for
whole and can be cut; a worker's error comes back as the error itself."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import random

import pytest

from mdloader.errors import DataError
from mdloader.loading.pool import GROUP, PoolKeys, WorkerPool


class CountingKeys:
    """A stream's key source: keys 0, 1, 2, ... (what a sampler's ``next_key`` is to a pool)."""

    def __init__(self) -> None:
        self.drawn = 0

    def next_key(self) -> int:
        self.drawn += 1
        return self.drawn - 1


class Echo:
    """A dataset whose batch of key ``k`` names its stream, the key and the reading process."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __len__(self) -> int:
        return 1

    def __getitem__(self, key: int) -> dict[str, object]:
        return {"stream": self.name, "key": int(key), "pid": os.getpid()}


def make_pool(names: list[str], forecast: list[int] | None, workers: int,
              **kwargs: object) -> tuple[WorkerPool, list[CountingKeys]]:
    sources = [CountingKeys() for _ in names]
    ahead = itertools.cycle(forecast) if forecast else itertools.cycle(range(len(names)))
    pool = WorkerPool([Echo(n) for n in names], sources, names, ahead, num_workers=workers,
                      **kwargs)
    return pool, sources


READERS: set[int] = set()


def take(pool: WorkerPool, requests: list[int]) -> dict[int, list[int]]:
    """Ask for ``requests`` in order; each stream's keys as they came, checked by name (the
    reading processes are added to ``READERS``)."""
    got: dict[int, list[int]] = {}
    for stream in requests:
        batch = pool.next_batch(stream)
        assert batch["stream"] == pool.names[stream]
        got.setdefault(stream, []).append(batch["key"])
        READERS.add(batch["pid"])
    return got


@pytest.mark.parametrize("workers", [0, 2])
def test_a_foreseen_order_serves_each_stream_its_keys_in_order(workers: int) -> None:
    forecast = [0, 1, 0, 2, 2, 1]
    pool, sources = make_pool(["t.a", "t.b", "v.a"], forecast, workers)
    requests = forecast * 5
    READERS.clear()
    got = take(pool, requests)
    for stream in range(3):
        assert got[stream] == list(range(requests.count(stream)))
    if workers:
        assert pool.unforeseen == 0, "a forecast order needed no request out of turn"
        assert pool.most_held == 0
        assert os.getpid() not in READERS and len(READERS) == workers
        # the workers read ahead, by the prefetch depth at most (items of up to GROUP keys)
        assert len(requests) < sum(s.drawn for s in sources) <= len(requests) + pool.prefetched
    else:
        assert sum(s.drawn for s in sources) == len(requests)
    assert not any(pool.held), "nothing is left held when the forecast is right"
    pool.close()


def test_any_order_serves_each_stream_its_keys_in_order(
        caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(5)
    pool, sources = make_pool(["a", "b", "c", "d"], [0, 1, 2, 3], 2, max_held=24)
    requests = [rng.choice([0, 0, 0, 1, 2, 3]) for _ in range(200)]
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        got = take(pool, requests)
    for stream in range(4):
        assert got[stream] == list(range(requests.count(stream)))
    assert "was asked for less often than forecast" in caplog.text
    assert all(len(h) <= pool.max_held + 1 for h in pool.held)
    assert sum(s.drawn for s in sources) <= len(requests) + sum(map(len, pool.held)) \
        + pool.prefetched + 4
    pool.close()


class FailsAt(Echo):
    """An :class:`Echo` whose key ``at`` cannot be read: ``error``, else a ValueError."""

    def __init__(self, name: str, at: int, error: Exception | None = None) -> None:
        super().__init__(name)
        self.at, self.error = at, error

    def __getitem__(self, key: int) -> dict[str, object]:
        if key == self.at:
            raise self.error or ValueError(f"{self.name}: key {key} cannot be read")
        return super().__getitem__(key)


def test_a_workers_error_reaches_the_caller_and_the_workers_end_with_it() -> None:
    others = set(multiprocessing.active_children())
    pool = WorkerPool([Echo("a"), FailsAt("b", 2)], [CountingKeys(), CountingKeys()],
                      ["a", "b"], itertools.cycle([0, 1]), num_workers=2)
    with pytest.raises(ValueError, match="b: key 2 cannot be read") as info:
        take(pool, [0, 1] * 5)
    # ``info`` still holds the error and its traceback (so the iterator) while this is checked
    assert set(multiprocessing.active_children()) <= others, info.value
    pool, _ = make_pool(["a"], None, 2)
    take(pool, [0])
    assert len(set(multiprocessing.active_children()) - others) == 2
    pool.close()
    assert set(multiprocessing.active_children()) <= others, "close() ends the workers now"


def test_a_retried_request_is_served_from_its_stream_and_holds_little() -> None:
    """DeePMD-kit draws a task again when a batch has no valid frame: an extra request."""
    forecast = [0, 1, 1, 2]
    pool, _ = make_pool(["a", "b", "c"], forecast, 2)
    requests = []
    for step, stream in enumerate(forecast * 30):
        requests.append(stream)
        if step % 7 == 3:
            requests.append(stream)  # the retry
    got = take(pool, requests)
    for stream in range(3):
        assert got[stream] == list(range(requests.count(stream)))
    assert max(len(h) for h in pool.held) <= pool.prefetched + 2
    pool.close()


def test_a_stream_forecast_but_never_asked_for_is_read_on_demand_after_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    pool, sources = make_pool(["train", "valid"], [0, 1], 2, max_held=5)
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        got = take(pool, [0] * 60)
    assert got[0] == list(range(60))
    assert "valid was asked for less often than forecast" in caplog.text
    assert len(pool.held[1]) <= 5 + 1 + pool.prefetched
    assert sources[1].drawn <= 5 + 1 + pool.prefetched
    later = take(pool, [1, 1])
    assert later[1] == [0, 1], "the held batches are still served first, in order"
    pool.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_data_error_comes_back_whole_in_its_streams_turn(workers: int) -> None:
    """The error itself, with its system and file, in place of its batch: the batches asked
    before it of any stream are served first."""
    error = DataError("cannot be read", system="/data/b", file="force.npy")
    pool = WorkerPool([Echo("a"), FailsAt("b", 1, error)], [CountingKeys(), CountingKeys()],
                      ["a", "b"], itertools.cycle([1, 0]), num_workers=workers)
    assert take(pool, [1, 0, 0]) == {1: [0], 0: [0, 1]}
    with pytest.raises(DataError, match="^cannot be read") as info:
        pool.next_batch(1)
    assert (info.value.system, info.value.file) == ("/data/b", "force.npy")
    assert take(pool, [0]) == {0: [2]}, "the pool goes on serving the other streams"
    pool.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_finite_pass_asked_whole_is_served_in_order_and_can_be_cut(workers: int) -> None:
    """A full validation pass: its batches are asked for at once; the other streams' batches
    read ahead meanwhile are held for them; a pass cut short drops what is on its way, and
    the next pass starts clean."""
    pool, sources = make_pool(["train", "pass"], [0], workers)
    assert take(pool, [0, 0]) == {0: [0, 1]}
    pool.ask(1, 5)
    assert take(pool, [1] * 5) == {1: [0, 1, 2, 3, 4]}
    assert take(pool, [0, 0, 0]) == {0: [2, 3, 4]}, "held training batches keep their order"
    pool.ask(1, 6)
    assert take(pool, [1, 1]) == {1: [5, 6]}
    pool.cancel(1)
    drawn = sources[1].drawn  # what the cut pass had drawn (read ahead by the workers, or not)
    pool.ask(1, 2)
    assert take(pool, [1, 1]) == {1: [drawn, drawn + 1]}, "a cut pass's batches are dropped"
    assert take(pool, [0]) == {0: [5]}
    pool.close()


def test_a_finite_forecast_reads_nothing_after_it() -> None:
    pool = WorkerPool([Echo("a")], [CountingKeys()], ["a"], iter([0, 0, 0]), num_workers=2)
    assert take(pool, [0, 0, 0]) == {0: [0, 1, 2]}
    assert pool.keys.sources[0].drawn == 3
    pool.close()


def test_an_item_carries_up_to_group_consecutive_keys_of_one_stream() -> None:
    """One DataLoader item per run of one stream's keys (up to the group size): the main
    process pays the DataLoader's per-item cost once for them."""
    keys = PoolKeys([CountingKeys(), CountingKeys()], iter([0, 0, 0, 0, 0, 1, 1, 0]), group=4)
    assert list(keys) == [(0, [0, 1, 2, 3]), (0, [4]), (1, [0, 1]), (0, [5])]
    assert keys.pending == [6, 2]
    asked = PoolKeys([CountingKeys(), CountingKeys()], iter([0, 1]), group=3)
    asked.asked.extend([1, 1, 1, 1, 0])
    asked.on_demand.add(1)  # read only when asked: the forecast's 1 is skipped
    assert list(asked) == [(1, [0, 1, 2]), (1, [3]), (0, [0]), (0, [1])]


@pytest.mark.parametrize("workers", [0, 2])
def test_grouped_items_keep_every_streams_order_and_errors(workers: int) -> None:
    error = DataError("cannot be read", system="/data/b", file="coord.npy")
    pool = WorkerPool([Echo("a"), FailsAt("b", 5, error)], [CountingKeys(), CountingKeys()],
                      ["a", "b"], itertools.cycle([0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]),
                      num_workers=workers)
    assert pool.keys.group == (GROUP if workers else 1)
    assert take(pool, [0] * 5 + [1] * 5) == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4]}
    with pytest.raises(DataError, match="^cannot be read"):  # in its turn, not its item's
        pool.next_batch(1)
    assert take(pool, [1, 0]) == {1: [6], 0: [5]}
    pool.close()
