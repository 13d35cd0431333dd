"""What DeePMD-kit's training loop does not check, checked where mdloader hands it each batch.

DeePMD-kit 3.2's PyTorch loop has no stop-signal handler (SIGTERM or SIGUSR1 killed its ranks
at once, the steps since the last ``save_freq`` checkpoint lost) and checks neither the labels
nor the loss for NaN (a NaN label trains on, NaN weights included). :func:`guarded_get_data`
wraps ``Trainer.get_data``, which every rank calls once per training step:

* **Stop signals.** While :func:`stop_signals` is active a signal before the first training
  step ends the rank at once (:class:`~mdloader.errors.StopRequested`: nothing to save); during
  training it only sets a flag. Every ``$MDLOADER_STOP_CHECK_STEPS`` steps the ranks agree on the
  flag (one tiny all-reduce, as ``mdloader train``); when it is set, every rank stops before the
  same step, rank 0 writes the checkpoint of the last step done, with its loader state, and
  every rank ends with one line (:class:`StoppedAfterStep`, exit 143).
* **Non-finite data.** A training batch whose inputs or labels hold NaN/inf is a
  :class:`~mdloader.errors.NonFiniteError` naming the step, the frames, the system and the file;
  the rank fails alone and every rank prints that line (:mod:`.failures`). The check runs on the
  CPU as the batch leaves the DataLoader (:class:`CheckedBatches`), before DeePMD-kit moves it
  to the device.
"""

from __future__ import annotations

import functools
import signal
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch

from mdloader.data.formats import diagnostics
from mdloader.distributed.collectives import any_rank
from mdloader.errors import NonFiniteError, StopRequested
from mdloader.integrations.deepmd.training import is_display_draw
from mdloader.settings import resolve

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: list[str] = []
_training = False  # the first training batch was taken: a signal only sets the flag
_fetched: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


class StoppedAfterStep(StopRequested):
    """Every rank stopped after the same step on a stop signal; the checkpoint to continue from."""

    def __init__(self, signal_name: str, step: int, checkpoint: str) -> None:
        self.signal_name = signal_name
        BaseException.__init__(self, f"{signal_name} after step {step}: checkpoint "
                               f"{checkpoint} written with its loader state; continue with "
                               f"--restart {checkpoint}")


@contextmanager
def stop_signals() -> Iterator[None]:
    """Within, SIGTERM and SIGUSR1 stop the run: at once before the first training step, at
    the next agreed step boundary after it (:func:`guarded_get_data`). Outside the main thread
    (where Python cannot install handlers) it does nothing."""
    global _training
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    _training = False
    previous = {sig: signal.signal(sig, _note) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _note(signum: int, frame: FrameType | None) -> None:
    _received.append(signal.Signals(signum).name)
    if not _training:
        raise StopRequested(_received[-1])


def guarded_get_data(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer.get_data`` that stops on an agreed stop signal before it takes the next
    training batch, and refuses a training batch with NaN/inf inputs or labels (a display draw,
    which trains nothing, is neither a step nor checked)."""

    @functools.wraps(original)
    def get_data(self: Any, is_train: bool = True, task_key: str = "Default") -> Any:
        if not is_train or is_display_draw(self, is_train, task_key):
            return original(self, is_train, task_key)
        global _training
        _training = True
        taken = _fetched.get(self, 0)
        step = int(self.start_step) + taken  # the index of the step this batch is for
        if taken and taken % int(resolve("stop_check_steps")) == 0:
            if any_rank([bool(_received)], activity=f"DeePMD-kit's training step {step}")[0]:
                _stop(self, step, _received[0] if _received else "a stop signal on another rank")
        checked = _checked_batches(self, task_key)
        if checked is not None:
            checked.step = step
        result = original(self, is_train, task_key)
        if result[0]:
            _fetched[self] = taken + 1
        return result

    return get_data


class CheckedBatches:
    """A task's training batches, each checked for NaN/inf as DeePMD-kit's ``get_data`` takes it
    from the DataLoader: on the CPU, before it moves the batch to the device (a check on the
    device would cost a device-to-host synchronisation per step)."""

    def __init__(self, batches: Iterator[Any], trainer: Any, task_key: str) -> None:
        self.batches, self.step = batches, 0
        self.trainer, self.task_key = weakref.proxy(trainer), task_key

    def __iter__(self) -> CheckedBatches:
        return self

    def __next__(self) -> Any:
        batch = next(self.batches)
        problem = nonfinite_batch(self.trainer, self.task_key, batch, self.step)
        if problem is not None:
            raise problem
        return batch


def _checked_batches(trainer: Any, task_key: str) -> CheckedBatches | None:
    """The trainer's training iterator of ``task_key``, wrapped once in :class:`CheckedBatches`
    (``None`` where the trainer has none)."""
    holder = trainer.training_data
    key = task_key if isinstance(holder, dict) else None
    batches = holder.get(key) if key is not None else holder
    if batches is None or isinstance(batches, CheckedBatches):
        return batches
    checked = CheckedBatches(batches, trainer, task_key)
    if key is not None:
        holder[key] = checked
    else:
        trainer.training_data = checked
    return checked


def _stop(trainer: Any, step: int, signal_name: str) -> None:
    """Save the checkpoint of step ``step - 1`` (the last one done) as DeePMD-kit's loop saves
    one, then raise :class:`StoppedAfterStep`; every rank calls it at the same step."""
    done = step - 1
    trainer.nonfinite_grad_guard.raise_if_nonfinite(trainer.wrapper.named_parameters)
    path = trainer.ckpt_store.path_for(step)
    if trainer.rank == 0:
        trainer.latest_model = path
        trainer.save_model(path, lr=trainer.lr_schedule.value(done), step=done)
        trainer.ckpt_store.publish(path)
    name = signal_name if signal_name in ("SIGTERM", "SIGUSR1") else "SIGTERM"
    raise StoppedAfterStep(name, step, str(path))


def nonfinite_batch(trainer: Any, task_key: str, batch: Mapping[str, Any],
                    step: int) -> NonFiniteError | None:
    """The first floating-point array of a training batch (as the DataLoader gives it, on the
    CPU) that holds NaN/inf, as an error naming the frames, the system and the file; ``None``
    for a finite batch."""
    fids = [int(f) for f in batch.get("fid", [])]
    for key, value in batch.items():
        if key.startswith("find_") or not torch.is_tensor(value) \
                or not value.is_floating_point() or value.device.type != "cpu":
            continue
        ok = torch.isfinite(value.reshape(value.shape[0], -1)).all(dim=1)
        if bool(ok.all()):
            continue
        bad = [fid for fid, fine in zip(fids, ok.tolist()) if not fine]
        system = _system(trainer, task_key, int(batch["sid"]))
        file = diagnostics.frame_file(system.meta, key, bad[0]) if bad and system else None
        return NonFiniteError(
            f"{key} holds NaN/inf in frames {bad} of the batch of training step {step} "
            "(DeePMD-kit's loop would train on it)",
            system=system.system if system is not None else None, file=file,
            found=f"batch frames {fids}")
    return None


def _system(trainer: Any, task_key: str, sid: int) -> Any:
    """The dataset of system ``sid`` in the training loader of ``task_key``."""
    loaders = trainer.training_dataloader
    loader = loaders[task_key] if isinstance(loaders, dict) else loaders
    systems = getattr(getattr(loader, "dataset", None), "systems", None)
    return systems[sid] if systems is not None else None
