"""Stopping the reference job on a signal at the next step boundary, with a checkpoint.

Slurm sends SIGTERM at the time limit (and, with ``--signal``, a signal of your choice some time
before it); ``torchrun`` passes SIGTERM on to the ranks. While :class:`StopSignals` is active, a
SIGTERM or SIGUSR1 only sets a flag. The training loop reads it, the ranks agree on it in their
stop-flag exchange (so that every rank stops after the same step), write one checkpoint, and the
command line exits with :data:`EXIT_STOPPED`.

``mdloader train`` keeps the handlers active for its whole run, not only the training loop: as
soon as one rank exits, ``torchrun`` sends SIGTERM to the others, which may still be writing
their line or tearing the group down; they must finish that, not die half-way. A signal that
comes before the first step stops the job before it trains: while the job builds, checks and
computes its statistics (:func:`stop_at_once`) a signal raises
:class:`~mdloader.errors.StopRequested` at once, since there is nothing to save yet, and the
rank exits with :data:`EXIT_STOPPED` instead of finishing a phase that may take minutes (or wait
for a peer that is gone) while the launcher's 30 s before SIGKILL run out.

DataLoader workers must outlive the signal until the main process has written its checkpoint:
``torchrun`` sends it to each rank's whole process group and Slurm to every process of a step,
and torch's workers die on SIGTERM. The training loader's workers therefore ignore both signals
(:func:`ignore_stop_signals`, their ``worker_init_fn``); they end with their rank, as always.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

from mdloader.errors import StopRequested

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_STOPPED = 128 + signal.SIGTERM
"""Exit code of a run stopped by a signal after its checkpoint (143, what a shell reports for a
process ended by SIGTERM): a job script requeues on it."""

_received: list[str] = []  # the stop signals received while handlers were active, in order
_depth = 0  # how many StopSignals are active (they nest: the command line's and the loop's)
_at_once = False  # within stop_at_once: the next stop signal raises StopRequested


class StopSignals:
    """Within ``with``, SIGTERM and SIGUSR1 set :attr:`received` instead of ending the process.

    Nested blocks share what was received; the outermost one starts with nothing received.
    With ``at_once`` a signal raises :class:`~mdloader.errors.StopRequested` until the first
    :func:`stop_at_once` block ends: the command line's, whose job has nothing to save before
    then (a signal while torch is imported would otherwise wait for the next phase, seconds
    later). Outside the main thread (where Python cannot install handlers) it does nothing.
    """

    def __init__(self, *, at_once: bool = False) -> None:
        self._previous: dict[int, Any] = {}
        self._at_once = at_once

    def __enter__(self) -> StopSignals:
        global _depth, _at_once
        if threading.current_thread() is threading.main_thread():
            if _depth == 0:
                _received.clear()
                _at_once = self._at_once
            _depth += 1
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, _note)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        global _depth, _at_once
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous:
            _depth -= 1
            if _depth == 0:
                _at_once = False
        self._previous.clear()

    @property
    def received(self) -> str | None:
        """The name of the first stop signal received (``None``: none yet)."""
        return _received[0] if _received else None

    @property
    def requested(self) -> bool:
        return bool(_received)


@contextmanager
def stop_at_once() -> Iterator[None]:
    """Within, a stop signal raises :class:`~mdloader.errors.StopRequested` in the main thread
    (once) instead of setting the flag: for phases with nothing to save. A signal received
    before entering (within the same :class:`StopSignals`) raises on entry."""
    global _at_once
    if _depth and _received:  # outside StopSignals, what an earlier run received is history
        raise StopRequested(_received[0])
    _at_once = True
    try:
        yield
    finally:
        _at_once = False


def _note(signum: int, frame: FrameType | None) -> None:
    global _at_once
    _received.append(signal.Signals(signum).name)
    if _at_once:
        _at_once = False
        raise StopRequested(_received[-1])


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` of the training loader: its workers ignore SIGTERM and SIGUSR1."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
