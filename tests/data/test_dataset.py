"""DeepmdDataSetForLoader on generated systems: npy and HDF5 through the same assertions."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from mdloader.data.collate import collate_batch
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats import npy as npy_backend
from mdloader.data.formats import release_handles
from mdloader.data.schema import DataRequirementItem as Req
from mdloader.errors import (
    CorruptFileError,
    MissingDataError,
    StaleDataError,
    UnreadableFileError,
)
from mdloader.testing import make_system

BACKENDS = ["npy", "hdf5"]
ENERGY_FORCE = [Req("energy", 1, high_prec=True), Req("force", 3, atomic=True),
                Req("virial", 9)]


def raw(address: str, set_name: str, key: str) -> np.ndarray:
    """Read an array straight from the files, bypassing mdloader."""
    if "#" in address:
        import h5py

        path, group = address.split("#")
        with h5py.File(path, "r") as fh:
            return np.asarray(fh[group.rstrip("/") + f"/{set_name}/{key}.npy"][()])
    return np.load(os.path.join(address, set_name, key + ".npy"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_frame_matches_files_with_atoms_sorted_by_type(tmp_path, backend):
    types = [1, 0, 1, 1, 0, 1]
    addr = make_system(tmp_path, natoms=6, nframes=7, nsets=2, types=types, backend=backend)
    ds = DeepmdDataSetForLoader(addr)
    ds.add_data_requirement(ENERGY_FORCE)
    assert len(ds) == 7
    order = np.argsort(types, kind="stable")
    frame = ds[5]  # second set (frames 3..6), local row 2
    coord = raw(addr, "set.001", "coord")[2].reshape(6, 3)[order]
    np.testing.assert_array_equal(frame["coord"], coord.astype(np.float64))
    np.testing.assert_array_equal(frame["force"],
                                  raw(addr, "set.001", "force")[2].reshape(6, 3)[order])
    assert frame["atype"].tolist() == [0, 0, 1, 1, 1, 1]
    assert frame["atype"].dtype == np.int32
    assert frame["natoms"].tolist() == [6, 6, 2, 4] and frame["natoms"].dtype == np.int32
    assert frame["coord"].dtype == np.float64 and frame["energy"].shape == (1,)
    assert frame["box"].shape == (9,) and frame["virial"].shape == (9,)
    assert frame["numb_copy"].tolist() == [1] and frame["find_numb_copy"] == np.float32(0.0)
    assert frame["find_energy"] == np.float32(1.0) and isinstance(frame["find_energy"],
                                                                    np.float32)
    assert frame["fid"] == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_batch_equals_collated_frames(tmp_path, backend):
    addr = make_system(tmp_path, natoms=5, nframes=6, nsets=3, backend=backend)
    ds = DeepmdDataSetForLoader(addr)
    ds.add_data_requirement(ENERGY_FORCE)
    fids = [5, 0, 3, 3]
    batch = ds.get_batch(fids)
    reference = collate_batch(ds.get_frames(fids))
    assert batch.keys() == reference.keys()
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(batch[key], value), key
            assert batch[key].dtype == value.dtype
        else:
            assert batch[key] == value, key
    assert batch["fid"] == fids and "type" not in batch


@pytest.mark.parametrize("backend", BACKENDS)
def test_nopbc_box_is_none_and_collates_to_none(tmp_path, backend):
    addr = make_system(tmp_path, pbc=False, backend=backend)
    ds = DeepmdDataSetForLoader(addr)
    assert ds[0]["box"] is None and ds[0]["find_box"] == np.float32(0.0)
    assert ds.get_batch([0, 1])["box"] is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_frame_sets_with_1d_arrays(tmp_path, backend):
    addr = make_system(tmp_path, natoms=3, nframes=1, one_frame_1d=True, backend=backend,
                       types=[0, 0, 1])
    ds = DeepmdDataSetForLoader(addr)
    ds.add_data_requirement(ENERGY_FORCE)
    frame = ds[0]
    np.testing.assert_array_equal(frame["coord"].reshape(-1),
                                  raw(addr, "set.000", "coord").astype(np.float64))
    assert frame["energy"].shape == (1,) and frame["box"].shape == (9,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_type_real_types_and_counts(tmp_path, backend):
    addr = make_system(tmp_path, natoms=6, nframes=3, mixed_type=True, backend=backend,
                       type_map=("O", "H"))
    rat = raw(addr, "set.000", "real_atom_types")
    rat[1, 0] = -1  # a virtual atom
    _rewrite(addr, "set.000", "real_atom_types", rat)
    ds = DeepmdDataSetForLoader(addr, type_map=["H", "O", "C"])
    assert ds.mixed_type
    frame = ds[1]
    expected = np.array([1, 0, -1])[rat[1]]  # O->1, H->0, virtual stays -1
    expected[0] = -1
    assert frame["atype"].tolist() == expected.tolist()
    counts = [int((expected == t).sum()) for t in range(3)]
    assert frame["real_natoms_vec"].tolist() == [6, 6] + counts
    assert frame["natoms"].tolist() == [6, 6, 6, 0, 0]  # from the all-zero placeholder type.raw


def test_mixed_type_id_outside_map_is_reported(tmp_path):
    from mdloader.errors import TypeMapError

    addr = make_system(tmp_path, natoms=4, nframes=2, mixed_type=True)
    rat = raw(addr, "set.000", "real_atom_types")
    rat[0, 0] = 7
    _rewrite(addr, "set.000", "real_atom_types", rat)
    with pytest.raises(TypeMapError, match=r"real_atom_types.npy holds a type id outside"):
        DeepmdDataSetForLoader(addr)[0]


def _rewrite(addr: str, set_name: str, key: str, arr: np.ndarray) -> None:
    if "#" in addr:
        import h5py

        path, group = addr.split("#")
        with h5py.File(path, "a") as fh:
            fh[group.rstrip("/") + f"/{set_name}/{key}.npy"][...] = arr
    else:
        np.save(os.path.join(addr, set_name, key + ".npy"), arr)


@pytest.mark.parametrize("backend", BACKENDS)
def test_type_map_remap(tmp_path, backend):
    addr = make_system(tmp_path, natoms=4, types=[0, 1, 0, 1], type_map=("O", "H"),
                       backend=backend)
    ds = DeepmdDataSetForLoader(addr, type_map=["H", "Si", "O"])
    assert ds[0]["atype"].tolist() == [0, 0, 2, 2]
    assert ds._natoms_vec.tolist() == [4, 4, 2, 0, 2]
    assert ds._ntypes == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_atomic_alias_type_sel_and_repeat(tmp_path, backend):
    types = [0, 1, 1, 0, 1]
    nsel = 2  # type 0 atoms
    rng = np.random.default_rng(1)
    dip_sel = rng.normal(size=(3, nsel * 3))
    pref = rng.normal(size=(3, 5))
    addr = make_system(tmp_path, natoms=5, nframes=3, types=types, backend=backend,
                       extra_keys={"atomic_dipole": dip_sel, "atom_pref": pref})
    ds = DeepmdDataSetForLoader(addr)
    ds.add_data_requirement([
        Req("atomic_dipole", 3, atomic=True, type_sel=[0]),
        Req("atom_pref", 1, atomic=True, repeat=3),
    ])
    frame = ds[2]
    np.testing.assert_array_equal(frame["atom_dipole"], dip_sel[2].reshape(2, 3))
    assert frame["find_atom_dipole"] == np.float32(1.0)
    order = np.argsort(types, kind="stable")
    assert frame["atom_pref"].shape == (5, 3)  # repeat applied (DeePMD-kit forgets it)
    np.testing.assert_array_equal(frame["atom_pref"][:, 0], pref[2][order])
    np.testing.assert_array_equal(frame["atom_pref"][:, 2], pref[2][order])


def test_type_sel_full_layout_and_output_natoms(tmp_path):
    types = [1, 0, 1, 0]
    full = np.arange(2 * 4 * 3, dtype=float).reshape(2, 12)
    addr = make_system(tmp_path, natoms=4, nframes=2, types=types,
                       extra_keys={"atom_polar": full})
    ds = DeepmdDataSetForLoader(addr)
    ds.add_data_requirement([Req("atom_polar", 3, atomic=True, type_sel=[0],
                                 output_natoms_for_type_sel=True)])
    out = ds[1]["atom_polar"]
    assert out.shape == (4, 3)
    np.testing.assert_array_equal(out, full[1].reshape(4, 3)[[1, 3, 0, 2]])
    ds2 = DeepmdDataSetForLoader(addr)
    ds2.add_data_requirement([Req("atom_polar", 3, atomic=True, type_sel=[0])])
    np.testing.assert_array_equal(ds2[1]["atom_polar"], full[1].reshape(4, 3)[[1, 3]])


def test_hessian_rows_and_columns_permuted(tmp_path):
    types = [1, 0, 1]
    hess = np.arange(2 * 81, dtype=float).reshape(2, 81)
    addr = make_system(tmp_path, natoms=3, nframes=2, types=types, extra_keys={"hessian": hess})
    ds = DeepmdDataSetForLoader(addr)
    ds.add_data_requirement([Req("hessian", 1, atomic=True)])
    idx = np.concatenate([np.arange(3) + 3 * a for a in [1, 0, 2]])
    expected = hess[1].reshape(9, 9)[idx][:, idx].reshape(-1)
    np.testing.assert_array_equal(ds[1]["hessian"], expected)


def test_missing_optional_key_is_default_filled(tmp_path):
    addr = make_system(tmp_path, natoms=3, keys=("energy",))
    ds = DeepmdDataSetForLoader(addr)
    ds.add_data_requirement([Req("force", 3, atomic=True, default=0.5),
                             Req("fparam", 2, dtype=np.float32)])
    frame = ds[0]
    assert frame["find_force"] == np.float32(0.0) and frame["force"].shape == (3, 3)
    assert np.all(frame["force"] == 0.5)
    assert frame["fparam"].dtype == np.float32 and frame["fparam"].shape == (2,)


def test_low_precision_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("DP_INTERFACE_PREC", "low")
    ds = DeepmdDataSetForLoader(make_system(tmp_path))
    ds.add_data_requirement([Req("energy", 1, high_prec=True)])
    assert ds[0]["coord"].dtype == np.float32 and ds[0]["energy"].dtype == np.float64


@pytest.mark.parametrize("backend", BACKENDS)
def test_pickled_size_is_small_and_handles_are_not_pickled(tmp_path, backend):
    natoms = 192
    ds = DeepmdDataSetForLoader(make_system(tmp_path, natoms=natoms, nframes=80,
                                            backend=backend))
    ds[0]  # opens a memory map / HDF5 file in this process
    blob = pickle.dumps(ds)
    assert len(blob) <= 600 + 2 * natoms, len(blob)
    clone = pickle.loads(blob)
    np.testing.assert_array_equal(clone[3]["coord"], ds[3]["coord"])


def test_open_npy_files_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("MDLOADER_MAX_OPEN_FILES", "4")
    systems = [DeepmdDataSetForLoader(make_system(tmp_path, f"s{i}", natoms=3, seed=i))
               for i in range(6)]
    for ds in systems:
        ds.add_data_requirement(ENERGY_FORCE)
        ds[0]
    assert npy_backend.open_file_count() <= 4


def test_descriptors_of_evicted_npy_files_are_closed(tmp_path, monkeypatch):
    monkeypatch.setenv("MDLOADER_MAX_OPEN_FILES", "2")
    npy_backend.release()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(40):  # 5 files each: 200 paths opened in turn
        ds = DeepmdDataSetForLoader(make_system(tmp_path, f"s{i}", natoms=3, seed=i))
        ds.add_data_requirement(ENERGY_FORCE)
        ds[0]
    assert npy_backend.open_file_count() <= 2
    assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_frame_index_out_of_range(tmp_path):
    ds = DeepmdDataSetForLoader(make_system(tmp_path, nframes=3))
    with pytest.raises(IndexError, match=r"frame index out of range \[0, 3\)"):
        ds[3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stored", [(1, -1), (2, -1)])
def test_arrays_stored_flat_read_as_deepmd_reshapes_them(tmp_path, backend, stored):
    """``aparam.npy`` of shape (1, F*N) (DeePMD-kit's fparam example) or (2, F*N/2): its size
    is a multiple of the frames, so it is read as (F, N) like DeePMD-kit's whole-set reader
    does; the atoms then go in type order."""
    flat = np.arange(6 * 4, dtype=np.float32).reshape(stored)
    addr = make_system(tmp_path, natoms=4, nframes=6, backend=backend, types=[1, 0, 1, 0],
                       extra_keys={"aparam": flat})
    ds = DeepmdDataSetForLoader(addr)
    ds.add_data_requirement([Req("aparam", 1, atomic=True)])
    batch = ds.get_batch([5, 0, 2])
    expected = flat.reshape(6, 4)[[5, 0, 2]][:, [1, 3, 0, 2]]
    np.testing.assert_array_equal(batch["aparam"].numpy()[..., 0], expected)


def test_source_policy_survives_conversion_and_must_is_tracked_only():
    from mdloader.data.schema import as_requirement
    from mdloader.errors import ConfigError

    class DeepmdStyleItem(dict):  # DeePMD-kit's items are read through __getitem__
        pass

    item = as_requirement(DeepmdStyleItem(key="fparam", ndof=2, source_policy="default"))
    assert item.source_policy == "default" and item.ndof == 2
    assert as_requirement({"key": "energy", "ndof": 1}).source_policy == "tracked"
    with pytest.raises(ConfigError, match=r"^data requirement 'energy': a mandatory requirement "
                       r"\(must=True\) cannot use source_policy='derived', only 'tracked'$"):
        Req("energy", 1, must=True, source_policy="derived")


# -- files that change after the build: errors that name the system and the file --------------
def _built(tmp_path, backend="npy"):
    addr = make_system(tmp_path, "s", natoms=4, nframes=6, nsets=2, backend=backend)
    ds = DeepmdDataSetForLoader(addr)
    ds.add_data_requirement(ENERGY_FORCE)
    release_handles()  # the build's handles: the edits below happen "after the build"
    return addr, ds


def test_a_system_described_again_after_its_files_grew_reads_the_new_frames(tmp_path):
    """A process that keeps a map from the first description (a notebook that regenerates its
    data) maps the file anew for the second, instead of failing on the old map's shape."""
    addr = make_system(tmp_path, "s", natoms=4, nframes=3)
    assert DeepmdDataSetForLoader(addr).get_batch([2])["coord"].shape == (1, 4, 3)
    make_system(tmp_path, "s", natoms=4, nframes=5, seed=7)
    again = DeepmdDataSetForLoader(addr)
    by_type = np.argsort(np.loadtxt(os.path.join(addr, "type.raw"), dtype=int), kind="stable")
    source = np.load(os.path.join(addr, "set.000", "coord.npy"))[4].reshape(4, 3)[by_type]
    assert len(again) == 5 and np.allclose(again.get_batch([4])["coord"][0].numpy(), source)


def test_a_truncated_npy_file_is_an_error_not_sigbus(tmp_path):
    """Mapping a file shorter than its header says and reading past its end kills the process
    with SIGBUS; the size check at opening names the file instead."""
    addr, ds = _built(tmp_path)
    path = os.path.join(addr, "set.001", "force.npy")
    os.truncate(path, os.path.getsize(path) - 8)
    with pytest.raises(CorruptFileError, match=rf"^the npy file is shorter than its header says "
                       rf"\(truncated after the build\?\); system: {addr}; file: {path}; "
                       r"expected: 144 data bytes for shape \(3, 12\); found: 136 bytes$"):
        ds.get_batch([4])
    assert ds.get_batch([0])["force"].shape == (1, 4, 3)  # the other set still reads


def test_a_moved_npy_file_is_a_missing_data_error(tmp_path):
    addr, ds = _built(tmp_path)
    path = os.path.join(addr, "set.000", "energy.npy")
    os.rename(path, path + ".away")
    with pytest.raises(MissingDataError, match=rf"^the npy file is gone \(moved or deleted after "
                       rf"the build\); system: {addr}; file: {path}$"):
        ds.get_batch([1])


def test_an_unreadable_or_rewritten_npy_file(tmp_path):
    addr, ds = _built(tmp_path)
    path = os.path.join(addr, "set.000", "force.npy")
    os.remove(path)
    os.mkdir(path)  # open() fails with an OSError that is not FileNotFoundError
    with pytest.raises(UnreadableFileError, match=rf"^cannot read the npy file; system: {addr}; "
                       rf"file: {path}; found: IsADirectoryError: Is a directory$"):
        ds.get_batch([0])
    os.rmdir(path)
    np.save(path, np.zeros((2, 13), dtype=np.float32))  # cannot be the 3 frames of the build
    with pytest.raises(StaleDataError, match=rf"^the file changed after the system was described "
                       rf"\(described when this job started; the data changed while it ran: "
                       rf"restart the job\); system: {addr}; file: {path}; expected: 3 frames of "
                       r"width 12; found: 2 frames of width 13 \(shape \(2, 13\)\)$"):
        ds.get_batch([0])
    np.save(path, np.zeros((2, 12), dtype=np.float32))  # 3 frames of 8 values, read flat
    with pytest.raises(StaleDataError, match=rf"; file: {path}; expected: 3 frames of width 12; "
                       r"found: 3 frames of width 8 \(shape \(2, 12\)\)$"):
        ds.get_batch([0])


def test_hdf5_datasets_that_vanish_or_break_after_the_build(tmp_path):
    import h5py

    addr, ds = _built(tmp_path, backend="hdf5")
    path = addr.split("#")[0]
    with h5py.File(path, "a") as fh:
        del fh["s/set.001/force.npy"]
    release_handles()
    with pytest.raises(MissingDataError, match=r"^the dataset is gone \(the file changed after the "
                       rf"build\); system: {addr}; file: {path}#/s/set.001/force.npy$"):
        ds.get_batch([4])
    os.truncate(path, 100)
    release_handles()
    with pytest.raises(CorruptFileError, match=rf"^cannot open the file as HDF5; system: {addr}"):
        ds.get_batch([0])


def test_an_hdf5_dataset_that_cannot_be_read(tmp_path, monkeypatch):
    from mdloader.data.formats import hdf5

    addr, ds = _built(tmp_path, backend="hdf5")

    class Broken:
        ndim, shape = 2, (3, 12)

        def __getitem__(self, key):
            raise OSError("Can't synchronously read data (wrong B-tree signature)")

    monkeypatch.setattr(hdf5, "_group", lambda loc: {"set.001": {"force.npy": Broken()}})
    with pytest.raises(UnreadableFileError, match=r"^cannot read the dataset \(the file changed "
                       rf"after the build\?\); system: {addr}; file: .*#/s/set.001/force.npy; "
                       r"found: OSError: Can't synchronously read data"):
        hdf5.read_rows(ds.meta.location, "set.001", "force", np.array([0]), 3)


def test_an_npy_file_of_python_objects(tmp_path):
    addr, ds = _built(tmp_path)
    path = os.path.join(addr, "set.000", "force.npy")
    np.save(path, np.array([[object()] * 12] * 3, dtype=object), allow_pickle=True)
    with pytest.raises(CorruptFileError, match=r"^the npy file holds Python objects; DeePMD "
                       rf"arrays are numeric; system: {addr}; file: {path}; found: object$"):
        ds.get_batch([0])
