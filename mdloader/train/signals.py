"""Stopping the reference job on a signal at the next step boundary, with a checkpoint.

Slurm sends SIGTERM at the time limit (and, with ``--signal``, a signal of your choice some time
before it); ``torchrun`` passes SIGTERM on to the ranks. While :class:`StopSignals` is active, a
SIGTERM or SIGUSR1 only sets a flag. The training loop reads it at each step, the ranks agree on
it in the step's flag exchange (so that every rank stops after the same step), write one
checkpoint, and the command line exits with :data:`EXIT_STOPPED`.

DataLoader workers must outlive the signal until the main process has written its checkpoint:
``torchrun`` sends it to each rank's whole process group and Slurm to every process of a step,
and torch's workers die on SIGTERM. The training loader's workers therefore ignore both signals
(:func:`ignore_stop_signals`, their ``worker_init_fn``); they end with their rank, as always.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_STOPPED = 128 + signal.SIGTERM
"""Exit code of a run stopped by a signal after its checkpoint (143, what a shell reports for a
process ended by SIGTERM): a job script requeues on it."""


class StopSignals:
    """Within ``with``, SIGTERM and SIGUSR1 set :attr:`received` instead of ending the process.

    Outside the main thread (where Python cannot install handlers) it does nothing.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` of the training loader: its workers ignore SIGTERM and SIGUSR1."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
