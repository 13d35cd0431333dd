"""An npy file that shrinks, vanishes or is replaced while a process keeps it open: an error
naming the system and the file, or the frames of the file opened, never a SIGBUS; and after the
first read of a file, no path look-up and no open per batch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats import npy, release_handles
from mdloader.errors import CorruptFileError, MissingDataError
from mdloader.loading.build import Section
from mdloader.loading.feed import Feed, StreamSpec
from mdloader.sampling.loop import TrainingLoop
from mdloader.sampling.spec import SamplingSpec
from mdloader.testing import make_system
from mdloader.train.job import LABELS
from mdloader.world import World

FORCE = [{"key": "force", "ndof": 3, "atomic": True, "must": True}]


@pytest.fixture(params=["0", "1"], ids=["page-cache", "direct"])
def reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``MDLOADER_DIRECT_READS`` of the test: rows through the page cache, or O_DIRECT."""
    monkeypatch.setenv("MDLOADER_DIRECT_READS", request.param)
    return request.param


@pytest.fixture
def system(tmp_path: Path) -> DeepmdDataSetForLoader:
    release_handles()
    path = make_system(tmp_path, "sys", natoms=6, nframes=8, keys=("energy", "force"))
    ds = DeepmdDataSetForLoader(str(path), ["O", "H"])
    ds.add_data_requirement(FORCE)
    ds.get_frames([0])  # the files are open now
    yield ds
    release_handles()


def _force(ds: DeepmdDataSetForLoader) -> Path:
    return Path(ds.system) / "set.000" / "force.npy"


