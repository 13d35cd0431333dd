"""How a trainer's loop asks for batches, step by step (pure): what a feed reads ahead.

Both trainers run DeePMD-kit's loop: each step trains one batch of the step's task; after a
display step they evaluate the validation batches of every task and, in a multi-task job that
does not average its display (``disp_avg``), one training batch of every task the step did not
train (a *display draw*). :func:`requests` lists those requests in the loop's own order, so a
pool of workers can read exactly what will be asked next
(:class:`~mdloader.loading.pool.WorkerPool`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

#: Steps of the task schedule read at a time.
FORECAST_CHUNK = 256


@dataclass(frozen=True)
class TrainingLoop:
    """The shape of a trainer's loop.

    Attributes
    ----------
    tasks
        The tasks, in the trainer's order (``(None,)`` for a single task).
    probs, window, same_task_across_ranks
        The multi-task schedule (:class:`~mdloader.sampling.tasks.TaskSchedule`): the task
        probabilities, the exact-count window (0: independent draws), one task for all ranks.
    disp_freq, displays
        A display every ``disp_freq`` steps (and after the first), when ``displays``.
    last_display
        One more displaying step (1-based), or ``None`` (``mdloader train`` displays its last).
    validation
        Validation batches per display, per task (in the order of ``tasks``).
    display_draws
        A display evaluates one training batch of every task the step did not train.
    """

    tasks: tuple[str | None, ...] = (None,)
    probs: tuple[float, ...] | None = None
    window: int = 0
    same_task_across_ranks: bool = False
    disp_freq: int = 1
    displays: bool = True
    last_display: int | None = None
    validation: tuple[int, ...] = (0,)
    display_draws: bool = False

    @property
    def multi_task(self) -> bool:
        return self.tasks != (None,)

    def is_display_step(self, step: int) -> bool:
        """Whether the loop displays (and validates) after the 0-based ``step``."""
        shown = int(step) + 1
        return self.displays and (shown == 1 or (self.disp_freq > 0 and shown % self.disp_freq
                                                 == 0) or shown == self.last_display)


def requests(loop: TrainingLoop, start: int,
             tasks_of: Callable[[int, int], Sequence[int]] | None = None,
             ) -> Iterator[tuple[int, str]]:
    """The loop's requests from step ``start`` on, endlessly, as ``(task index, role)`` with
    role ``"training"``, ``"display"`` or ``"validation"``.

    ``tasks_of(a, b)`` gives the task index of every step of ``[a, b)`` (the schedule's);
    without it every step trains task 0.
    """
    ntasks = len(loop.tasks)
    step = int(start)
    while True:
        stop = step + FORECAST_CHUNK
        chunk = (tasks_of(step, stop) if tasks_of is not None
                 else np.zeros(FORECAST_CHUNK, dtype=np.int64))
        for task in chunk:
            yield int(task), "training"
            if loop.is_display_step(step):
                for other in range(ntasks):
                    if loop.display_draws and other != task:
                        yield other, "display"
                    for _ in range(loop.validation[other]):
                        yield other, "validation"
            step += 1


__all__ = ["FORECAST_CHUNK", "TrainingLoop", "requests"]
