"""Exact resume under DeePMD-kit's trainer: the loader state saved beside every checkpoint.

DeePMD-kit's checkpoint holds the model, the optimizer and the index of the step just done, but
not where its data streams are, so a ``--restart`` replays the data from the start. mdloader
counts the batches the trainer *consumed* from every stream (a wrap of ``Trainer.get_data``:
DataLoader workers prefetch, so the samplers' own positions run ahead), gathers every rank's
sampler states to rank 0 at each checkpoint and writes them merged beside the checkpoint
(``model.ckpt-100.pt`` -> ``model.ckpt-100.pt.mdloader``, atomically). At ``--restart`` every
stream is sought to its consumed count before the trainer's iterators start, on any number of
ranks (a merged state resumes elastically), and the step DeePMD-kit would run twice (it restarts
its loop at the saved step index) is skipped, so the run continues with the batches an
uninterrupted run would have drawn. The streams are the training and validation streams of
every task and the display streams of a multi-task job
(:class:`~mdloader.integrations.deepmd.training.DisplayStream`); the state also holds the task
schedule's seed (an unseeded job's is rank 0's random one).
"""

from __future__ import annotations

import functools
import glob
import inspect
import json
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

from mdloader.distributed.collectives import gather_to_main
from mdloader.distributed.group import current_world
from mdloader.errors import StateDictError
from mdloader.integrations.deepmd.training import (
    display_streams,
    is_display_draw,
    recorded_schedule_seed,
    restore_schedule_seed,
)
from mdloader.persist import write_atomic
from mdloader.sampling.elastic import merge_rank_states
from mdloader.sampling.samplers import WeightedSystemSampler

log = logging.getLogger(__name__)

#: The suffix of a loader-state file: ``<checkpoint><SUFFIX>``.
SUFFIX = ".mdloader"
STATE_FORMAT = "mdloader-deepmd-loader-state"
STATE_VERSION = 1


def state_path(checkpoint: str | os.PathLike[str]) -> str:
    """The loader-state file of ``checkpoint`` (a link, ``model.ckpt.pt``, is resolved first)."""
    return os.path.realpath(os.fspath(checkpoint)) + SUFFIX


def stream_name(role: str, task: str | None) -> str:
    """``training``, ``validation`` or ``display``, then ``.<task>`` for a multi-task head."""
    return role if task is None else f"{role}.{task}"


def trainer_streams(trainer: Any) -> dict[str, WeightedSystemSampler]:
    """Every data stream of ``trainer`` drawn by an mdloader sampler, by :func:`stream_name`."""
    streams: dict[str, WeightedSystemSampler] = {}
    for role, loaders in (("training", getattr(trainer, "training_dataloader", None)),
                          ("validation", getattr(trainer, "validation_dataloader", None))):
        items = loaders.items() if isinstance(loaders, dict) else [(None, loaders)]
        for task, loader in items:
            sampler = getattr(loader, "sampler", None)
            if isinstance(sampler, WeightedSystemSampler):
                streams[stream_name(role, task)] = sampler
    for task, display in display_streams(trainer).items():
        streams[stream_name("display", task)] = display.sampler
    return streams


class ConsumedBatches:
    """Where each stream of one running trainer is: its position at the start of ``run`` plus
    the batches ``get_data`` handed out since; the merged job state of the last gather."""

    def __init__(self, streams: dict[str, WeightedSystemSampler]) -> None:
        self.streams = streams
        self.base = {name: sampler.position for name, sampler in streams.items()}
        self.taken = dict.fromkeys(streams, 0)
        self.gathered: dict[str, Any] | None = None

    def took(self, name: str) -> None:
        if name in self.taken:
            self.taken[name] += 1
        self.gathered = None  # a gathered state is for the save of the step it was taken at

    def rank_states(self) -> dict[str, Any]:
        """The sampler states of this rank at the consumed counts."""
        return {name: sampler.state_dict(consumed=self.base[name] + self.taken[name])
                for name, sampler in self.streams.items()}

    def gather(self) -> dict[str, Any] | None:
        """Every rank's states merged, on rank 0 (``None`` elsewhere); a collective."""
        states = gather_to_main(self.rank_states(), context="gathering the loader states")
        if states is None:
            return None
        return {name: merge_rank_states([s[name] for s in states]) for name in self.streams}


