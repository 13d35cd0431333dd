"""One pool of DataLoader workers for several streams: each stream serves its own keys in order,
whatever order they are asked for in, with real worker processes."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import random

import pytest

from mdloader.integrations.deepmd.worker_pool import is_display_step, loop_forecast
from mdloader.loading.stream_pool import StreamPool


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
              **kwargs: object) -> tuple[StreamPool, list[CountingKeys]]:
    sources = [CountingKeys() for _ in names]
    ahead = itertools.cycle(forecast) if forecast else itertools.cycle(range(len(names)))
    pool = StreamPool([Echo(n) for n in names], sources, ahead, names, num_workers=workers,
                      **kwargs)
    return pool, sources


READERS: set[int] = set()


def take(pool: StreamPool, requests: list[int]) -> dict[int, list[int]]:
    """Ask for ``requests`` in order; each stream's keys as they came, checked by name (the
    reading processes are added to ``READERS``)."""
    got: dict[int, list[int]] = {}
    for stream in requests:
        batch = next(pool.stream(stream))
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
        # the workers read ahead by the prefetch depth, never more
        assert sum(s.drawn for s in sources) == len(requests) + pool.prefetched
    else:
        assert sum(s.drawn for s in sources) == len(requests)
    assert not any(pool.held), "nothing is left held when the forecast is right"
    pool.close()


def test_any_order_serves_each_stream_its_keys_in_order(
        caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(5)
    pool, sources = make_pool(["a", "b", "c", "d"], [0, 1, 2, 3], 2)
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
    """An :class:`Echo` whose key ``at`` cannot be read."""

    def __init__(self, name: str, at: int) -> None:
        super().__init__(name)
        self.at = at

    def __getitem__(self, key: int) -> dict[str, object]:
        if key == self.at:
            raise ValueError(f"{self.name}: key {key} cannot be read")
        return super().__getitem__(key)


def test_a_workers_error_reaches_the_caller_and_the_workers_end_with_it() -> None:
    others = set(multiprocessing.active_children())
    pool = StreamPool([Echo("a"), FailsAt("b", 2)], [CountingKeys(), CountingKeys()],
                      itertools.cycle([0, 1]), ["a", "b"], num_workers=2)
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


def test_the_loop_forecast_is_deepmd_kits_order() -> None:
    """Each step its training stream; after steps 0, 4, 9, ... (DeePMD-kit displays the 1st
    and every disp_freq-th) the validation streams; a stream not in the pool (None) skips."""
    tasks = [0, 1, None, 0, 1, 1, 0, 0, 1, 0, 0]

    def training(start: int, stop: int) -> list[int | None]:
        return [tasks[s % len(tasks)] for s in range(start, stop)]

    got = list(itertools.islice(loop_forecast(training, 3, displays=True, disp_freq=5,
                                              validation=[2, 2, 3]), 12))
    # steps 3..: 0, 1 (step 4 displays), 1, 0, 0, 1, 0 (step 9 displays)
    assert got == [0, 1, 2, 2, 3, 1, 0, 0, 1, 0, 2, 2]
    assert [s for s in range(12) if is_display_step(s, 5)] == [0, 4, 9]
    quiet = list(itertools.islice(loop_forecast(training, 0, displays=False, disp_freq=1,
                                                validation=[2]), 4))
    assert quiet == [0, 1, 0, 1]


def _trainer(root, multi_task: bool, valid_numb_batch, disp_freq: int, start: int = 0):
    """A stand-in for DeePMD-kit's trainer after ``__init__``: a DataLoader per task and role
    over mdloader's loader sets (never iterated), the iterators the pool replaces, and what
    DeePMD-kit's loop reads (display frequency, validation batches, the start step)."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from mdloader.loading.loader import DpLoaderSet, get_sampler_from_params
    from mdloader.testing import make_dataset

    tasks = ["x", "y"] if multi_task else [None]
    loaders: dict[str, dict] = {"training": {}, "validation": {}}
    for role in loaders:
        for t, task in enumerate(tasks):
            systems = make_dataset(root / f"{role}_{task}", 2, nframes=4, seed=len(role) + t)
            data = DpLoaderSet([str(p) for p in systems], 1, ["O", "H"], seed=3 + t)
            loaders[role][task] = DataLoader(data, sampler=get_sampler_from_params(data, {}),
                                             batch_size=None)
    pick = (lambda d: d) if multi_task else (lambda d: d[None])
    return SimpleNamespace(
        multi_task=multi_task, model_keys=tasks, rank=1, start_step=start,
        disp_freq=disp_freq, display_in_training=True, valid_numb_batch=valid_numb_batch,
        training_dataloader=pick(loaders["training"]),
        validation_dataloader=pick(loaders["validation"]),
        training_data=pick({t: "deepmd-iterator" for t in tasks}),
        validation_data=pick({t: "deepmd-iterator" for t in tasks}))


