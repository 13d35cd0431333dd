"""What DeePMD-kit's training loop does not check, checked at each step and on each batch.

DeePMD-kit 3.2's PyTorch loop has no stop-signal handler (SIGTERM or SIGUSR1 killed its ranks
at once, the steps since the last ``save_freq`` checkpoint lost) and checks neither the labels
nor the loss for NaN (a NaN label trains on, NaN weights included). The trainer's feed counts
the steps (:meth:`~mdloader.loading.feed.Feed.training_step`); here are what its hooks call:

* **Stop signals.** While :func:`stop_signals` is active a signal before the first training
  step ends the rank at once (:class:`~mdloader.errors.StopRequested`: nothing to save); during
  training it only sets a flag. Every ``$MDLOADER_STOP_CHECK_STEPS`` steps the ranks agree on the
  flag (one tiny all-reduce, as ``mdloader train``: :func:`stop_if_signalled`); when it is set,
  every rank stops before the same step, rank 0 writes the checkpoint of the last step done,
  with its loader state, and every rank ends with one line (:class:`StoppedAfterStep`, exit
  143).
  A full validation pass (:mod:`.full_validation`) is cut by a signal on any rank, and every
  rank stops there in the same way, after the step it followed.
* **Non-finite data.** A training batch whose inputs or labels hold NaN/inf is a
  :class:`~mdloader.errors.NonFiniteError` naming the step, the frames, the system and the file;
  the rank fails alone and every rank prints that line (:mod:`.failures`). The check is a check
  of the training streams (:class:`NonFiniteBatches`): it runs on the CPU as the batch leaves the
  pool, before DeePMD-kit moves it to the device.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import Any

import numpy as np
import torch

from mdloader.data.formats import diagnostics
from mdloader.distributed.collectives import any_rank
from mdloader.errors import NonFiniteError, StopRequested
from mdloader.loading.feed import Feed, Stream
from mdloader.settings import resolve

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: list[str] = []
_training = False  # the first training step started: a signal only sets the flag


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
    the next agreed step boundary after it (:func:`stop_if_signalled`). Outside the main thread
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


def stop_if_signalled(trainer: Any, feed: Feed, step: int) -> None:
    """Before the training batch of ``step``: every ``$MDLOADER_STOP_CHECK_STEPS`` steps of
    this run the ranks agree on a stop signal; when one came, save the checkpoint of the last
    step done and raise :class:`StoppedAfterStep` (every rank, at the same step)."""
    global _training
    _training = True
    taken = step - feed.start_step
    if taken and taken % int(resolve("stop_check_steps")) == 0:
        if any_rank([bool(_received)], activity=f"DeePMD-kit's training step {step}")[0]:
            stop_now(trainer, step, _received[0] if _received else "a stop signal on another rank")


def pending_signal() -> str | None:
    """The stop signal this rank received during training, if any (not yet agreed on)."""
    return _received[0] if _received and _training else None


def stop_now(trainer: Any, step: int, signal_name: str) -> None:
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


class NonFiniteBatches:
    """The check of a feed's training streams: a batch whose floating-point inputs or labels
    hold NaN/inf (as the pool gives it, on the CPU) is refused with an error naming the step,
    the frames, the system and the file."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    def __call__(self, stream: Stream, batch: Mapping[str, Any]) -> None:
        problem = nonfinite_batch(stream, batch, self.feed.step)
        if problem is not None:
            raise problem


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def nonfinite_batch(stream: Stream, batch: Mapping[str, Any],
                    step: int) -> NonFiniteError | None:
    """The first floating-point array of a training batch that holds NaN/inf, as an error
    naming the frames, the system and the file; ``None`` for a finite batch.

    Runs on the trainer's thread for every batch: a finite array costs one numpy pass; the
    frames are looked for only in an array that is not finite.
    """
    for key, value in batch.items():
        if key.startswith("find_") or not torch.is_tensor(value) \
                or not value.is_floating_point() or value.device.type != "cpu":
            continue
        if value.dtype in _NUMPY_FLOATS and not value.requires_grad:
            if np.isfinite(value.numpy()).all():
                continue
        elif bool(torch.isfinite(value).all()):
            continue
        ok = torch.isfinite(value.reshape(value.shape[0], -1)).all(dim=1)
        fids = [int(f) for f in batch.get("fid", [])]
        bad = [fid for fid, fine in zip(fids, ok.tolist()) if not fine]
        if not hasattr(stream.dataset, "systems"):  # a mix:N batch: frames of one database
            return NonFiniteError(
                f"{key} holds NaN/inf in frames {bad} of the batch of training step {step} "
                "(DeePMD-kit's loop would train on it)",
                system=stream.dataset.reader.lmdb_path, found=f"batch frames {fids}")
        system = stream.dataset.systems[int(batch["sid"])]
        file = diagnostics.frame_file(system.meta, key, bad[0]) if bad else None
        return NonFiniteError(
            f"{key} holds NaN/inf in frames {bad} of the batch of training step {step} "
            "(DeePMD-kit's loop would train on it)",
            system=system.system, file=file, found=f"batch frames {fids}")
    return None
