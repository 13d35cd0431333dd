"""The task of each training step of a multi-task job (pure): a function of (seed, step, rank).

DeePMD-kit picks the task of every step with a global random generator that nothing under
mdloader seeds and no checkpoint records. Here the task of step ``s`` is computed from integers
only, with a counter-based generator (one ``numpy`` generator per chunk of steps, keyed by the
seed, the rank and the chunk), so any step is known without replaying the earlier ones and the
whole state of a schedule is its step count.

Two kinds of schedule, by DeePMD-kit's rules for the weights:

- *draws* (``model_prob``, or by default the number of systems per task): each step draws its
  task independently with those probabilities, as DeePMD-kit does;
- *exact counts* (``num_epoch_dict``): the steps are cut in windows of ``window`` steps; each
  window holds every task exactly its largest-remainder share of the window, in an order drawn
  from the seed, so the per-task targets are met exactly instead of in expectation.

By default every rank has its own sequence (DeePMD-kit's per-rank draw); with
``same_task_across_ranks`` the rank is left out of the keys and every rank trains the same task
at each step.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mdloader.errors import ConfigError
from mdloader.sampling.order import SEED_MOD, weights_to_cdf

TAG_TASK_DRAW = 0x5441534B    # "TASK": per-rank independent task draws
TAG_TASK_SHARED = 0x54534852  # "TSHR": task draws shared by all ranks
TAG_TASK_WINDOW = 0x5457494E  # "TWIN": per-rank order inside an exact-count window
TAG_TASK_WINDOW_SHARED = 0x5457534E  # "TWSN": window order shared by all ranks
TAG_TASK_STREAM = 0x5453544D  # "TSTM": the data streams of one task
TAG_TASK_DISPLAY = 0x54445350  # "TDSP": the display-time batches of one task
TASK_CHUNK = 4096
"""Steps per chunk of draws: each chunk has its own generator, so step s is random access."""


def task_key_word(task: str) -> int:
    """A stable 32-bit word for a task name (CRC-32 of its UTF-8 bytes, never Python's hash)."""
    return zlib.crc32(task.encode("utf-8"))


def task_stream_seed(seed: int, task: str) -> int:
    """The job seed of ``task``'s data streams: ``seed`` with the task key folded in.

    Two tasks on the same systems then draw different batches, and a task's batches do not
    depend on which other tasks the job has.
    """
    words = [int(seed) % SEED_MOD, TAG_TASK_STREAM, task_key_word(task)]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])


def display_stream_seed(stream_seed: int) -> int:
    """The seed of a task's display-time batches, from the seed of its training stream.

    A multi-task display step evaluates one batch of every task not trained at that step;
    drawn from a stream keyed apart, those batches leave the training streams untouched, so
    how often a job logs never changes what it trains.
    """
    words = [int(stream_seed) % SEED_MOD, TAG_TASK_DISPLAY]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])


def task_weights(tasks: Sequence[str], model_prob: Mapping[str, float] | None = None,
                 nsystems: Mapping[str, int] | None = None) -> np.ndarray:
    """DeePMD-kit's task probabilities: ``model_prob`` normalised, else systems per task.

    Raises
    ------
    ConfigError
        A task missing from ``model_prob``, or weights not finite, negative or all zero.
    """
    if model_prob:
        missing = [t for t in tasks if t not in model_prob]
        if missing:
            raise ConfigError(f"every task needs a probability; missing: {', '.join(missing)}",
                              path="training.model_prob")
        raw = np.array([float(model_prob[t]) for t in tasks], dtype=np.float64)
        where = "training.model_prob"
    else:
        if nsystems is None:
            raise ConfigError("no model_prob and no system counts to weigh the tasks by",
                              path="training.model_prob")
        raw = np.array([float(nsystems[t]) for t in tasks], dtype=np.float64)
        where = "training.data_dict"
    bad = [t for t, w in zip(tasks, raw) if not (np.isfinite(w) and w >= 0)]
    if bad:
        raise ConfigError(f"the weight of task {bad[0]!r} must be a finite number >= 0",
                          path=f"{where}.{bad[0]}")
    if len(raw) == 0 or raw.sum() <= 0:
        raise ConfigError("the weights of the tasks sum to 0", path=where)
    return raw / raw.sum()


def epoch_steps(tasks: Sequence[str], num_epoch_dict: Mapping[str, float],
                batches_per_epoch: Mapping[str, int]) -> tuple[np.ndarray, int]:
    """DeePMD-kit's ``num_epoch_dict`` rule: (task probabilities, total steps).

    Task ``t`` is owed ``epochs[t] * batches_per_epoch[t]`` steps; the job runs the ceiling of
    their sum, and a task's probability is its share of that sum.
    """
    missing = [t for t in tasks if t not in num_epoch_dict]
    if missing:
        raise ConfigError(f"every task needs a number of epochs; missing: {', '.join(missing)}",
                          path="training.num_epoch_dict")
    owed = np.array([float(num_epoch_dict[t]) * float(batches_per_epoch[t]) for t in tasks])
    if not np.all(np.isfinite(owed)) or np.any(owed <= 0):
        raise ConfigError(f"epochs and batches per epoch must be positive, got {owed}",
                          path="training.num_epoch_dict")
    total = float(owed.sum())
    return owed / total, int(np.ceil(total))


