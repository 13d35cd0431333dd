"""A DataLoader worker lives exactly as long as its rank: no shorter, no longer.

* **No longer.** A forked worker inherits every file descriptor of its rank, the sockets of
  the rank's gloo connections included. When the rank is killed outright (``kill -9``, the
  out-of-memory killer) its peers notice only once every copy of those sockets is closed, and
  torch's workers notice that their parent is gone only at their next status poll (every 5 s):
  the peers sat that long in their all-reduce. A worker therefore asks the kernel to kill it
  with its parent (Linux ``PR_SET_PDEATHSIG``).
* **No shorter.** ``torchrun`` sends its SIGTERM to each rank's whole process group, and Slurm
  to every process of a step: a worker must not die of it while its rank still needs it to
  finish a step and write a checkpoint, so it ignores SIGTERM and SIGUSR1.

:func:`bind_to_rank` does both, once per worker process, before the worker reads a batch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_bound_pid: int | None = None


def bind_to_rank() -> None:
    """In a DataLoader worker: die with the parent process, ignore stop signals (once)."""
    global _bound_pid
    pid = os.getpid()
    if _bound_pid == pid:
        return
    _bound_pid = pid
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    if sys.platform.startswith("linux") and _prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
        if os.getppid() != parent or parent == 1:  # the parent died before the request
            os._exit(1)


def _prctl(option: int, value: int) -> int:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0))
    except (OSError, AttributeError):
        return -1
