"""One bounded, fork-aware cache of open handles (npy descriptors, HDF5 files and datasets,
LMDB environments).

Every open file holds a file descriptor, so each process keeps a bounded number, closing the
least recently used first. A forked DataLoader worker inherits its parent's handles but must not
use them (HDF5 and LMDB handles are not fork-safe; an inherited descriptor would be shared), so
the cache empties itself the first time it is used under a new process id. npy descriptors and
LMDB need more: the inherited copies hold descriptors of the child (and python-lmdb refuses a
second open of a path its process already holds), so their caches close them
(``close_inherited``), which only releases the child's own descriptors and mapping.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

H = TypeVar("H")

_opened = [os.getpid(), 0]  # this process's pid, and the handles it opened through any cache


def opened() -> int:
    """How many handles this process opened through any cache (a forked worker counts from 0):
    the files the data trees were opened for, which the stall report counts."""
    if _opened[0] != os.getpid():
        _opened[:] = [os.getpid(), 0]
    return _opened[1]


class HandleCache(Generic[H]):
    """Handles by key, at most ``limit()`` of them in this process.

    Parameters
    ----------
    limit
        Called on every insertion, so a changed setting takes effect at once.
    close
        Releases an evicted handle (``None``: dropping the reference is enough).
    valid
        Tells whether a cached handle can still be used (closed elsewhere: reopen it).
    close_inherited
        After a fork, close the parent's handles in the child instead of only forgetting them.
    counted
        Whether an open counts in :func:`opened` (a file; not an object inside an open file).
    """

    def __init__(self, limit: Callable[[], int], close: Callable[[H], Any] | None = None,
                 valid: Callable[[H], bool] | None = None, *,
                 close_inherited: bool = False, counted: bool = True) -> None:
        self._limit, self._close, self._valid = limit, close, valid
        self._close_inherited, self._counted = close_inherited, counted
        self._handles: OrderedDict[str, H] = OrderedDict()
        self._pid = os.getpid()

    def get(self, key: str, open_handle: Callable[[], H]) -> H:
        """The cached handle of ``key``, else ``open_handle()`` cached (may evict the oldest)."""
        self._check_pid()
        handle = self._handles.get(key)
        if handle is not None and (self._valid is None or self._valid(handle)):
            self._handles.move_to_end(key)
            return handle
        handle = open_handle()
        if self._counted:
            opened()  # resets the count in a new process
            _opened[1] += 1
        self._handles.pop(key, None)  # an invalid handle is closed already; the new one is newest
        self._handles[key] = handle
        while len(self._handles) > max(1, self._limit()):
            self._release(self._handles.popitem(last=False)[1])
        return handle

    def peek(self, key: str) -> H | None:
        """The cached handle of ``key`` if this process holds one; never opens."""
        self._check_pid()
        return self._handles.get(key)

    def discard(self, key: str) -> None:
        """Close and forget ``key``'s handle (after a read error, so the next read reopens)."""
        self._check_pid()
        handle = self._handles.pop(key, None)
        if handle is not None:
            self._release(handle)

    def clear(self) -> None:
        self._check_pid()
        while self._handles:
            self._release(self._handles.popitem(last=False)[1])

    def __len__(self) -> int:
        return len(self._handles) if self._pid == os.getpid() else 0

    def values(self) -> list[H]:
        """The handles this process holds, oldest use first."""
        self._check_pid()
        return list(self._handles.values())

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # inherited from the parent: never use them
            inherited, self._handles = self._handles, OrderedDict()
            self._pid = os.getpid()
            while self._close_inherited and inherited:
                self._release(inherited.popitem(last=False)[1])

    def _release(self, handle: H) -> None:
        if self._close is not None:
            self._close(handle)