def _keys(batch: dict) -> tuple[int, list[int]]:
    return int(batch["sid"]), [int(f) for f in batch["fid"]]


def test_a_single_task_trainers_loop_is_foreseen_and_reads_its_samplers_keys(
        tmp_path) -> None:
    """DeePMD-kit's single-task loop (a training batch per step, ``valid_numb_batch``
    validation batches after steps 0, 2, 4, ...) asks nothing out of turn of two workers."""
    import copy

    from mdloader.integrations.deepmd.worker_pool import pool_streams

    trainer = _trainer(tmp_path, False, 3, disp_freq=2, start=0)
    twins = {role: copy.deepcopy(getattr(trainer, f"{role}_dataloader").sampler)
             for role in ("training", "validation")}
    pool, streams, replaced = pool_streams(trainer, 2)
    assert replaced == ["deepmd-iterator", "deepmd-iterator"]
    assert streams.names == ["training", "validation"]
    got: dict[str, list] = {"training": [], "validation": []}
    for step in range(9):
        got["training"].append(_keys(next(trainer.training_data)))
        if (step + 1) % 2 == 0 or step + 1 == 1:  # DeePMD-kit's display condition
            got["validation"] += [_keys(next(trainer.validation_data)) for _ in range(3)]
    assert pool.unforeseen == 0
    assert pool.most_held == 0, "every batch came in the order it was asked for"
    for role, sampler in twins.items():
        data = getattr(trainer, f"{role}_dataloader").dataset
        expected = [_keys(data[sampler.next_key()]) for _ in got[role]]
        assert got[role] == expected, f"the {role} stream reads its own sampler's keys"
    assert len(got["validation"]) == 3 * 5
    pool.close()


def test_a_multi_task_trainers_loop_follows_the_task_schedule(tmp_path, monkeypatch) -> None:
    """The forecast's training stream of each step is the task mdloader's schedule gives that
    step on this rank, from a restart's start step; each task validates ``valid_numb_batch``
    of its own at a display step."""
    from mdloader.integrations.deepmd import training as dp_training
    from mdloader.integrations.deepmd.worker_pool import pool_streams
    from mdloader.sampling.tasks import TaskCursor, TaskSchedule

    trainer = _trainer(tmp_path, True, {"x": 1, "y": 2}, disp_freq=3, start=5)
    schedule = TaskSchedule(seed=11, probs=(0.5, 0.5))
    monkeypatch.setattr(dp_training.SCHEDULED_TASKS, "cursor",
                        TaskCursor(schedule, rank=1, step=5))
    pool, streams, _ = pool_streams(trainer, 2)
    assert streams.names == ["training.x", "training.y", "validation.x", "validation.y"]
    for step in range(5, 25):
        task = trainer.model_keys[schedule.task(1, step)]
        next(trainer.training_data[task])
        if (step + 1) % 3 == 0 or step + 1 == 1:
            for other, count in trainer.valid_numb_batch.items():
                for _ in range(count):
                    next(trainer.validation_data[other])
    assert pool.unforeseen == 0
    assert pool.most_held == 0, "every batch came in the order it was asked for"
    pool.close()


def test_deepmd_kits_own_loaders_are_kept_on_request(tmp_path, monkeypatch) -> None:
    from mdloader.integrations.deepmd.worker_pool import pool_streams

    monkeypatch.setenv("MDLOADER_DP_WORKERS", "per-loader")
    trainer = _trainer(tmp_path, False, 1, disp_freq=1)
    assert pool_streams(trainer, 2) is None
    assert trainer.training_data == "deepmd-iterator"
