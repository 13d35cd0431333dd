"""DeePMD-kit's training loop under mdloader: the task of each multi-task step, and the
display-time batches of the tasks a step does not train.

DeePMD-kit's ``Trainer.run`` picks each step's task with ``dp_random.choice(p=model_prob)``,
a global generator that nothing seeds under mdloader and no checkpoint records. mdloader puts a
:class:`~mdloader.sampling.tasks.TaskCursor` in its place: the task of step ``s`` on rank ``r``
is a pure function of (seed, s, r) (:mod:`mdloader.sampling.tasks`), so two launches train the
same tasks, and a ``--restart`` continues the sequence at the checkpoint's step. An unseeded
job's schedule takes rank 0's random seed, which the loader state records.

At a display step DeePMD-kit also evaluates one *training* batch of every task the step did not
train. Under mdloader those batches come from a :class:`DisplayStream` of each task, over its
training systems but keyed apart (:func:`~mdloader.sampling.tasks.display_stream_seed`), so
logging never changes what is trained.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from mdloader import settings
from mdloader.distributed.collectives import agreed_seed
from mdloader.distributed.group import current_world
from mdloader.errors import ConfigError, MdloaderError, StateDictError
from mdloader.loading.loader import DpLoaderSet
from mdloader.sampling.order import normalize_seed
from mdloader.sampling.plan import PlanOwner
from mdloader.sampling.samplers import WeightedSystemSampler
from mdloader.sampling.tasks import TaskCursor, TaskSchedule, display_stream_seed

log = logging.getLogger(__name__)


def schedule_of(seed: int, training: Mapping[str, Any], model_prob: Any,
                num_steps: int) -> TaskSchedule:
    """The task schedule of a trainer under ``seed``: DeePMD-kit's resolved ``model_prob`` and
    mdloader's rules.

    ``num_epoch_dict`` makes the whole run one exact-count window (each task trains exactly its
    largest-remainder share of the steps); otherwise each step draws its task.
    """
    same = settings.resolve("task_draw") == "same"
    window = int(num_steps) if training.get("num_epoch_dict") else 0
    probs = tuple(float(p) for p in np.asarray(model_prob, dtype=np.float64))
    return TaskSchedule(seed=int(seed), probs=probs, window=window,
                        same_task_across_ranks=same)


class ScheduledTasks:
    """Stands in for DeePMD-kit's ``dp_random`` in its training module: ``choice`` is the task
    of the running trainer's current step."""

    def __init__(self) -> None:
        self.cursor: TaskCursor | None = None
        self.training: dict[str, Any] = {}

    def choice(self, a: object = None, size: object = None, replace: bool = True,
               p: object = None) -> int:
        if self.cursor is None:
            raise MdloaderError("a multi-task step was drawn outside Trainer.run: mdloader's "
                                "task schedule is set when the trainer starts its loop")
        return self.cursor.choice(a, size, replace, p)


#: The one stand-in the training module's ``dp_random`` is rebound to.
SCHEDULED_TASKS = ScheduledTasks()

_SCHEDULE_SEEDS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_DISPLAY: weakref.WeakKeyDictionary[Any, dict[str, DisplayStream]] = weakref.WeakKeyDictionary()


def schedule_seed(trainer: Any) -> int:
    """The seed of ``trainer``'s task schedule: the job seed, one restored from a loader state,
    or for an unseeded job rank 0's random seed (a collective on first call)."""
    if trainer not in _SCHEDULE_SEEDS:
        given = normalize_seed(SCHEDULED_TASKS.training.get("seed"))
        _SCHEDULE_SEEDS[trainer] = agreed_seed(given, current_world())
    return _SCHEDULE_SEEDS[trainer]


def recorded_schedule_seed(trainer: Any) -> int | None:
    """The seed :func:`schedule_seed` settled on for ``trainer``, if any (no collective)."""
    return _SCHEDULE_SEEDS.get(trainer)


def restore_schedule_seed(trainer: Any, saved: int) -> None:
    """Take the schedule seed of a loader state: adopted by an unseeded job, checked otherwise."""
    given = normalize_seed(SCHEDULED_TASKS.training.get("seed"))
    if given is not None and int(saved) != given:
        raise StateDictError(f"the loader state's task schedule has seed {saved} but the input "
                             f"has training.seed {given}: not this job's checkpoint")
    _SCHEDULE_SEEDS[trainer] = int(saved)


