"""Cross-check on real DeePMD systems (tests/fixtures, examples/water/data) against dpdata.

dpdata's ``deepmd/npy`` and ``deepmd/hdf5`` readers are an independent implementation of the
format; mdloader's frames must hold the same numbers (after DeePMD-kit's sort of atoms by type).
"""

from __future__ import annotations

import os

import dpdata
import numpy as np
import pytest

from mdloader.catalog.discover import discover_systems
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.schema import DataRequirementItem as Req
from mdloader.data.system import build_system_meta
from mdloader.errors import ShapeError

LABELS = [Req("energy", 1, high_prec=True), Req("force", 3, atomic=True),
          Req("virial", 9)]


def _compare_with_dpdata(ds: DeepmdDataSetForLoader, ref: dpdata.LabeledSystem,
                         fids: list[int]) -> None:
    order = np.argsort(ref["atom_types"], kind="stable")
    for fid in fids:
        frame = ds[fid]
        np.testing.assert_allclose(frame["coord"], ref["coords"][fid][order], rtol=0, atol=1e-6)
        np.testing.assert_allclose(frame["force"], ref["forces"][fid][order], rtol=0, atol=1e-6)
        np.testing.assert_allclose(frame["energy"], [ref["energies"][fid]], rtol=1e-7)
        if frame["box"] is not None:
            np.testing.assert_allclose(frame["box"], ref["cells"][fid].reshape(9), atol=1e-6)
        assert frame["atype"].tolist() == sorted(ref["atom_types"].tolist())


def test_water_matches_dpdata_npy_and_hdf5(water_data, tmp_path):
    systems = discover_systems(str(water_data))
    assert [os.path.basename(s) for s in systems] == ["data_0", "data_1", "data_2", "data_3"]
    for address in systems:
        ds = DeepmdDataSetForLoader(address, type_map=["O", "H"])
        ds.add_data_requirement(LABELS)
        ref = dpdata.LabeledSystem(address, fmt="deepmd/npy")
        assert len(ds) == ref.get_nframes()
        _compare_with_dpdata(ds, ref, [0, len(ds) // 2, len(ds) - 1])
    # data_1 has two sets; through dpdata's HDF5 writer, the HDF5 backend must agree
    ref = dpdata.LabeledSystem(systems[1], fmt="deepmd/npy")
    h5 = str(tmp_path / "water.h5")
    ref.to("deepmd/hdf5", h5)
    h5_ds = DeepmdDataSetForLoader(discover_systems(h5)[0], type_map=["O", "H"])
    h5_ds.add_data_requirement(LABELS)
    _compare_with_dpdata(h5_ds, dpdata.LabeledSystem(h5, fmt="deepmd/hdf5"), [0, 85, 159])


def test_hdf5_root_system(real_data):
    path = str(real_data / "deepmd-tests" / "tf" / "test.hdf5")
    assert discover_systems(path) == [f"{path}#/"]
    ds = DeepmdDataSetForLoader(path)
    ds.add_data_requirement(LABELS[:2])
    assert ds._natoms == 20 and ds.meta.type_map == ("X",) and len(ds) == 1
    _compare_with_dpdata(ds, dpdata.LabeledSystem(path, fmt="deepmd/hdf5"), [0])


def test_one_frame_1d_arrays(real_data):
    ds = DeepmdDataSetForLoader(str(real_data / "deepmd-tests/pt/model_compression/data"))
    ds.add_data_requirement(LABELS[:2])
    frame = ds[0]
    assert len(ds) == 1 and frame["coord"].shape == (6, 3) and frame["energy"].shape == (1,)


def test_mixed_type_nopbc_property(real_data):
    root = real_data / "deepmd-tests/pt/property/double"
    ds = DeepmdDataSetForLoader(str(root), type_map=["H", "C", "N", "O"])
    ds.add_data_requirement([Req("band_property", 3)])
    frame = ds[1]
    assert ds.mixed_type and frame["box"] is None and len(ds) == 2
    real = np.load(root / "set.000000" / "real_atom_types.npy")[1]
    sys_map = open(root / "type_map.raw").read().split()
    expected = [["H", "C", "N", "O"].index(sys_map[t]) for t in real]
    assert frame["atype"].tolist() == expected
    assert frame["band_property"].shape == (3,)


def test_mixed_type_natoms_placeholder(real_data):
    ds = DeepmdDataSetForLoader(str(real_data / "deepmd-tests/tf/finetune/data_mixed_type"),
                                type_map=["O", "H"])
    frame = ds[0]
    assert frame["natoms"].tolist() == [192, 192, 192, 0]
    assert frame["real_natoms_vec"].tolist() == [192, 192, 64, 128]


def test_inconsistent_frame_counts_fail_at_build(real_data):
    with pytest.raises(ShapeError, match=r"frame counts disagree.*found: 2 frames"):
        build_system_meta(str(real_data / "deepmd-tests/tf/data_dp_mask"))


def test_every_real_corner_builds_and_reads(real_data):
    systems = [s for s in discover_systems(str(real_data / "deepmd-tests"))
               if "data_dp_mask" not in s]
    assert len(systems) == 10  # every npy system of deepmd-tests in tests/fixtures/NOTICE.md
    for address in systems:
        ds = DeepmdDataSetForLoader(address)
        frame = ds[len(ds) - 1]
        assert frame["coord"].shape == (ds._natoms, 3), address


def test_hessian_and_spin_systems(real_data):
    hess = DeepmdDataSetForLoader(str(real_data / "deepmd-tests/pt/hessian/data/H8C4N2O"))
    hess.add_data_requirement([Req("hessian", 1, atomic=True, high_prec=True)])
    assert hess[0]["hessian"].shape == (15 * 15 * 9,)
    spin = DeepmdDataSetForLoader(str(real_data / "deepmd-tests/pt/NiO/data/data_0"))
    spin.add_data_requirement([Req("spin", 3, atomic=True), Req("force_mag", 3, atomic=True)])
    assert spin[0]["spin"].shape == (32, 3) and spin[0]["find_force_mag"] == np.float32(1.0)
