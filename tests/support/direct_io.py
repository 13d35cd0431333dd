"""A folder whose file system takes O_DIRECT reads, for the tests of ``MDLOADER_DIRECT_READS``:
pytest's temporary folder where it does, else one beside the repository (a ``/tmp`` in memory
on an older kernel refuses O_DIRECT; a checkout lives on a disk)."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mdloader.data.formats import direct

REPO = Path(__file__).resolve().parents[2]


def supports_direct(folder: Path) -> bool:
    """Whether ``folder``'s file system accepts an O_DIRECT read at 512 B or 4 KiB blocks."""
    probe = folder / "probe.bin"
    probe.write_bytes(os.urandom(8192))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        probe.unlink()
        return False
    try:
        buffer = memoryview(mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE))  # page-aligned
        for block in direct.DIRECT_ALIGNMENTS:
            try:
                return os.preadv(fd, [buffer[:block]], block) == block
            except OSError:
                continue
        return False
    finally:
        os.close(fd)
        probe.unlink()


@contextmanager
def direct_folder(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path`` if it takes O_DIRECT, else a fresh folder beside the repository, removed
    after; an error when neither does (the tests of direct reads must not pass unseen)."""
    if supports_direct(tmp_path):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix=".direct-io-", dir=REPO))
    try:
        if not supports_direct(folder):
            raise RuntimeError(f"neither {tmp_path} nor {folder} takes O_DIRECT reads: the "
                               "tests of MDLOADER_DIRECT_READS need a disk-backed folder")
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