def largest_remainder(probs: np.ndarray | Sequence[float], total: int) -> np.ndarray:
    """Whole counts summing to ``total``, each within 1 of ``probs * total`` (Hamilton's method).

    Ties in the remainders go to the earlier task, so the counts are a function of the inputs.
    """
    p = np.asarray(probs, dtype=np.float64)
    quota = p / p.sum() * int(total)
    counts = np.floor(quota).astype(np.int64)
    short = int(total) - int(counts.sum())
    if short > 0:
        order = np.lexsort((np.arange(len(p)), -(quota - counts)))
        counts[order[:short]] += 1
    return counts


def _generator(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


@dataclass(frozen=True)
class TaskSchedule:
    """Which task each step of each rank trains: pure, random access, reproducible.

    Parameters
    ----------
    seed
        The job seed (the same on every rank).
    probs
        The task probabilities, in the order of the tasks.
    window
        0 for independent draws; else the exact-count window in steps (the job's steps for
        ``num_epoch_dict``).
    same_task_across_ranks
        Every rank trains the same task at each step.
    """

    seed: int
    probs: tuple[float, ...]
    window: int = 0
    same_task_across_ranks: bool = False

    def __post_init__(self) -> None:
        weights_to_cdf(np.asarray(self.probs, dtype=np.float64))  # validates
        if self.window < 0:
            raise ConfigError(f"the exact-count window must be >= 0 steps, got {self.window}")

    @property
    def ntasks(self) -> int:
        return len(self.probs)

    def window_counts(self) -> np.ndarray:
        """How many steps of each task an exact-count window holds."""
        return largest_remainder(np.asarray(self.probs), self.window)

    def _key(self, draw_tag: int, shared_tag: int, rank: int, index: int) -> tuple[int, ...]:
        if self.same_task_across_ranks:
            return (shared_tag, index)
        return (draw_tag, int(rank), index)

    def _chunk(self, rank: int, chunk: int) -> np.ndarray:
        key = self._key(TAG_TASK_DRAW, TAG_TASK_SHARED, rank, chunk)
        u = _generator(int(self.seed) % SEED_MOD, *key).random(TASK_CHUNK)
        cdf = weights_to_cdf(np.asarray(self.probs, dtype=np.float64))
        return np.searchsorted(cdf, u, side="right").astype(np.int64)

    def _window(self, rank: int, index: int) -> np.ndarray:
        key = self._key(TAG_TASK_WINDOW, TAG_TASK_WINDOW_SHARED, rank, index)
        tasks = np.repeat(np.arange(self.ntasks, dtype=np.int64), self.window_counts())
        return _generator(int(self.seed) % SEED_MOD, *key).permutation(tasks)

    def tasks(self, rank: int, start: int, stop: int) -> np.ndarray:
        """Task indices of steps ``[start, stop)`` of ``rank``."""
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        size = self.window if self.window else TASK_CHUNK
        block = self._window if self.window else self._chunk
        first, last = start // size, (stop - 1) // size
        joined = np.concatenate([block(rank, b) for b in range(first, last + 1)])
        return joined[start - first * size:stop - first * size]

    def task(self, rank: int, step: int) -> int:
        """The task index of ``step`` of ``rank``."""
        return int(self.tasks(rank, step, step + 1)[0])

    def counts(self, rank: int, start: int, stop: int) -> np.ndarray:
        """How many of steps ``[start, stop)`` of ``rank`` train each task."""
        return np.bincount(self.tasks(rank, start, stop), minlength=self.ntasks)


class TaskCursor:
    """A schedule and the next step of one rank: the only state, one integer.

    ``choice`` has the signature of DeePMD-kit's ``dp_random.choice``, so the cursor stands in
    for that module in DeePMD-kit's training loop: each call is one step. ``current`` is the
    task of the step last drawn (``None`` before the first).
    """

    def __init__(self, schedule: TaskSchedule, rank: int, step: int = 0) -> None:
        self.schedule = schedule
        self.rank = int(rank)
        self.step = int(step)
        self.current: int | None = None

    def choice(self, a: object = None, size: object = None, replace: bool = True,
               p: object = None) -> int:
        """The task of the current step; the cursor moves to the next step."""
        task = self.schedule.task(self.rank, self.step)
        self.step += 1
        self.current = task
        return task

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.step = int(state["step"])
