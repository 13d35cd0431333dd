"""Counting one process's file-system touches under a folder: the tests' audit of how often the
build and the loader reach the data tree (ranks other than 0 must not)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

_LISTING_EVENTS = {"os.listdir", "os.scandir", "os.walk", "glob.glob"}


def count_data_touches(root: str) -> tuple[dict[str, int], Callable[[], None]]:
    """Count this process's opens/listings/stats of paths under ``root``; returns (counts, stop).

    An audit hook sees ``open`` and directory listings; ``os.stat``/``os.lstat`` (no audit
    event) and HDF5 opens (done in C) are counted by wrapping them.
    """
    import h5py._hl.files as h5files

    root = os.path.abspath(root)
    counts = {"open": 0, "list": 0, "stat": 0, "h5open": 0}
    active = [True]

    def under(path: Any) -> bool:
        if isinstance(path, (str, bytes, os.PathLike)):
            return os.path.abspath(os.fsdecode(path)).startswith(root)
        return False

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if active[0] and args and under(args[0]):
            if event == "open":
                counts["open"] += 1
            elif event in _LISTING_EVENTS:
                counts["list"] += 1

    def wrap(module: Any, name: str, key: str) -> Callable[[], None]:
        original = getattr(module, name)

        def counted(path: Any, *a: Any, **k: Any) -> Any:
            if active[0] and under(path):
                counts[key] += 1
            return original(path, *a, **k)

        setattr(module, name, counted)
        return lambda: setattr(module, name, original)

    sys.addaudithook(hook)
    undo = [wrap(os, "stat", "stat"), wrap(os, "lstat", "stat"),
            wrap(h5files, "make_fid", "h5open")]

    def stop() -> None:
        active[0] = False
        for u in undo:
            u()

    return counts, stop
