"""Messages about a frame of an LMDB group name that frame's own ``data.mdb[...]`` entry, for
every group of a database, not only its first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mdloader.catalog.discover import discover_systems
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.schema import DataRequirementItem
from mdloader.errors import NonFiniteError
from mdloader.stats.output import system_samples
from mdloader.testing import make_lmdb, make_system


def test_a_label_error_in_the_second_group_names_its_own_entry(tmp_path: Path) -> None:
    first = make_system(tmp_path / "src", "a", natoms=6, nframes=4, seed=1)
    second = make_system(tmp_path / "src", "b", natoms=3, nframes=3, seed=2)
    energy = Path(second) / "set.000" / "energy.npy"
    values = np.load(energy)
    values[1] = np.nan  # the second group's frame 1: database frame 4 + 1
    np.save(energy, values)
    db = make_lmdb(tmp_path / "d.lmdb", [first, second])
    groups = sorted(discover_systems(db), key=lambda a: "natoms=3" not in a)
    dataset = DeepmdDataSetForLoader(groups[0])
    dataset.add_data_requirement([DataRequirementItem("energy", 1, atomic=False, must=True)])
    assert dataset.get_frames([1])[0]["fid"] == 5
    with pytest.raises(NonFiniteError, match=r"data\.mdb\[000000000005\]"):
        system_samples(dataset, 1, key="energy")
