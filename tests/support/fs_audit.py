"""Counting one process's file-system touches under a folder: the tests' audit of how often the
build and the loader reach the data tree (ranks other than 0 must not).

Audits may overlap and stop in any order: one audit hook and one wrapper per wrapped function
(installed by the first open audit, the original functions kept here) consult the open audits;
the originals are put back when the last audit stops.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

_LISTING_EVENTS = {"os.listdir", "os.scandir", "os.walk", "glob.glob"}


class _Audit:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.counts = {"open": 0, "list": 0, "stat": 0, "h5open": 0}

    def under(self, path: Any) -> bool:
        if isinstance(path, (str, bytes, os.PathLike)):
            p = os.path.abspath(os.fsdecode(path))
            return p == self.root or p.startswith(self.root.rstrip(os.sep) + os.sep)
        return False


_ACTIVE: list[_Audit] = []
# (module, name) -> (original, wrapper) while wrapped
_WRAPPED: dict[tuple[Any, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}
_HOOKED = [False]


def _count(path: Any, key: str) -> None:
    for audit in _ACTIVE:
        if audit.under(path):
            audit.counts[key] += 1


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not _ACTIVE or not args:
        return
    if event == "open":
        _count(args[0], "open")
    elif event in _LISTING_EVENTS:
        _count(args[0], "list")


def _targets() -> list[tuple[Any, str, str]]:
    import h5py.h5f

    # every HDF5 open reaches h5f.open: h5py.File's and mdloader's own (its access settings)
    return [(os, "stat", "stat"), (os, "lstat", "stat"), (h5py.h5f, "open", "h5open")]


def _wrap_all() -> None:
    for module, name, key in _targets():
        original = getattr(module, name)

        def counted(path: Any, *a: Any, _original: Any = original, _key: str = key,
                    **k: Any) -> Any:
            _count(path, _key)
            return _original(path, *a, **k)

        setattr(module, name, counted)
        _WRAPPED[(module, name)] = (original, counted)


def _unwrap_all() -> None:
    for (module, name), (original, counted) in list(_WRAPPED.items()):
        if getattr(module, name) is counted:  # not re-wrapped by someone else since
            setattr(module, name, original)
        del _WRAPPED[(module, name)]


def count_data_touches(root: str) -> tuple[dict[str, int], Callable[[], None]]:
    """Count this process's opens/listings/stats of paths under ``root``; returns (counts, stop).

    An audit hook sees ``open`` and directory listings; ``os.stat``/``os.lstat`` (no audit
    event) and HDF5 opens (done in C) are counted by wrapping them. ``stop`` may be called in
    any order relative to other audits' (and more than once).
    """
    if not _HOOKED[0]:  # an audit hook cannot be removed: one for the process, idle when unused
        sys.addaudithook(_hook)
        _HOOKED[0] = True
    audit = _Audit(root)
    if not _ACTIVE:
        _wrap_all()
    _ACTIVE.append(audit)

    def stop() -> None:
        if audit in _ACTIVE:
            _ACTIVE.remove(audit)
            if not _ACTIVE:
                _unwrap_all()

    return audit.counts, stop