class DisplayStream:
    """One task's display-time batches: its training systems, under a seed of their own.

    An iterator of batches, read in the main process (no prefetch: its sampler's position is
    the count of batches handed out), put in place of the task's training iterator for the
    duration of one display draw.
    """

    def __init__(self, data: DpLoaderSet, training: WeightedSystemSampler) -> None:
        plan = data.plan_owner.plan
        owner = PlanOwner(dataclasses.replace(plan, seed=display_stream_seed(plan.seed)))
        self.data = data
        self.sampler = WeightedSystemSampler.of_plan(
            owner, training.rule, rank=training.rank, num_samples=training.num_samples,
            type_map=data.type_map)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        return self.data[self.sampler.next_key()]


def display_streams(trainer: Any) -> dict[str, DisplayStream]:
    """The display streams of a multi-task ``trainer``, by task (made on first call; none for a
    single task or under ``disp_avg``, where DeePMD-kit draws no display batch)."""
    if trainer not in _DISPLAY:
        streams: dict[str, DisplayStream] = {}
        loaders = getattr(trainer, "training_dataloader", None)
        if getattr(trainer, "multi_task", False) and not getattr(trainer, "disp_avg", False):
            for task, loader in loaders.items():
                sampler, data = getattr(loader, "sampler", None), getattr(loader, "dataset", None)
                if isinstance(sampler, WeightedSystemSampler) and isinstance(data, DpLoaderSet):
                    streams[task] = DisplayStream(data, sampler)
        _DISPLAY[trainer] = streams
    return _DISPLAY[trainer]


def is_display_draw(trainer: Any, is_train: bool, task_key: str) -> bool:
    """Whether ``get_data(is_train, task_key)`` is a display draw: a training batch of a task
    other than the one the running step trains."""
    cursor = SCHEDULED_TASKS.cursor
    if not is_train or cursor is None or cursor.current is None:
        return False
    return (trainer.model_keys[cursor.current] != task_key
            and task_key in display_streams(trainer))


def displaying_get_data(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer.get_data`` whose display draws read the task's display stream."""

    @functools.wraps(original)
    def get_data(self: Any, is_train: bool = True, task_key: str = "Default") -> Any:
        if not is_display_draw(self, is_train, task_key):
            return original(self, is_train, task_key)
        iterators = self.training_data
        training = iterators[task_key]
        iterators[task_key] = display_streams(self)[task_key]
        try:
            return original(self, is_train, task_key)
        finally:
            iterators[task_key] = training

    return get_data


def refusing_full_validation(original: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.__init__`` that refuses ``validating.full_validation`` in one line.

    DeePMD-kit's full validation evaluates every validation system whole, on rank 0 alone,
    through each system's own ``DeepmdData`` (``dataset.data_system``), which mdloader's
    systems do not have: it would fail with a ``TypeError`` at its first evaluation.
    """

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, "full_validator", None) is not None:
            raise ConfigError("DeePMD-kit's full validation is not supported under mdloader dp "
                              "(it reads each system whole on rank 0 through DeePMD-kit's own "
                              "reader); set it to false, or use mdloader train "
                              "--full-validation: every validation frame once, sharded over "
                              "the ranks", path="validating.full_validation")

    return __init__


def recording_step_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    """DeePMD-kit's ``resolve_step_schedule`` that also keeps the training section it read
    (seed, ``num_epoch_dict``) for the task schedule; its result is DeePMD-kit's own."""

    @functools.wraps(original)
    def resolve_step_schedule(training_params: Mapping[str, Any], *args: Any,
                              **kwargs: Any) -> Any:
        SCHEDULED_TASKS.training = dict(training_params)
        return original(training_params, *args, **kwargs)

    return resolve_step_schedule


def scheduled_trainer_run(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``Trainer.run`` with mdloader's task schedule, starting at the trainer's first step."""

    @functools.wraps(original)
    def run(self: Any) -> None:
        if not getattr(self, "multi_task", False):
            return original(self)
        schedule = schedule_of(schedule_seed(self), SCHEDULED_TASKS.training, self.model_prob,
                               self.num_steps)
        SCHEDULED_TASKS.cursor = TaskCursor(schedule, rank=self.rank, step=self.start_step)
        log.info("multi-task schedule: %s, tasks %s with probabilities %s, from step %d",
                 "exact counts" if schedule.window else "independent draws",
                 ", ".join(self.model_keys), np.round(schedule.probs, 4).tolist(),
                 self.start_step)
        try:
            return original(self)
        finally:
            SCHEDULED_TASKS.cursor = None

    return run
