"""The multi-task step schedule: pure, random access, DeePMD-kit's weights, exact counts."""

from __future__ import annotations

import numpy as np
import pytest

from mdloader.errors import ConfigError
from mdloader.sampling.tasks import (
    TaskCursor,
    TaskSchedule,
    epoch_steps,
    largest_remainder,
    task_key_word,
    task_weights,
)


def test_any_step_is_computed_without_replay():
    schedule = TaskSchedule(seed=7, probs=(0.3, 0.7))
    whole = schedule.tasks(rank=0, start=0, stop=10000)
    assert [schedule.task(0, s) for s in (0, 4095, 4096, 9999)] == [
        whole[0], whole[4095], whole[4096], whole[9999]]
    assert np.array_equal(schedule.tasks(0, 4000, 5000), whole[4000:5000])


def test_same_seed_same_sequence_other_seed_other_sequence():
    a = TaskSchedule(seed=1, probs=(0.5, 0.5)).tasks(0, 0, 64)
    assert np.array_equal(a, TaskSchedule(seed=1, probs=(0.5, 0.5)).tasks(0, 0, 64))
    assert not np.array_equal(a, TaskSchedule(seed=2, probs=(0.5, 0.5)).tasks(0, 0, 64))


def test_draws_follow_the_probabilities():
    counts = TaskSchedule(seed=3, probs=(0.2, 0.8)).counts(0, 0, 20000)
    assert abs(counts[0] / 20000 - 0.2) < 0.02


def test_zero_probability_task_is_never_drawn():
    assert set(TaskSchedule(seed=3, probs=(0.0, 1.0, 0.0)).tasks(1, 0, 5000)) == {1}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_draw_independently_by_default_and_alike_on_request(world):
    independent = TaskSchedule(seed=5, probs=(0.5, 0.5))
    shared = TaskSchedule(seed=5, probs=(0.5, 0.5), same_task_across_ranks=True)
    rows = [independent.tasks(r, 0, 200) for r in range(world)]
    assert all(not np.array_equal(rows[0], row) for row in rows[1:])
    shared_rows = [shared.tasks(r, 0, 200) for r in range(world)]
    assert all(np.array_equal(shared_rows[0], row) for row in shared_rows)


def test_deepmd_weights_rule():
    assert np.allclose(task_weights(["a", "b"], {"a": 1.0, "b": 3.0}), [0.25, 0.75])
    assert np.allclose(task_weights(["a", "b"], None, {"a": 2, "b": 6}), [0.25, 0.75])
    with pytest.raises(ConfigError, match="missing: b"):
        task_weights(["a", "b"], {"a": 1.0})
    with pytest.raises(ConfigError, match="training.model_prob"):
        task_weights(["a", "b"], {"a": 0.0, "b": 0.0})


def test_epoch_rule_and_largest_remainder():
    probs, steps = epoch_steps(["a", "b"], {"a": 1.5, "b": 1.0}, {"a": 2, "b": 2})
    assert steps == 5 and np.allclose(probs, [0.6, 0.4])
    assert largest_remainder(probs, steps).tolist() == [3, 2]
    assert largest_remainder([1, 1, 1], 7).tolist() == [3, 2, 2]
    assert largest_remainder([0.5, 0.5], 0).tolist() == [0, 0]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_num_epoch_dict_targets_are_met_exactly_on_every_rank(world):
    probs, steps = epoch_steps(["a", "b"], {"a": 1.5, "b": 1.0}, {"a": 2, "b": 2})
    schedule = TaskSchedule(seed=11, probs=tuple(probs), window=steps)
    for rank in range(world):
        assert schedule.counts(rank, 0, steps).tolist() == [3, 2]
        # later windows hold the same counts, in another order
        assert schedule.counts(rank, steps, 3 * steps).tolist() == [6, 4]
    orders = {tuple(schedule.tasks(0, w * steps, (w + 1) * steps)) for w in range(6)}
    assert len(orders) > 1


def test_cursor_is_the_step_count_and_resumes():
    schedule = TaskSchedule(seed=9, probs=(0.5, 0.25, 0.25))
    cursor = TaskCursor(schedule, rank=1)
    first = [cursor.choice(np.arange(3), p=schedule.probs) for _ in range(10)]
    assert first == schedule.tasks(1, 0, 10).tolist()
    resumed = TaskCursor(schedule, rank=1)
    resumed.load_state_dict({"step": 6})
    assert [resumed.choice() for _ in range(4)] == first[6:]
    assert resumed.state_dict() == {"step": 10}


def test_task_key_word_is_stable():
    assert task_key_word("water") == 0xFB3314DA  # CRC-32: the same in every process
    assert task_key_word("a") != task_key_word("b")


def test_bad_schedule_is_refused():
    with pytest.raises(ConfigError):
        TaskSchedule(seed=0, probs=(0.0, 0.0))
    with pytest.raises(ConfigError):
        TaskSchedule(seed=0, probs=(1.0,), window=-1)
