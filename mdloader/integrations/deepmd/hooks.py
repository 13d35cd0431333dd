"""DeePMD-kit's trainer on one mdloader feed: a few thin hooks, each calling the feed.

When a ``Trainer`` is made (:func:`trainer_init`), its streams -- the training and validation
data of every task, which DeePMD-kit built through mdloader's ``DpLoaderSet`` and sampler -- and,
in a multi-task job, a display stream per task become one :class:`~mdloader.loading.feed.Feed`,
the trainer's only record here (:data:`_RUNS`). When it runs (:func:`trainer_run`), the feed
restores the loader state saved beside the ``--restart`` checkpoint, sets the task schedule at the
step the run continues at, and starts one pool of workers reading ahead in DeePMD-kit's own
order (resume, schedule, pool: :meth:`~mdloader.loading.feed.Feed.start`); the trainer's
iterators are then the feed's, and its full validation passes
(:mod:`~.full_validation`) the feed's too. Each training step (:func:`next_training_batch`) is a
:meth:`~mdloader.loading.feed.Feed.training_step` (stop signals are agreed on there,
:mod:`~.stopping`); before each checkpoint every rank gathers the feed's state
(:class:`GatheringGuard`), which rank 0 writes beside it (:func:`saving_loader_state`).

The loader state makes a ``--restart`` continue with the batches an uninterrupted run would have
drawn, on any number of ranks (a merged state resumes elastically), and skips the step
DeePMD-kit would run twice (it restarts its loop at the saved step index). The task of each
multi-task step is the feed's schedule, a pure function of (seed, step, rank), in place of
DeePMD-kit's unseeded ``dp_random``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mdloader import settings
from mdloader.distributed.group import current_world
from mdloader.errors import MdloaderError
from mdloader.integrations.deepmd import full_validation, seam, stopping
from mdloader.integrations.deepmd.systems import current_job
from mdloader.loading import feed_state
from mdloader.loading.feed import Feed, Stream
from mdloader.loading.loader import DpLoaderSet, agree_seed
from mdloader.loading.pool import lost_worker_error
from mdloader.sampling.loop import TrainingLoop
from mdloader.sampling.mixed import MixedBatchSampler
from mdloader.sampling.samplers import WeightedSystemSampler

log = logging.getLogger(__name__)


@dataclass
class TrainerRun:
    """What mdloader keeps of one trainer: its feed, the ``--restart`` checkpoint, its
    ``training`` section, and the loader state gathered for the checkpoint about to be saved."""

    feed: Feed
    restart: str | None
    training: dict[str, Any]
    gathered: dict[str, Any] | None = None


#: The one record kept per trainer (weakly: it goes with the trainer).
_RUNS: weakref.WeakKeyDictionary[Any, TrainerRun] = weakref.WeakKeyDictionary()


class ScheduledTasks:
    """Stands in for DeePMD-kit's ``dp_random`` in its training module: ``choice`` is the task
    of the running trainer's next step, from its feed's schedule."""

    def __init__(self) -> None:
        self.feed: Feed | None = None

    def choice(self, a: object = None, size: object = None, replace: bool = True,
               p: object = None) -> int:
        if self.feed is None:
            raise MdloaderError("a multi-task step was drawn outside Trainer.run: mdloader's "
                                "task schedule is set when the trainer starts its loop")
        return self.feed.next_task()


#: The one stand-in the training module's ``dp_random`` is rebound to.
SCHEDULED_TASKS = ScheduledTasks()


def trainer_feed(trainer: Any, training: dict[str, Any]) -> Feed:
    """The feed of the streams ``trainer`` built through mdloader, one per task and role, and
    a display stream per task where a multi-task display evaluates other tasks' batches; its
    seed is the job's (``training.seed``, else rank 0's random one)."""
    tasks = list(trainer.model_keys) if trainer.multi_task else [None]
    streams = []
    for role, loaders in (("training", trainer.training_dataloader),
                          ("validation", trainer.validation_dataloader)):
        for task in tasks:
            loader = loaders.get(task) if isinstance(loaders, dict) else loaders
            sampler, data = getattr(loader, "sampler", None), getattr(loader, "dataset", None)
            if isinstance(sampler, WeightedSystemSampler) and isinstance(data, DpLoaderSet):
                streams.append(Stream(task, role, data, sampler))
            elif isinstance(sampler, MixedBatchSampler) and getattr(data, "mixed", None):
                streams.append(Stream(task, role, data.mixed, sampler))  # mix:N
    job = current_job()
    world = current_world()
    seed = (job.job_seed() if job is not None
            else agree_seed(training.get("seed"), world))  # a trainer made by DeePMD-kit's API
    module = seam.deepmd_module(seam.TRAINING)
    feed = Feed(streams, seed=seed, world=world, num_workers=int(module.NUM_WORKERS),
                pin_memory=str(module.DEVICE).startswith("cuda"),  # pinning is for CUDA
                separate_pools=settings.resolve("dp_workers") == "per-loader")
    if trainer.multi_task and not trainer.disp_avg:
        feed.add_display_streams()
    guard = stopping.NonFiniteBatches(feed)
    for stream in feed.streams.values():
        if stream.role == "training":
            stream.check = guard
    return feed


def trainer_loop(trainer: Any, training: dict[str, Any]) -> TrainingLoop:
    """The shape of DeePMD-kit's loop for ``trainer`` (and its ``training`` section): its tasks
    and their schedule, its displays, validation batches and display-time draws."""
    if not trainer.multi_task:
        return TrainingLoop(disp_freq=int(trainer.disp_freq),
                            displays=bool(trainer.display_in_training),
                            validation=(int(trainer.valid_numb_batch),))
    tasks = tuple(trainer.model_keys)
    counts = trainer.valid_numb_batch
    return TrainingLoop(
        tasks=tasks, probs=tuple(float(p) for p in trainer.model_prob),
        window=int(trainer.num_steps) if training.get("num_epoch_dict") else 0,
        same_task_across_ranks=settings.resolve("task_draw") == "same",
        disp_freq=int(trainer.disp_freq), displays=bool(trainer.display_in_training),
        validation=tuple(int(counts[t]) for t in tasks),
        display_draws=not trainer.disp_avg)


def trainer_init(original: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.__init__``, then the trainer's feed, and its ``--restart`` checkpoint kept
    (``--init-model`` and ``--finetune`` start fresh streams)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments
        restart = (given.get("restart_model") if given.get("init_model") is None else None)
        training = dict(given["config"].get("training", {}))
        _RUNS[self] = TrainerRun(trainer_feed(self, training), restart, training)

    return __init__


def trainer_run(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``Trainer.run`` fed by the trainer's feed: started at the trainer's first step (after
    the restart checkpoint's loader state, skipping the step DeePMD-kit would run twice), its
    iterators in place of the trainer's for the run, ended with it."""

    @functools.wraps(original)
    def run(self: Any) -> None:
        record = _RUNS[self]
        feed = record.feed
        state = restart_state(self, record.restart)
        start = int(self.start_step) + (1 if state is not None else 0)
        feed.start(start, trainer_loop(self, record.training), state,
                   stall_dir=os.path.dirname(os.path.abspath(self.disp_file)))
        if state is not None:
            _skip_the_saved_step(self, record.restart)
        tasks = list(self.model_keys) if self.multi_task else [None]
        before = self.training_data, self.validation_data, self.nonfinite_grad_guard
        if self.multi_task:
            self.training_data = {t: feed.draws(t) for t in tasks}
            self.validation_data = {t: feed.streams.get((t, "validation")) for t in tasks}
        else:
            self.training_data = feed.draws(None)
            self.validation_data = feed.streams.get((None, "validation"))
        self.nonfinite_grad_guard = GatheringGuard(self.nonfinite_grad_guard, record)
        SCHEDULED_TASKS.feed = feed
        try:
            with full_validation.bound(self, feed, lambda name: stopping.stop_now(
                    self, feed.step, name), stopping.pending_signal):
                original(self)
            feed.finish()
        except RuntimeError as exc:  # torch noticed a dead worker wherever the loop was
            lost = lost_worker_error()  # asked while the feed's pool is open
            if lost is None:
                raise
            raise lost from exc
        finally:
            SCHEDULED_TASKS.feed = None
            self.training_data, self.validation_data, self.nonfinite_grad_guard = before
            feed.close()

    return run


