"""Reads with ``O_DIRECT`` (``MDLOADER_DIRECT_READS=1``), shared by the npy and HDF5 formats.

A row read through the page cache fetches whole 4 KiB pages (and read-ahead, when not told
otherwise); with ``O_DIRECT`` storage sends only the blocks the row spans, which is what a data set
larger than a node's memory pays every pass. A kept descriptor is switched to ``O_DIRECT`` once
(:func:`start_direct`); each read fetches the blocks around the wanted bytes into a page-aligned
buffer and copies the bytes out (:func:`read_at`). The block size is learnt per device; a file
system that refuses ``O_DIRECT`` is read through the page cache, said once per process.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from typing import Protocol

import numpy as np

from mdloader.settings import cached

log = logging.getLogger(__name__)

O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Block sizes a direct read is tried at, smallest first: 512 B on most devices, 4 KiB on
#: devices of 4 KiB logical sectors. The first one a file system accepts is kept for it.
DIRECT_ALIGNMENTS = (512, 4096)
_MEMORY_ALIGNMENT = 4096  # a buffer at a page boundary satisfies every block size above
_direct_block: dict[int, int] = {}  # device -> the block size its direct reads accepted
_direct_refused: set[int] = set()  # devices that refused O_DIRECT (told once per process)


class KeptFile(Protocol):
    """A kept descriptor, and its device while it reads with ``O_DIRECT`` (else ``None``)."""

    fd: int
    device: int | None


def wanted() -> bool:
    """Whether ``MDLOADER_DIRECT_READS=1`` asks for direct reads."""
    return cached("direct_reads") == "1"


def read_at(held: KeptFile, path: str, view: memoryview, at: int) -> int:
    """Fill ``view`` from byte ``at`` of the file; the bytes read (fewer: the file ends)."""
    if held.device is None:
        return os.preadv(held.fd, [view], at)
    return _direct_read(held, path, view, at)


def _direct_read(held: KeptFile, path: str, view: memoryview, at: int) -> int:
    """:func:`read_at` through O_DIRECT: the blocks around ``[at, at + len(view))`` into a
    page-aligned buffer, then sliced. The block size is learnt per device from the first read
    (EINVAL at 512 B: 4 KiB); a device that refuses both is read through the page cache."""
    size = len(view)
    while held.device is not None:
        block = _direct_block.get(held.device, DIRECT_ALIGNMENTS[0])
        start = at - at % block
        span = -(-(at + size - start) // block) * block
        buffer = _aligned_buffer(span)
        try:
            got = os.preadv(held.fd, [buffer], start)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            larger = [b for b in DIRECT_ALIGNMENTS if b > block]
            if larger:
                _direct_block[held.device] = larger[0]
            else:
                _leave_direct(held, path, f"reads at {block} B blocks failed: {exc.strerror}")
            continue
        _direct_block.setdefault(held.device, block)
        got = max(0, min(size, got - (at - start)))
        view[:got] = buffer[at - start:at - start + got]
        return got
    return os.preadv(held.fd, [view], at)


def _aligned_buffer(size: int) -> memoryview:
    """``size`` bytes of private memory at a page boundary (what O_DIRECT reads into); a fresh
    one per read, so threads and forked workers never share it."""
    raw = np.empty(size + _MEMORY_ALIGNMENT, dtype=np.uint8)
    skip = -raw.ctypes.data % _MEMORY_ALIGNMENT
    return memoryview(raw[skip:skip + size])


def _leave_direct(held: KeptFile, path: str, why: str) -> None:
    """Read ``held`` through the page cache from now on; the first file of a device that
    refuses O_DIRECT says so once per process."""
    device, held.device = held.device, None
    fcntl.fcntl(held.fd, fcntl.F_SETFL, fcntl.fcntl(held.fd, fcntl.F_GETFL) & ~O_DIRECT)
    if device not in _direct_refused:
        _direct_refused.add(device)  # type: ignore[arg-type]
        log.warning("MDLOADER_DIRECT_READS=1, but the file system of %s refuses O_DIRECT (%s): "
                    "its files are read through the page cache", path, why)


def start_direct(fd: int, path: str) -> int | None:
    """Switch an open descriptor to O_DIRECT; its device, or ``None`` when the file system
    refuses (tmpfs before Linux 6.6: EINVAL), said once per process."""
    device = os.fstat(fd).st_dev
    if device in _direct_refused or not O_DIRECT:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
    except OSError as exc:
        _direct_refused.add(device)
        log.warning("MDLOADER_DIRECT_READS=1, but the file system of %s refuses O_DIRECT (%s): "
                    "its files are read through the page cache", path, exc.strerror or exc)
        return None
    return device
