"""A DataLoader worker lives exactly as long as its rank needs it: no shorter, no longer.

* **No longer.** A forked worker inherits every file descriptor of its rank, the sockets of
  the rank's gloo connections included. When the rank is killed outright (``kill -9``, the
  out-of-memory killer) its peers notice only once every copy of those sockets is closed, and
  torch's workers notice that their parent is gone only at their next status poll (every 5 s):
  the peers sat that long in their all-reduce. A worker therefore asks the kernel to kill it
  with its parent (Linux ``PR_SET_PDEATHSIG``). And when the rank itself ends a worker -- its
  loader shuts down, or Python's exit terminates its daemonic children -- the worker's end comes
  as a SIGTERM *from its parent*, which it obeys at once (as torch's own handler does), so that
  a script that ends with a live iterator exits rather than waiting for workers that wait for it.
* **No shorter.** ``torchrun`` sends its SIGTERM to each rank's whole process group, and Slurm
  to every process of a step: a worker must not die of it while its rank still needs it to
  finish a step and write a checkpoint. A stop signal from anyone but the parent is ignored.
  So is Ctrl-C (SIGINT, which a terminal sends to the whole process group): it is the rank's to
  act on, and a worker dead of it would be reported as a lost worker instead of an interruption.

Telling the two apart needs the sender of the signal, which a Python handler never sees: the
worker blocks the stop signals and a thread of its own receives them with
:func:`signal.sigwaitinfo`, which says who sent each. :func:`bind_to_rank` does all of it, once
per worker process, before the worker reads a batch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_bound_pid: int | None = None


def bind_to_rank() -> None:
    """In a DataLoader worker: die with the parent process; end on the parent's SIGTERM; ignore
    stop signals from anyone else, and Ctrl-C (once per process)."""
    global _bound_pid
    pid = os.getpid()
    if _bound_pid == pid:
        return
    _bound_pid = pid
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "sigwaitinfo"):
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        threading.Thread(target=_obey_the_parent, args=(parent,), daemon=True,
                         name="mdloader-stop-signals").start()
    else:  # no sender to tell by (macOS): ignore them, the parent's too
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    if sys.platform.startswith("linux") and _prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
        if os.getppid() != parent or parent == 1:  # the parent died before the request
            os._exit(1)


def _obey_the_parent(parent: int) -> None:
    """Receive the blocked stop signals: the parent's SIGTERM ends the worker (quietly, as
    torch's handler: a zero exit is no failure to report), any other is dropped."""
    while True:
        info = signal.sigwaitinfo(set(STOP_SIGNALS))
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)


def _prctl(option: int, value: int) -> int:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0))
    except (OSError, AttributeError):
        return -1