def restart_state(trainer: Any, checkpoint: str | None) -> dict[str, Any] | None:
    """The loader state beside the ``--restart`` checkpoint (``None``, and one warning on
    rank 0, when it has none: the streams start over)."""
    if checkpoint is None:
        return None
    state = feed_state.read_beside(checkpoint)
    if state is None and trainer.rank == 0:
        log.warning("%s has no mdloader loader state beside it (%s; written by plain dp?): the "
                    "data streams start over from their first batch", checkpoint,
                    feed_state.path_beside(checkpoint))
    return state


def _skip_the_saved_step(trainer: Any, checkpoint: str | None) -> None:
    """The checkpoint's own step is done: DeePMD-kit's loop does not run it again, and its
    learning-rate scheduler (Adam-type optimizers) moves past it."""
    trainer.start_step = int(trainer.start_step) + 1
    scheduler = getattr(trainer, "scheduler", None)  # Adam-type optimizers have one
    if scheduler is not None:
        with warnings.catch_warnings():  # no optimizer step was taken in this process yet
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            scheduler.step()
    if trainer.rank == 0:
        log.info("restored the loader state of %s: continuing at step %d", checkpoint,
                 trainer.start_step)


def next_training_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer._next_training_batch``, which DeePMD-kit's loop calls once per step: the step
    of the feed, after the ranks agreed on a stop signal."""

    @functools.wraps(original)
    def _next_training_batch(self: Any, task_key: str = "Default") -> Any:
        feed = _RUNS[self].feed
        with feed.training_step() as step:
            stopping.stop_if_signalled(self, feed, step)
            return original(self, task_key)

    return _next_training_batch


class GatheringGuard:
    """DeePMD-kit's non-finite gradient guard; its check, which every rank runs before a
    checkpoint is saved, also gathers the feed's state to rank 0 (the one collective)."""

    def __init__(self, real: Any, record: TrainerRun) -> None:
        self._real = real
        self._record = record

    def raise_if_nonfinite(self, *args: Any, **kwargs: Any) -> Any:
        result = self._real.raise_if_nonfinite(*args, **kwargs)
        self._record.gathered = self._record.feed.gather_state()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def saving_loader_state(original: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.save_model`` that writes the loader state beside the checkpoint (rank 0)."""

    @functools.wraps(original)
    def save_model(self: Any, save_path: Any, lr: float = 0.0, step: int = 0,
                   **kwargs: Any) -> None:
        original(self, save_path, lr, step, **kwargs)
        record = _RUNS.get(self)
        if record is None or self.rank != 0 or not record.feed.started:
            return
        state = record.gathered
        if _stale(state, step) and not current_world().distributed:
            state = record.feed.gather_state()
        if _stale(state, step):  # a save no rank but 0 takes part in: nothing was gathered
            log.debug("no loader state for %s: not every rank took part in this save",
                      save_path)
            return
        feed_state.write_beside(save_path, state)  # type: ignore[arg-type]

    return save_model


def _stale(state: dict[str, Any] | None, step: int) -> bool:
    """Whether ``state`` is not the loader state of a checkpoint of the 0-based ``step``."""
    return state is None or int(state["next_step"]) != int(step) + 1
