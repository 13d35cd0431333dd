"""Keep a forked DataLoader worker from copying the heap it inherits.

A forked worker shares its parent's pages until either side writes one. Three writers turned
shared pages into private copies (``benchmarks/throughput/worker_memory.py``, figures in
``docs/benchmarks.md``):

* the worker's cyclic garbage collector, which writes the header of every object it visits:
  :func:`settle_worker` moves the inherited objects out of its reach (:func:`gc.freeze`) once
  per worker, before its first batch;
* a collection in the worker before that first batch: the parent freezes its heap for the
  moment of each fork (:func:`share_heap_with_forks`), so a worker starts with it frozen; the
  parent unfreezes at once and keeps collecting its own cycles (a full collection there while
  workers live still copies the pages it visits);
* an import in the worker, which writes across the inherited heap: the modules the read path
  imports at its first call (:data:`READ_PATH_IMPORTS`) are imported in the parent instead.
"""

from __future__ import annotations

import gc
import importlib
import os

#: Modules the read path imports lazily, at its first call: ``numpy.ma`` (``np.unique`` imports
#: it at its first call, numpy 2) and ``resource`` (the open-file limit of the map cache).
READ_PATH_IMPORTS = ("numpy.ma", "resource")

_settled_pid: int | None = None
_hooked = False


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


def share_heap_with_forks() -> None:
    """In the process that will fork the workers (once per process): import
    :data:`READ_PATH_IMPORTS` now, and freeze the heap for the moment of every fork.

    The child starts with the inherited objects frozen, so its collector never writes to their
    pages; the parent unfreezes right after the fork, so its own collector keeps visiting them
    and no reference cycle is kept alive for good.
    """
    global _hooked
    if _hooked:
        return
    for name in READ_PATH_IMPORTS:
        importlib.import_module(name)
    os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)
    _hooked = True
