"""One pool of DataLoader workers for every data stream of DeePMD-kit's trainer.

DeePMD-kit builds a DataLoader per task and role (training, validation), each with
``NUM_WORKERS`` worker processes: ``T x (1 + V) x NUM_WORKERS`` per rank. Under mdloader, when
``Trainer.run`` starts (after a restart's loader state is restored), the trainer's iterators are
replaced by the streams of one :class:`~mdloader.loading.stream_pool.StreamPool` of
``NUM_WORKERS`` processes. Its forecast is DeePMD-kit's loop (:func:`loop_forecast`): each step
one training batch of the step's task (mdloader's task schedule), and at a display step
``valid_numb_batch`` validation batches of every task, in the trainer's task order. Each stream
still serves its own sampler's keys in order, so the batches are those of DeePMD-kit's own
DataLoaders; DeePMD-kit's DataLoaders stay (their samplers are the keys, the loader state reads
them) but are never iterated. ``MDLOADER_DP_WORKERS=per-loader`` keeps DeePMD-kit's.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mdloader import settings
from mdloader.integrations.deepmd.seam import TRAINING
from mdloader.integrations.deepmd.training import SCHEDULED_TASKS
from mdloader.loading.loader import DpLoaderSet
from mdloader.loading.stream_pool import StreamPool
from mdloader.sampling.samplers import WeightedSystemSampler

log = logging.getLogger(__name__)

#: Steps of the task schedule the forecast reads at a time.
FORECAST_CHUNK = 256


def is_display_step(step: int, disp_freq: int) -> bool:
    """Whether DeePMD-kit's loop displays (and validates) after the 0-based ``step``."""
    shown = int(step) + 1
    return shown == 1 or (disp_freq > 0 and shown % disp_freq == 0)


def loop_forecast(training: Callable[[int, int], Sequence[int | None]], start: int, *,
                  displays: bool, disp_freq: int, validation: Sequence[int]) -> Iterator[int]:
    """The streams DeePMD-kit's loop asks for, step by step from ``start``: the training stream
    of each step (``training(a, b)``: one per step of ``[a, b)``, ``None`` for a stream not in
    the pool), then after a display step the ``validation`` streams, in order."""
    step = int(start)
    while True:
        for stream in training(step, step + FORECAST_CHUNK):
            if stream is not None:
                yield int(stream)
            if displays and validation and is_display_step(step, disp_freq):
                yield from validation
            step += 1


@dataclass
class TrainerStreams:
    """The trainer's data streams mdloader reads: where each iterator lives, its loader set and
    sampler, and the stream of each task's training and validation data."""

    names: list[str]
    datasets: list[DpLoaderSet]
    samplers: list[WeightedSystemSampler]
    places: list[tuple[str, str | None]]  # ("training_data" | "validation_data", task)
    training: dict[str | None, int]
    validation: dict[str | None, int]

    @classmethod
    def of(cls, trainer: Any) -> TrainerStreams:
        found = cls([], [], [], [], {}, {})
        tasks = list(trainer.model_keys) if trainer.multi_task else [None]
        for role in ("training", "validation"):
            loaders = getattr(trainer, f"{role}_dataloader", None)
            for task in tasks:
                loader = loaders.get(task) if isinstance(loaders, dict) else loaders
                sampler = getattr(loader, "sampler", None)
                data = getattr(loader, "dataset", None)
                if not (isinstance(sampler, WeightedSystemSampler)
                        and isinstance(data, DpLoaderSet)):
                    continue  # no data, or not mdloader's: DeePMD-kit's own loader reads it
                getattr(found, role)[task] = len(found.names)
                found.names.append(role if task is None else f"{role}.{task}")
                found.datasets.append(data)
                found.samplers.append(sampler)
                found.places.append((f"{role}_data", task))
        return found

    def iterators(self, trainer: Any) -> list[Any]:
        """The trainer's current iterator of every stream."""
        return [_get(trainer, attr, task) for attr, task in self.places]


def _get(trainer: Any, attr: str, task: str | None) -> Any:
    holder = getattr(trainer, attr)
    return holder if task is None else holder[task]


def _put(trainer: Any, attr: str, task: str | None, value: Any) -> None:
    if task is None:
        setattr(trainer, attr, value)
    else:
        getattr(trainer, attr)[task] = value


def trainer_forecast(trainer: Any, streams: TrainerStreams) -> Iterator[int]:
    """:func:`loop_forecast` of ``trainer`` from its first step."""
    if trainer.multi_task:
        cursor = SCHEDULED_TASKS.cursor
        keys = list(trainer.model_keys)
        schedule, rank = cursor.schedule, cursor.rank

        def training(start: int, stop: int) -> list[int | None]:
            return [streams.training.get(keys[t]) for t in schedule.tasks(rank, start, stop)]
        counts = trainer.valid_numb_batch
        tasks: list[str | None] = keys
    else:
        def training(start: int, stop: int) -> list[int | None]:
            return [streams.training.get(None)] * (stop - start)
        counts = {None: trainer.valid_numb_batch}
        tasks = [None]
    validation = [streams.validation[t] for t in tasks if t in streams.validation
                  for _ in range(int(counts[t]))]
    return loop_forecast(training, int(trainer.start_step),
                         displays=bool(getattr(trainer, "display_in_training", True)),
                         disp_freq=int(trainer.disp_freq), validation=validation)


def pool_streams(trainer: Any, num_workers: int, pin_memory: bool = False,
                 ) -> tuple[StreamPool, TrainerStreams, list[Any]] | None:
    """Put the streams of one pool of ``num_workers`` in place of the trainer's iterators: the
    pool, its streams and the iterators it replaced (``None``: DeePMD-kit's loaders asked for,
    or no stream)."""
    if settings.resolve("dp_workers") != "one":
        return None
    streams = TrainerStreams.of(trainer)
    if not streams.names:
        return None
    workers = int(num_workers)
    pool = StreamPool(streams.datasets, streams.samplers, trainer_forecast(trainer, streams),
                      streams.names, num_workers=workers, pin_memory=pin_memory)
    replaced = streams.iterators(trainer)
    for index, (attr, task) in enumerate(streams.places):
        _put(trainer, attr, task, pool.stream(index))
    if trainer.rank == 0:
        log.info("DataLoader workers: one pool of %d for %d stream(s) (%s), in place of %d",
                 workers, len(streams.names), ", ".join(streams.names),
                 workers * len(streams.names))
    return pool, streams, replaced


def pooled_trainer_run(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``Trainer.run`` whose data streams are read by one pool of DataLoader workers."""

    @functools.wraps(original)
    def run(self: Any) -> None:
        module = sys.modules[TRAINING]  # DeePMD-kit's number of workers per DataLoader
        pooled = pool_streams(self, int(module.NUM_WORKERS), str(module.DEVICE) != "cpu")
        try:
            return original(self)
        finally:
            if pooled is not None:
                pool, streams, replaced = pooled
                for (attr, task), iterator in zip(streams.places, replaced, strict=True):
                    _put(self, attr, task, iterator)
                pool.close()
                if self.rank == 0:
                    log.info("DataLoader worker pool: %s", pool.summary())

    return run
