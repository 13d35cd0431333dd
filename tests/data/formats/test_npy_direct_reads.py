"""``MDLOADER_DIRECT_READS=1``: npy rows read with O_DIRECT give the frames the page cache gives,
learn the block size a file system accepts, and fall back to the page cache, saying so once,
on a file system that refuses O_DIRECT. (Truncation under direct reads: the parametrised tests
of ``test_npy_changed_while_open.py``.)"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from support.direct_io import direct_folder

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats import direct, npy, release_handles
from mdloader.testing import make_system

FORCE = [{"key": "force", "ndof": 3, "atomic": True, "must": True}]
ROWS = [3, 4, 5, 49, 0, 17, 17, 48]  # runs, a repeat, the last row, out of order


def frames(path: Path) -> list[dict[str, np.ndarray]]:
    release_handles()
    ds = DeepmdDataSetForLoader(str(path), ["O", "H"])
    ds.add_data_requirement(FORCE)
    return ds.get_frames(ROWS)


@pytest.fixture
def system(tmp_path: Path) -> Path:
    # 7 atoms: a force row of 168 B, rows straddle 512 B blocks
    with direct_folder(tmp_path) as folder:
        yield Path(make_system(folder, "sys", natoms=7, nframes=50, keys=("energy", "force")))
        release_handles()


def _same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        for key in x:
            np.testing.assert_array_equal(np.asarray(x[key]), np.asarray(y[key]), err_msg=key)


def test_direct_reads_give_the_frames_of_the_page_cache(system: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "0")
    buffered = frames(system)
    assert npy.open_file_count() >= 3 and npy.direct_file_count() == 0
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "1")
    direct = frames(system)
    assert npy.direct_file_count() == npy.open_file_count() >= 3
    _same(buffered, direct)


def test_a_device_that_takes_only_4_kib_blocks_is_learnt(system: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A read at 512 B blocks failing with EINVAL (a disk of 4 KiB sectors) is retried at
    4 KiB, which the device's later reads use from the start."""
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "0")
    buffered = frames(system)
    real, offsets = os.preadv, []

    def four_kib_only(fd: int, buffers: list, offset: int) -> int:
        if fcntl_flags(fd) & os.O_DIRECT:
            offsets.append(offset)
            if offset % 4096 or sum(len(b) for b in buffers) % 4096:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", four_kib_only)
    monkeypatch.setattr(direct, "_direct_block", {})
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "1")
    _same(buffered, frames(system))
    assert list(direct._direct_block.values()) == [4096]
    assert offsets and all(o % 4096 == 0 for o in offsets[1:])
    assert npy.direct_file_count() == npy.open_file_count()


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_file_system_refusing_o_direct_is_read_through_the_page_cache(
        system: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """As tmpfs before Linux 6.6: EINVAL when O_DIRECT is asked for; one warning per process."""
    import fcntl

    monkeypatch.setenv("MDLOADER_DIRECT_READS", "0")
    buffered = frames(system)
    real = fcntl.fcntl

    def refuse(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    monkeypatch.setattr(direct, "_direct_refused", set())
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "1")
    with caplog.at_level(logging.WARNING, logger=direct.__name__):
        _same(buffered, frames(system))
        _same(buffered, frames(system))  # the files opened again: no second line
    assert npy.direct_file_count() == 0 and npy.open_file_count() >= 3
    lines = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(lines) == 1 and "read through the page cache" in lines[0], lines
