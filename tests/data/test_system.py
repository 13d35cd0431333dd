"""Building a SystemMeta: headers only, and every defect reported with system and file."""

from __future__ import annotations

import builtins
import os
import pickle

import numpy as np
import pytest

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats import parse_address
from mdloader.data.formats.lmdb.groups import group_addresses
from mdloader.data.schema import DataRequirementItem as Req
from mdloader.data.system import build_system_meta
from mdloader.errors import CorruptFileError, DataError, MissingDataError, ShapeError, TypeMapError
from mdloader.testing import make_lmdb, make_system

BACKENDS = ["npy", "hdf5"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_describes_sets_sorted_as_strings(tmp_path, backend):
    addr = make_system(tmp_path, natoms=4, nframes=12, nsets=11, backend=backend)
    meta = build_system_meta(addr)
    names = [s.name for s in meta.sets]
    assert names == sorted(names) and names[:3] == ["set.000", "set.001", "set.002"]
    assert meta.nframes == 12 and meta.natoms == 4 and meta.pbc
    assert meta.sets[0].width("force") == 12 and meta.sets[0].width("energy") == 1
    assert pickle.loads(pickle.dumps(meta)) == meta


def test_set_order_is_string_order_like_deepmd(tmp_path):
    addr = make_system(tmp_path, nframes=3, nsets=1)
    os.rename(os.path.join(addr, "set.000"), os.path.join(addr, "set.10"))
    make_system(tmp_path, "other", nframes=2)
    os.rename(os.path.join(tmp_path, "other", "set.000"), os.path.join(addr, "set.2"))
    assert [s.name for s in build_system_meta(addr).sets] == ["set.10", "set.2"]


def test_build_reads_headers_not_arrays(tmp_path, monkeypatch):
    addr = make_system(tmp_path, natoms=50, nframes=40, nsets=2)
    loads, read_sizes, opened = [], [], []
    monkeypatch.setattr(np, "load", lambda *a, **k: loads.append(a) or None)
    monkeypatch.setattr(builtins, "open", lambda *a, **k: opened.append(a))  # never used
    for name in ("read", "pread"):
        real = getattr(os, name)

        def spy(*args, _real=real):
            data = _real(*args)
            read_sizes.append(len(data))
            return data
        monkeypatch.setattr(os, name, spy)
    meta = build_system_meta(addr)
    assert meta.nframes == 40 and not loads and not opened
    assert 0 < max(read_sizes) < 1000  # no array body was read (coord alone is 40*150*4 bytes)


BROKEN_CASES = [
    ("no_sets", MissingDataError, r"no set\.\* is found", "set.*"),
    ("no_coord", MissingDataError, r"the set has no coord\.npy", "coord.npy"),
    ("no_box", MissingDataError, r"a periodic system needs box\.npy", "box.npy"),
    ("frame_mismatch", ShapeError, r"frame counts disagree within set\.000.*expected: 5 frames; "
                                   r"found: 4 frames", "energy.npy"),
    ("bad_width", ShapeError, r"per-frame width of force\.npy does not match.*expected: 18",
     "force.npy"),
    ("type_outside_map", TypeMapError, r"type\.raw holds a type id outside type_map\.raw",
     "type.raw"),
    ("empty_type", DataError, r"the system has no atoms", "type.raw"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("broken,exc,message,file", BROKEN_CASES)
def test_broken_systems_name_system_and_file(tmp_path, backend, broken, exc, message, file):
    addr = make_system(tmp_path, natoms=6, broken=broken, backend=backend)
    with pytest.raises(exc, match=message) as info:
        build_system_meta(addr)
    err = info.value
    assert err.system == addr and err.file.endswith(file)
    assert f"system: {addr}" in str(err) and f"file: {err.file}" in str(err)


@pytest.mark.parametrize("broken,message", [
    ("corrupt_header", r"cannot read the npy header"),
    ("truncated", r"shorter than its header says \(truncated\).*found: \d+ bytes"),
])
def test_corrupt_npy(tmp_path, broken, message):
    addr = make_system(tmp_path, broken=broken)
    with pytest.raises(CorruptFileError, match=message) as info:
        build_system_meta(addr)
    assert info.value.file.endswith(os.path.join("set.000", "coord.npy"))


def test_mixed_and_plain_sets_disagree(tmp_path):
    addr = make_system(tmp_path, nsets=2, nframes=4, mixed_type=True, broken="mixed_sets")
    with pytest.raises(DataError, match=r"either every set of a system is mixed type"):
        build_system_meta(addr)


def test_elements_missing_from_model_type_map(tmp_path):
    addr = make_system(tmp_path, type_map=("O", "H"))
    with pytest.raises(TypeMapError,
                       match=r"Elements \['H'\] are not present in the provided type_map"):
        build_system_meta(addr, type_map=["O", "C"])


def test_type_ids_beyond_model_type_map_without_type_map_raw(tmp_path):
    addr = make_system(tmp_path, type_map=None, types=[0, 1, 2, 0, 1, 2])
    with pytest.raises(TypeMapError, match=r"outside the model type_map.*found: id 2"):
        build_system_meta(addr, type_map=["O", "H"])


def test_mixed_type_needs_a_type_map(tmp_path):
    addr = make_system(tmp_path, mixed_type=True, type_map=None)
    with pytest.raises(DataError, match=r"mixed-type system needs type_map\.raw"):
        build_system_meta(addr)


def test_no_frames(tmp_path):
    addr = make_system(tmp_path, nframes=0)
    with pytest.raises(DataError, match=r"the system has no frames"):
        build_system_meta(addr)


def test_missing_system_and_not_hdf5(tmp_path):
    with pytest.raises(MissingDataError, match=r"does not exist"):
        build_system_meta(str(tmp_path / "nothing"))
    bogus = tmp_path / "fake.h5"
    bogus.write_text("not hdf5")
    with pytest.raises(CorruptFileError, match=r"cannot open the file as HDF5") as info:
        build_system_meta(str(bogus))
    assert info.value.file == str(bogus)


def test_requirement_checked_against_headers_when_added(tmp_path):
    ds = DeepmdDataSetForLoader(make_system(tmp_path, natoms=4, keys=("energy",)))
    with pytest.raises(MissingDataError, match=r"a required key is missing: force"):
        ds.add_data_requirement([Req("force", 3, atomic=True, must=True)])
    with pytest.raises(ShapeError, match=r"width of energy\.npy does not match.*expected: 3"):
        ds.add_data_requirement([Req("energy", 3)])


def test_type_map_without_model_map_and_ntypes(tmp_path):
    meta = build_system_meta(make_system(tmp_path, type_map=None, types=[0, 2, 2]))
    assert meta.type_map is None and meta.ntypes == 3
    assert meta.natoms_vec().tolist() == [3, 3, 1, 0, 2]


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_header_versions_and_byte_orders(tmp_path, version):
    addr = make_system(tmp_path, natoms=2, nframes=3)
    force = np.arange(18, dtype=">f8").reshape(3, 6)
    with open(os.path.join(addr, "set.000", "force.npy"), "wb") as fh:
        np.lib.format.write_array(fh, np.asfortranarray(force), version=version)
    meta = build_system_meta(addr)
    assert meta.sets[0].width("force") == 6
    ds = DeepmdDataSetForLoader(meta)
    ds.add_data_requirement([Req("force", 3, atomic=True)])
    np.testing.assert_array_equal(ds[2]["force"].reshape(-1), force[2])


def test_many_descriptions_pickle_compactly_and_round_trip(tmp_path):
    """Siblings share their folder, set descriptions and type map in one pickle stream."""
    metas = [build_system_meta(make_system(tmp_path, f"sys.{i:03d}", natoms=6, nframes=20,
                                           seed=i)) for i in range(200)]
    metas.append(build_system_meta(make_system(tmp_path, "", backend="hdf5", h5_file="r.h5")))
    blob = pickle.dumps(metas)
    assert len(blob) / len(metas) < 60, len(blob) / len(metas)  # 6 B of types + a name
    clone = pickle.loads(blob)
    assert clone == metas and clone[-1].address.endswith("r.h5#/")
    assert clone[0].sets is clone[1].sets  # shared after unpickling too


def test_a_description_knows_its_location_without_the_registry(tmp_path):
    """The location follows from the address and the format's name, as parsing the address
    gives it, for every built-in format, and survives a pickle."""
    npy = make_system(tmp_path, "npy_sys")
    h5 = make_system(tmp_path, "grp", backend="hdf5", h5_file="d.h5")
    make_system(tmp_path, "", backend="hdf5", h5_file="root.h5")
    db = make_lmdb(tmp_path / "d.lmdb", [make_system(tmp_path / "src", "s0")])
    for address in (npy, h5, str(tmp_path / "root.h5"), group_addresses(db)[0]):
        meta = build_system_meta(address)
        assert meta.location == parse_address(meta.address)
        assert meta.backend == meta.location.backend
        clone = pickle.loads(pickle.dumps(meta))
        assert clone.location == meta.location and clone == meta
    assert [build_system_meta(a).backend for a in (npy, h5, group_addresses(db)[0])] == [
        "npy", "hdf5", "lmdb"]


@pytest.mark.parametrize("shape,frames,expected", [
    ((100, 162), None, (100, 162, False)),    # coord.npy gives the frames
    ((162,), None, (1, 162, False)),          # a one-frame set may store 1-D
    ((100, 54), 100, (100, 54, False)),
    ((100,), 100, (100, 1, False)),           # energy.npy stored 1-D
    ((100, 6, 9), 100, (100, 54, False)),
    ((1, 5400), 100, (100, 54, True)),        # DeePMD-kit's examples/fparam aparam.npy
    ((5400,), 100, (100, 54, True)),
    ((54,), 1, (1, 54, False)),               # 1-D in a one-frame set: not "flat"
    ((), 1, (1, 1, False)),
    ((2, 9), 4, (2, 9, None)),                # 18 values for 4 frames: the frames disagree
    ((99, 1), 100, (99, 1, None)),
])
def test_frames_and_width_follow_deepmd_reshape(shape, frames, expected):
    from mdloader.data.layout import frames_and_width, stored_flat

    got = frames_and_width(shape, frames)
    assert got == expected[:2]
    if frames is not None and expected[2] is not None:
        assert stored_flat(shape, frames) is expected[2]
