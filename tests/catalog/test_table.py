"""SystemTable (the descriptions in columns) and SystemDatasets (datasets made on first use)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from mdloader.catalog.table import SystemTable, TableBuilder
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.system import build_system_meta
from mdloader.loading.loader import DpLoaderSet
from mdloader.loading.system_list import SystemDatasets, natoms_of, nframes_of
from mdloader.testing import make_system


@pytest.fixture
def metas(tmp_path: Path) -> list:
    addresses = [make_system(tmp_path / "npy", f"sys.{i}", natoms=3 + i, nframes=2 + i,
                             nsets=1 + i % 2, seed=i) for i in range(5)]
    addresses.append(make_system(tmp_path, "g", backend="hdf5", h5_file="d.h5", nframes=3))
    addresses.append(make_system(tmp_path / "npy", "mixé", mixed_type=True, nframes=2))
    addresses.append(make_system(tmp_path / "npy", "wide", types=[0, 200, 1], type_map=None,
                                 nframes=2))
    return [build_system_meta(a, ["O", "H"] if "wide" not in a else None) for a in addresses]


def test_round_trip_and_columns(metas: list) -> None:
    table = SystemTable.from_metas(metas)
    assert len(table) == len(metas) and list(table) == metas and table[-1] == metas[-1]
    assert table.addresses() == [m.address for m in metas]
    np.testing.assert_array_equal(table.natoms(), [m.natoms for m in metas])
    np.testing.assert_array_equal(table.nframes(), [m.nframes for m in metas])
    assert [table.has_type_map(i) for i in range(len(table))] == [
        m.type_map is not None for m in metas]
    assert table.layouts()[1] == (True, ("set.000", "set.001"))
    clone = pickle.loads(pickle.dumps(table.with_origin("/x.mdlidx")))
    assert clone == table and clone.origin == "/x.mdlidx" and table.origin is None
    with pytest.raises(IndexError, match="system 8 out of range for 8 systems"):
        table[8]


def test_copying_rows_of_another_table(metas: list) -> None:
    table = SystemTable.from_metas(metas)
    builder = TableBuilder()
    for row in (4, 0, 7):
        builder.add_row(table, row)
    builder.add(metas[2])
    assert list(builder.table()) == [metas[4], metas[0], metas[7], metas[2]]
    with pytest.raises(TypeError, match=r"entry 4 of the system descriptions is not a "
                                        r"SystemMeta \(found str\)"):
        builder.add("sys")  # type: ignore[arg-type]


def test_a_table_is_smaller_and_faster_to_send_than_a_list(metas: list) -> None:
    table = SystemTable.from_metas(metas[:5])
    many = [table[i % 5] for i in range(1000)]  # distinct objects, as a build makes them
    assert len(pickle.dumps(SystemTable.from_metas(many))) < 0.8 * len(pickle.dumps(many))


def test_parts_are_checked_when_read_back(metas: list) -> None:
    parts = SystemTable.from_metas(metas).parts()
    assert SystemTable.from_parts(**parts) == SystemTable.from_metas(metas)
    short = dict(parts, columns={**parts["columns"], "flags": parts["columns"]["flags"][:-1]})
    with pytest.raises(ValueError, match="column flags has 7 rows, expected 8"):
        SystemTable.from_parts(**short)
    with pytest.raises(ValueError, match="the columns do not add up"):
        SystemTable.from_parts(**dict(parts, names=parts["names"][:-1]))


def test_datasets_are_made_when_first_used(metas: list) -> None:
    table = SystemTable.from_metas(metas).with_origin("/i.mdlidx")
    datasets = SystemDatasets(table)
    assert sum(d is not None for d in datasets._made) == 0
    np.testing.assert_array_equal(natoms_of(datasets), table.natoms())
    np.testing.assert_array_equal(nframes_of(datasets), table.nframes())
    assert sum(d is not None for d in datasets._made) == 0  # counting made nothing
    first = datasets[2]
    assert isinstance(first, DeepmdDataSetForLoader) and first is datasets[-6]
    assert first.meta == metas[2] and first._origin == "/i.mdlidx"
    assert [d.meta for d in datasets[1:3]] == metas[1:3]
    clone = pickle.loads(pickle.dumps(datasets))
    assert sum(d is not None for d in clone._made) == 2 and clone[2].meta == metas[2]
    with pytest.raises(IndexError, match="system index 8 out of range for 8 systems"):
        datasets[8]


def test_dp_loader_set_takes_the_list_as_it_is(metas: list) -> None:
    datasets = SystemDatasets(SystemTable.from_metas(metas[:5]))
    ls = DpLoaderSet(datasets, 1, ["O", "H"], seed=1)
    assert ls.systems is datasets and ls.nframes.tolist() == [m.nframes for m in metas[:5]]
    assert ls[(0, [0])]["coord"].shape[0] == 1
