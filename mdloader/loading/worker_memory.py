"""Keep a forked DataLoader worker from copying the heap it inherits.

A forked worker shares its parent's pages until it writes one. CPython's cyclic garbage
collector writes the header of every object it visits, so the first full collection in a worker
would copy every page of the inherited heap (the system table, the plan, the imported modules).
:func:`settle_worker` moves the inherited objects out of the collector's reach
(:func:`gc.freeze`) once per worker process, before it reads its first batch; objects the worker
makes afterwards are collected as usual.
"""

from __future__ import annotations

import gc
import os

_settled_pid: int | None = None


def settle_worker() -> None:
    """Freeze the inherited heap of this worker process, once (cheap on later calls).

    The frozen objects are the parent's: the worker never frees their cycles, which are still
    the parent's to collect, and a worker lives no longer than one pass of its loader.
    """
    global _settled_pid
    pid = os.getpid()
    if _settled_pid != pid:
        gc.freeze()
        _settled_pid = pid
