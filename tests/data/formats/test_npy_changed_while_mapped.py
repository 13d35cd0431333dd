"""A mapped npy file that shrinks, vanishes or is replaced between two reads of one process:
an error naming the system and the file, or the new file's frames, never a SIGBUS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats import release_handles
from mdloader.errors import CorruptFileError, MissingDataError
from mdloader.testing import make_system


@pytest.fixture
def system(tmp_path: Path) -> DeepmdDataSetForLoader:
    release_handles()
    path = make_system(tmp_path, "sys", natoms=6, nframes=8, keys=("energy", "force"))
    ds = DeepmdDataSetForLoader(str(path), ["O", "H"])
    ds.add_data_requirement([{"key": "force", "ndof": 3, "atomic": True, "must": True}])
    ds.get_frames([0])  # the files are mapped now
    yield ds
    release_handles()


def _force(ds: DeepmdDataSetForLoader) -> Path:
    return Path(ds.system) / "set.000" / "force.npy"


def test_a_file_truncated_while_mapped_is_named(system: DeepmdDataSetForLoader) -> None:
    target = _force(system)
    os.truncate(target, target.stat().st_size // 3)
    with pytest.raises(CorruptFileError, match="shrank while it was read") as info:
        system.get_frames([7])
    assert info.value.file == str(target) and info.value.system == system.system


def test_a_file_deleted_while_mapped_is_named(system: DeepmdDataSetForLoader) -> None:
    target = _force(system)
    target.rename(target.with_name("away.npy"))
    with pytest.raises(MissingDataError, match="the npy file is gone") as info:
        system.get_frames([7])
    assert info.value.file == str(target)


def test_a_file_replaced_while_mapped_is_read_anew(system: DeepmdDataSetForLoader) -> None:
    target = _force(system)
    new = np.full((8, 18), 7.0)
    np.save(target.with_name("new.npy"), new)
    os.replace(target.with_name("new.npy"), target)
    assert np.all(system.get_frames([3])[0]["force"] == 7.0)


def test_truncation_in_a_child_process_is_an_error_not_a_bus_error(tmp_path: Path) -> None:
    """Without the check the child dies of SIGBUS (exit -7)."""
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
