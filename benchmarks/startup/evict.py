"""Make a data tree cold (evict it from the page cache) or warm (read what a build reads).

Two ways to make it cold, and the results say which one was used:

* ``fadvise`` (any user): ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of the tree. The
  files' data pages go; the kernel's directory and inode caches stay warm (opening every file to
  evict it even warms them), so listings and ``stat`` calls still answer from memory.
* ``drop`` (root only): ``sync`` then ``echo 3 > /proc/sys/vm/drop_caches``: data, directories
  and inodes of the whole machine go, as after a reboot or on a fresh node. Everyone's caches on
  the machine go with them. Falls back to ``fadvise`` when not permitted.

Some machines also reclaim idle page cache on their own (virtual machines running DAMON-based
reclaim page out what was not touched for a minute or so), so "warm" launches are preceded by
:func:`warm`, and the bytes each launch read from the disk are recorded next to its time.
"""

from __future__ import annotations

import os
from collections.abc import Callable

FADVISE = "posix_fadvise DONTNEED on every file (data pages; folder and inode caches stay warm)"
DROP = "drop_caches 3 (data, folders and inodes of the whole machine)"


def evict(root: str, how: str = "fadvise") -> str:
    """Evict ``root`` from the page cache; the description of the method actually used."""
    if how == "drop" and _drop_caches():
        return DROP
    os.sync()  # dirty pages cannot be dropped
    _each_file(root, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))
    return FADVISE


def warm(root: str) -> None:
    """List every folder and read the first page of every file of ``root`` (what a build reads:
    the headers; frame data is not part of a build)."""
    _each_file(root, lambda fd: os.pread(fd, 4096, 0))


def _each_file(root: str, action: Callable[[int], object]) -> None:
    """``action(fd)`` on every file below ``root`` (files that cannot be opened are skipped)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                action(fd)
            finally:
                os.close(fd)


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False