def test_a_file_truncated_while_open_is_named(reads: str, system: DeepmdDataSetForLoader) -> None:
    """Also with O_DIRECT: the aligned read around the row comes back short."""
    target = _force(system)
    os.truncate(target, target.stat().st_size // 3)
    with pytest.raises(CorruptFileError, match="shrank while it was read") as info:
        system.get_frames([7])
    assert info.value.file == str(target) and info.value.system == system.system


def test_a_file_moved_away_while_open_is_read_as_opened(system: DeepmdDataSetForLoader) -> None:
    """The kept descriptor reads the file this process opened; a process that opens it anew
    (another rank, a new worker) finds it gone."""
    target = _force(system)
    before = system.get_frames([5])[0]["force"]
    target.rename(target.with_name("away.npy"))
    np.testing.assert_array_equal(system.get_frames([5])[0]["force"], before)
    release_handles()
    with pytest.raises(MissingDataError, match="the npy file is gone") as info:
        system.get_frames([5])
    assert info.value.file == str(target)


def test_a_file_replaced_by_rename_trains_on_the_file_opened(
        system: DeepmdDataSetForLoader) -> None:
    """A rename onto the path (how ``np.save`` to another name and ``mv`` replace a file) is
    not looked for per batch: the job trains on what it opened; a new process reads the new."""
    target = _force(system)
    before = system.get_frames([3])[0]["force"]
    np.save(target.with_name("new.npy"), np.full((8, 18), 7.0))
    os.replace(target.with_name("new.npy"), target)
    np.testing.assert_array_equal(system.get_frames([3])[0]["force"], before)
    release_handles()
    assert np.all(system.get_frames([3])[0]["force"] == 7.0)


def test_a_file_rewritten_in_place_with_the_same_shape_is_read_as_it_is_now(
        system: DeepmdDataSetForLoader) -> None:
    """Documented (docs/distributed.md): the same shape rewritten in place is not detected."""
    target = _force(system)
    rewritten = np.load(target, mmap_mode="r+")  # the same file, header and shape
    rewritten[:] = 5.0
    rewritten.flush()
    del rewritten
    assert np.all(system.get_frames([2])[0]["force"] == 5.0)


def test_truncation_in_a_child_process_is_an_error_not_a_bus_error(tmp_path: Path,
                                                                   reads: str) -> None:
    """Through a memory map the child died of SIGBUS (exit -7)."""
    path = Path(make_system(tmp_path, "sys", natoms=6, nframes=4000, keys=("energy", "force")))
    code = (
        "import os, sys\n"
        "from mdloader.data.dataset import DeepmdDataSetForLoader\n"
        "from mdloader.errors import CorruptFileError\n"
        f"ds = DeepmdDataSetForLoader({str(path)!r}, ['O', 'H'])\n"
        "ds.add_data_requirement([{'key': 'force', 'ndof': 3, 'atomic': True, 'must': True}])\n"
        "ds.get_frames([0])\n"
        f"t = {str(path / 'set.000' / 'force.npy')!r}\n"
        "os.truncate(t, os.path.getsize(t) // 3)\n"
        "try:\n    ds.get_frames([3999])\nexcept CorruptFileError as e:\n"
        "    print(e); sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert "force.npy" in done.stdout


def _takes_o_direct(folder: Path) -> bool:
    """Whether ``folder``'s file system lets a file be opened with O_DIRECT."""
    probe = folder / "o_direct.probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


def _feed(root: Path, workers: int) -> Feed:
    spec = StreamSpec(Section.of(None, "training", [str(root)]), SamplingSpec(batch_size=2))
    feed = Feed.build([spec], seed=3, world=World(), labels=LABELS, num_workers=workers)
    feed.start(0, TrainingLoop(displays=False))
    return feed


def _next(feed: Feed) -> dict:
    with feed.training_step():
        return next(feed.stream(None, "training"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_truncated_mid_training_is_one_error_naming_it(tmp_path: Path, workers: int,
                                                              reads: str) -> None:
    """Under the feed both trainers read, with and without DataLoader workers, through the
    page cache and with O_DIRECT."""
    release_handles()
    for i in range(3):
        make_system(tmp_path / "data", f"s{i}", natoms=6, nframes=40, seed=i)
    feed = _feed(tmp_path / "data", workers)
    try:
        for _ in range(30):  # every file is open in every reading process by now
            _next(feed)
        if workers == 0 and reads == "1" and _takes_o_direct(tmp_path):
            assert npy.direct_file_count() == npy.open_file_count() > 0
        targets = sorted((tmp_path / "data").glob("s*/set.000/force.npy"))
        for target in targets:
            os.truncate(target, 128 + 8)  # the header and one value: every row is short
        with pytest.raises(CorruptFileError, match="shrank while it was read") as info:
            for _ in range(200):
                _next(feed)
        assert info.value.file in {str(t) for t in targets}, info.value
    finally:
        feed.close()
        release_handles()


def test_no_path_look_up_and_no_open_per_batch_once_files_are_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted in the reading process (no workers): every call that names a path."""
    release_handles()
    for i in range(3):
        make_system(tmp_path / "data", f"s{i}", natoms=6, nframes=10, seed=i)
    feed = _feed(tmp_path / "data", 0)
    calls: list[str] = []
    try:
        for _ in range(40):  # 15 frames a pass: every file is open
            _next(feed)
        assert npy.open_file_count() >= 3 * 4  # coord, box, energy, force of each system
        for name in ("open", "stat", "lstat", "access", "scandir", "listdir"):
            real = getattr(os, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                calls.append(f"{_name}{args[:1]}")
                return _real(*args, **kwargs)
            monkeypatch.setattr(os, name, counted)
        for _ in range(30):
            _next(feed)
        monkeypatch.undo()
        assert [c for c in calls if str(tmp_path) in c] == []
    finally:
        monkeypatch.undo()
        feed.close()
        release_handles()


def test_the_soft_open_file_limit_is_raised_and_every_file_stays_open(tmp_path: Path) -> None:
    """A process started with ``ulimit -n 64`` (soft) raises it to the hard limit, logs it
    once, and keeps 30 systems x 4 files open instead of re-opening them."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"the hard open-file limit here is {hard}")
    for i in range(30):
        make_system(tmp_path / "data", f"s{i}", natoms=3, nframes=2, seed=i)
    code = textwrap.dedent(f"""
        import logging, resource
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        from mdloader.data.dataset import DeepmdDataSetForLoader
        from mdloader.data.formats import npy
        for i in range(30):
            ds = DeepmdDataSetForLoader({str(tmp_path / 'data')!r} + f"/s{{i}}")
            ds.add_data_requirement({FORCE!r})
            ds.get_frames([0, 1])
        print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0], "open",
              npy.open_file_count())
    """)
    done = subprocess.run(
        [sys.executable, "-c",
         f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (64, {hard}))\n" + code],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "MDLOADER_MAX_OPEN_FILES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    raised = [line for line in done.stderr.splitlines() if "open-file limit" in line]
    assert len(raised) == 1 and "from 64 to" in raised[0], done.stderr[-3000:]
    soft_now, open_now = done.stdout.split()[1], done.stdout.split()[3]
    assert int(soft_now) > 64 and int(open_now) >= 30 * 3, done.stdout
