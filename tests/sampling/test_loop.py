"""The requests of a trainer's loop, step by step (pure): what a feed's pool reads ahead."""

from __future__ import annotations

import itertools

import numpy as np

from mdloader.sampling.loop import FORECAST_CHUNK, TrainingLoop, requests
from mdloader.sampling.tasks import TaskSchedule


def test_a_single_task_loop_is_deepmd_kits_order() -> None:
    """Each step its training batch; after the 1st and every disp_freq-th step the validation
    batches; mdloader train also displays its last step."""
    loop = TrainingLoop(disp_freq=5, validation=(2,))
    got = list(itertools.islice(requests(loop, 3), 12))
    # steps 3, 4 (displays), 5, 6, 7, 8, 9 (displays), 10
    t, v = (0, "training"), (0, "validation")
    assert got == [t, t, v, v, t, t, t, t, t, v, v, t]
    assert [s for s in range(12) if loop.is_display_step(s)] == [0, 4, 9]
    last = TrainingLoop(disp_freq=5, validation=(1,), last_display=7)
    assert [s for s in range(12) if last.is_display_step(s)] == [0, 4, 6, 9]
    quiet = TrainingLoop(disp_freq=1, displays=False, validation=(2,))
    assert list(itertools.islice(requests(quiet, 0), 3)) == [t, t, t]


def test_a_multi_task_loop_follows_its_schedule_and_draws_for_display() -> None:
    """The step's task trains; at a display step every other task gives a display-time
    training batch, and every task its validation batches, in the trainer's task order."""
    schedule = TaskSchedule(seed=11, probs=(0.5, 0.3, 0.2))
    loop = TrainingLoop(tasks=("a", "b", "c"), probs=schedule.probs, disp_freq=4,
                        validation=(1, 0, 2), display_draws=True)

    def tasks_of(start: int, stop: int) -> np.ndarray:
        return schedule.tasks(1, start, stop)

    start = FORECAST_CHUNK - 6  # across a chunk of the schedule
    got = list(itertools.islice(requests(loop, start, tasks_of), 60))
    expected = []
    for step in range(start, start + 40):
        task = schedule.task(1, step)
        expected.append((task, "training"))
        if (step + 1) % 4 == 0:
            for other in range(3):
                if other != task:
                    expected.append((other, "display"))
                expected += [(other, "validation")] * loop.validation[other]
    assert got == expected[:60]
    averaged = TrainingLoop(tasks=("a", "b"), probs=(0.5, 0.5), disp_freq=1,
                            validation=(1, 1), display_draws=False)
    assert list(itertools.islice(requests(averaged, 0, lambda a, b: [1] * (b - a)), 3)) == [
        (1, "training"), (0, "validation"), (1, "validation")]