_RUNNING: weakref.WeakKeyDictionary[Any, ConsumedBatches] = weakref.WeakKeyDictionary()
_RESUME_FROM: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def counting_get_data(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer.get_data`` that counts the batch it takes from its stream."""

    @functools.wraps(original)
    def get_data(self: Any, is_train: bool = True, task_key: str = "Default") -> Any:
        result = original(self, is_train, task_key)
        tracker = _RUNNING.get(self)
        if tracker is not None:
            role = ("display" if is_display_draw(self, is_train, task_key) else
                    "training" if is_train else "validation")
            tracker.took(stream_name(role, task_key if self.multi_task else None))
        return result

    return get_data


def recording_trainer_init(original: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.__init__`` that keeps the ``--restart`` checkpoint (``--init-model`` and
    ``--finetune`` start fresh streams)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments
        if given.get("restart_model") is not None and given.get("init_model") is None:
            _RESUME_FROM[self] = given["restart_model"]

    return __init__


class GatheringGuard:
    """DeePMD-kit's non-finite gradient guard; its check, which every rank runs before a
    checkpoint is saved, also gathers the loader states to rank 0 (the one collective)."""

    def __init__(self, real: Any, tracker: ConsumedBatches) -> None:
        self._real = real
        self._tracker = tracker

    def raise_if_nonfinite(self, *args: Any, **kwargs: Any) -> Any:
        result = self._real.raise_if_nonfinite(*args, **kwargs)
        self._tracker.gathered = self._tracker.gather()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def load_state(trainer: Any, checkpoint: str, streams: dict[str, WeightedSystemSampler]) -> None:
    """Seek every stream to the state saved beside ``checkpoint`` and skip the repeated step;
    warn once when there is none."""
    path = state_path(checkpoint)
    if not os.path.exists(path):
        if trainer.rank == 0:
            log.warning("%s has no mdloader loader state beside it (%s; written by plain dp?): "
                        "the data streams start over from their first batch", checkpoint, path)
        return
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:
        raise StateDictError(f"cannot read the loader state {path}: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise StateDictError(f"{path} is not an mdloader loader state")
    if state.get("version") != STATE_VERSION:
        raise StateDictError(f"{path} has version {state.get('version')}, this mdloader reads "
                             f"version {STATE_VERSION}")
    if int(state["step"]) != int(trainer.start_step):
        raise StateDictError(f"{path} is the loader state of step {state['step']} but "
                             f"{checkpoint} restarts at step {trainer.start_step}: they are "
                             "not one checkpoint's")
    saved = state["streams"]
    fresh = sorted(n for n in streams if n.startswith("display.") and n not in saved)
    missing = sorted(set(streams) - set(saved) - set(fresh))
    if missing:
        raise StateDictError(f"{path} has no state for the stream(s) {', '.join(missing)} "
                             f"(it has {', '.join(sorted(saved)) or 'none'}): the input's "
                             "tasks or validation data changed since the checkpoint")
    if state.get("schedule_seed") is not None and getattr(trainer, "multi_task", False):
        restore_schedule_seed(trainer, int(state["schedule_seed"]))  # checked before any load
    for name, sampler in streams.items():
        if name in saved:
            sampler.load_state_dict(saved[name])
    if fresh:  # a state of an mdloader without display streams: only log lines differ
        log.info("the loader state has no display stream for %s: they start over",
                 ", ".join(fresh))
    trainer.start_step += 1  # the checkpoint's own step is done: it is not run again
    scheduler = getattr(trainer, "scheduler", None)  # Adam-type optimizers have one
    if scheduler is not None:
        scheduler.step()
    if trainer.rank == 0:
        log.info("restored the loader state of %s: %d stream(s), continuing at step %d",
                 checkpoint, len(streams), trainer.start_step)


def resuming_trainer_run(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``Trainer.run`` whose streams continue from the restart checkpoint's loader state and
    are counted for the checkpoints it saves."""

    @functools.wraps(original)
    def run(self: Any) -> None:
        streams = trainer_streams(self)
        checkpoint = _RESUME_FROM.get(self)
        if checkpoint is not None:
            load_state(self, checkpoint, streams)
        tracker = ConsumedBatches(streams)
        _RUNNING[self] = tracker
        guard = self.nonfinite_grad_guard
        self.nonfinite_grad_guard = GatheringGuard(guard, tracker)
        try:
            return original(self)
        finally:
            self.nonfinite_grad_guard = guard
            _RUNNING.pop(self, None)

    return run


def _prune(folder: str) -> None:
    """Remove the loader states whose checkpoint DeePMD-kit's retention removed."""
    for path in glob.glob(os.path.join(glob.escape(folder), f"*{SUFFIX}")):
        if not os.path.exists(path[:-len(SUFFIX)]):
            os.remove(path)


def saving_loader_state(original: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.save_model`` that writes the loader state beside the checkpoint (rank 0)."""

    @functools.wraps(original)
    def save_model(self: Any, save_path: Any, lr: float = 0.0, step: int = 0,
                   **kwargs: Any) -> None:
        original(self, save_path, lr, step, **kwargs)
        tracker = _RUNNING.get(self)
        if tracker is None or self.rank != 0:
            return
        streams = tracker.gathered
        if streams is None and not current_world().distributed:
            streams = tracker.gather()
        if streams is None:  # a save no rank but 0 takes part in: its state cannot be gathered
            log.debug("no loader state for %s: not every rank took part in this save",
                      save_path)
            return
        state = {"format": STATE_FORMAT, "version": STATE_VERSION, "step": int(step),
                 "world_size": current_world().world_size, "streams": streams,
                 "schedule_seed": recorded_schedule_seed(self)}
        target = state_path(save_path)
        write_atomic(target, json.dumps(state).encode("utf-8"))
        _prune(os.path.dirname(target))

    return save_model
