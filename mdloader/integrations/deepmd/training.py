"""DeePMD-kit's training loop under mdloader: the task of each multi-task step.

DeePMD-kit's ``Trainer.run`` picks each step's task with ``dp_random.choice(p=model_prob)``,
a global generator that nothing seeds under mdloader and no checkpoint records. mdloader puts a
:class:`~mdloader.sampling.tasks.TaskCursor` in its place: the task of step ``s`` on rank ``r``
is a pure function of (seed, s, r) (:mod:`mdloader.sampling.tasks`), so two launches train the
same tasks, and a ``--restart`` continues the sequence at the checkpoint's step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mdloader import settings
from mdloader.errors import MdloaderError
from mdloader.sampling.order import normalize_seed
from mdloader.sampling.tasks import TaskCursor, TaskSchedule

log = logging.getLogger(__name__)


def schedule_of(training: Mapping[str, Any], model_prob: Any, num_steps: int) -> TaskSchedule:
    """The task schedule of a trainer: DeePMD-kit's resolved ``model_prob`` and mdloader's rules.

    ``num_epoch_dict`` makes the whole run one exact-count window (each task trains exactly its
    largest-remainder share of the steps); otherwise each step draws its task. An unseeded job
    uses seed 0, so that it too is reproducible.
    """
    seed = normalize_seed(training.get("seed"))
    same = settings.resolve("task_draw") == "same"
    window = int(num_steps) if training.get("num_epoch_dict") else 0
    probs = tuple(float(p) for p in np.asarray(model_prob, dtype=np.float64))
    return TaskSchedule(seed=0 if seed is None else seed, probs=probs, window=window,
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
        schedule = schedule_of(SCHEDULED_TASKS.training, self.model_prob, self.num_steps)
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
