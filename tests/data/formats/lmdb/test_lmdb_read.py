"""LMDB databases read as systems: grouping, frames identical to DeePMD-kit 3.2.0's reader (run
in its own interpreter), the npy source round trip, and every build-time and read-time error."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.deepmd_env import require_deepmd_python

from mdloader.catalog.discover import discover_systems
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats.lmdb import metadata as lmdb_metadata
from mdloader.data.schema import DataRequirementItem
from mdloader.errors import DataError
from mdloader.testing import make_lmdb, make_system

HERE = Path(__file__).resolve().parents[3]
MODEL_MAP = ["H", "C", "O", "N"]  # differs from every database's own order: types are remapped
REQS = [dict(key="energy", ndof=1, high_prec=True), dict(key="force", ndof=3, atomic=True),
        dict(key="virial", ndof=9), dict(key="fparam", ndof=2, must=True),
        dict(key="aparam", ndof=2, atomic=True)]


def _sources(root: Path, *, mixed: bool = True) -> list[str]:
    """pbc (unsorted O/H, aparam), nopbc without virial, and a mixed-type system with virtual
    atoms (two atom counts in one source system); every one has fparam."""
    rng = np.random.default_rng(0)
    out = [make_system(root, "a_pbc", types=[1, 0, 1, 1, 0, 1], nframes=5, seed=1,
                       extra_keys={"fparam": rng.normal(size=(5, 2)),
                                   "aparam": rng.normal(size=(5, 12))}),
           make_system(root, "b_nopbc", types=[2, 1, 1, 1, 1], nframes=3, pbc=False, seed=2,
                       type_map=["O", "H", "C"], keys=("energy", "force"),
                       extra_keys={"fparam": rng.normal(size=(3, 2))})]
    if mixed:
        real = np.array([[3, 1, 1, 1, 1, -1, -1], [3, 1, 1, 1, 1, -1, -1],
                         [2, 3, 1, 1, 1, 1, 1], [3, 1, 1, 1, 1, -1, -1]])
        out.append(make_system(root, "c_mixed", natoms=7, nframes=4, mixed_type=True, seed=3,
                               type_map=["O", "H", "C", "N"],
                               extra_keys={"real_atom_types": real,
                                           "fparam": rng.normal(size=(4, 2))}))
    return out


def _reqs(prec_keys: list[dict[str, Any]] = REQS) -> list[DataRequirementItem]:
    return [DataRequirementItem(**r) for r in prec_keys]


def _ours(db: str) -> dict[int, dict[str, Any]]:
    """Every frame of the database through mdloader's groups, by frame index."""
    frames = {}
    for address in discover_systems(db):
        ds = DeepmdDataSetForLoader(address, MODEL_MAP)
        ds.add_data_requirement(_reqs())
        for frame in ds.get_frames(list(range(len(ds)))):
            frames[frame["fid"]] = frame
    return frames


def _reference(db: str, tmp: Path, prec: str = "high") -> dict[str, Any]:
    python = require_deepmd_python()
    out = tmp / f"ref-{prec}.pkl"
    env = dict(os.environ, DP_INTERFACE_PREC=prec, OMP_NUM_THREADS="1")
    script = HERE / "support" / "lmdb_reference.py"
    proc = subprocess.run([python, str(script), db, json.dumps(MODEL_MAP),
                           json.dumps(REQS), str(out)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, "rb") as fh:
        return pickle.load(fh)


def assert_same_frame(ours: dict[str, Any], ref: dict[str, Any]) -> None:
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    for key, want in ref.items():
        got = ours[key]
        if isinstance(want, np.ndarray):
            assert (got.dtype, got.shape) == (want.dtype, want.shape), key
            np.testing.assert_array_equal(got, want, err_msg=key)
        else:
            assert type(got) is type(want) and got == want, (key, got, want)


# -- grouping ---------------------------------------------------------------------------------
def test_groups_follow_system_ids_then_atom_counts(tmp_path: Path) -> None:
    db = make_lmdb(tmp_path / "d.lmdb", _sources(tmp_path / "src"))
    names = [a.rpartition("#")[2] for a in discover_systems(db)]
    assert names == ["system=0,natoms=6", "system=1,natoms=5", "system=2,natoms=5",
                     "system=2,natoms=7"]
    sizes = [len(DeepmdDataSetForLoader(a, MODEL_MAP)) for a in discover_systems(db)]
    assert sizes == [5, 3, 3, 1]
    # a folder holding data.mdb is a database too, and a group address is an entry of its own
    os.rename(db, tmp_path / "plain")
    found = discover_systems([str(tmp_path / "plain"), f"{tmp_path}/plain#system=2,natoms=7"])
    assert found[3:] == [f"{tmp_path}/plain#system=2,natoms=7"] * 2 and len(found) == 5


def test_without_system_ids_groups_are_atom_counts(tmp_path: Path) -> None:
    db = make_lmdb(tmp_path / "d.lmdb", _sources(tmp_path / "src"),
                   drop_metadata=["frame_system_ids"])
    assert [a.rpartition("#")[2] for a in discover_systems(db)] == [
        "natoms=5", "natoms=6", "natoms=7"]
    assert len(DeepmdDataSetForLoader(f"{db}#natoms=5", MODEL_MAP)) == 6


# -- frames identical to DeePMD-kit's LmdbDataReader ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("writer", ["mdloader", "dpdata"])
@pytest.mark.parametrize("prec", ["high", "low"])
def test_frames_identical_to_deepmd_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           writer: str, prec: str) -> None:
    sources = _sources(tmp_path / "src", mixed=writer == "mdloader")
    db = make_lmdb(tmp_path / "d.lmdb", sources, writer=writer)
    monkeypatch.setenv("DP_INTERFACE_PREC", prec)
    ref = _reference(db, tmp_path, prec)
    ours = _ours(db)
    assert sorted(ours) == list(range(ref["nframes"]))
    for index, frame in enumerate(ref["frames"]):
        assert_same_frame(ours[index], frame)
    if prec == "low":
        assert ours[0]["coord"].dtype == np.float32 and ours[0]["energy"].dtype == np.float64


@pytest.mark.slow
def test_without_frame_nlocs_rank0_scans_once_and_frames_agree(tmp_path: Path) -> None:
    db = make_lmdb(tmp_path / "d.lmdb", _sources(tmp_path / "src"), drop_metadata=["frame_nlocs"])
    before = lmdb_metadata.scanned_frames()
    addresses = discover_systems(db)
    assert lmdb_metadata.scanned_frames() - before == 12
    for address in addresses:  # describing every group reuses the index: no second scan
        DeepmdDataSetForLoader(address, MODEL_MAP)
    assert lmdb_metadata.scanned_frames() - before == 12
    ref = _reference(db, tmp_path)
    ours = _ours(db)
    for index, frame in enumerate(ref["frames"]):
        assert_same_frame(ours[index], frame)


# -- the npy source, everywhere ---------------------------------------------------------------
def _by_type(frame: dict[str, Any]) -> dict[str, np.ndarray]:
    """Atoms of an LMDB frame sorted by type, as the npy reader sorts them."""
    order = np.argsort(frame["atype"], kind="stable")
    return {k: np.asarray(frame[k])[order] for k in ("atype", "coord", "force", "aparam")}


@pytest.mark.parametrize("writer", ["mdloader", "dpdata"])
def test_round_trip_against_the_npy_source(tmp_path: Path, writer: str) -> None:
    sources = _sources(tmp_path / "src", mixed=writer == "mdloader")
    db = make_lmdb(tmp_path / "d.lmdb", sources, writer=writer)
    ours = _ours(db)
    start = 0
    for source in sources:
        npy = DeepmdDataSetForLoader(source, MODEL_MAP)
        npy.add_data_requirement(_reqs())
        for j, want in enumerate(npy.get_frames(list(range(len(npy))))):
            got = ours[start + j]
            real = np.asarray(want["atype"]) >= 0  # virtual atoms are not stored
            if npy.mixed_type:
                np.testing.assert_array_equal(got["atype"], want["atype"][real])
                np.testing.assert_allclose(got["coord"], want["coord"][real], rtol=1e-6)
            else:
                sorted_got = _by_type(got)
                for key in ("atype", "coord", "force", "aparam"):
                    np.testing.assert_allclose(sorted_got[key], want[key], rtol=1e-6, err_msg=key)
            for key in ("energy", "virial", "fparam", "find_virial", "find_aparam"):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
            assert ("box" in got) == (want["box"] is not None)
            if "box" in got:
                np.testing.assert_allclose(got["box"], want["box"], rtol=1e-6)
        start += len(npy)
    assert start == len(ours)


def test_batches_stack_frames_and_and_reduce_flags(tmp_path: Path) -> None:
    db = make_lmdb(tmp_path / "d.lmdb", _sources(tmp_path / "src"))
    ds = DeepmdDataSetForLoader(f"{db}#system=1,natoms=5", MODEL_MAP)
    ds.add_data_requirement(_reqs())
    batch = ds.get_batch([2, 0])
    frames = ds.get_frames([2, 0])
    assert batch["box"] is None and batch["fid"] == [f["fid"] for f in frames]
    assert tuple(batch["coord"].shape) == (2, 5, 3) and batch["find_virial"] == 0.0
    np.testing.assert_array_equal(batch["force"].numpy(), np.stack([f["force"] for f in frames]))
    assert str(batch["coord"].device) == "cpu"


def test_a_batch_mixing_periodic_and_molecular_frames_is_an_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    db = make_lmdb(tmp_path / "d.lmdb", [make_system(src, "p", natoms=4, nframes=2),
                                         make_system(src, "m", natoms=4, nframes=2, pbc=False)],
                   drop_metadata=["frame_system_ids"])
    ds = DeepmdDataSetForLoader(f"{db}#natoms=4", ["O", "H"])
    assert len(ds.get_batch([0, 1])["box"]) == 2 and ds.get_batch([2, 3])["box"] is None
    with pytest.raises(DataError, match=r"a batch mixes periodic frames \(with cells\) and "
                                        r"non-periodic ones: frames \[1\] and \[2\]"):
        ds.get_batch([1, 2])


@pytest.mark.parametrize("writer", ["mdloader", "dpdata"])
def test_stacked_batches_equal_frame_by_frame_collation(tmp_path: Path, writer: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stacked fast path gives what decoding each frame and collating gives, with defaults,
    repeats, the "default" policy and a type remap."""
    from mdloader.data.formats.lmdb import stacked as lmdb_batch

    db = make_lmdb(tmp_path / "d.lmdb", _sources(tmp_path / "src", mixed=writer == "mdloader"),
                   writer=writer)
    extra = _reqs() + [DataRequirementItem("atom_pref", 1, atomic=True, repeat=3, default=2.0),
                       DataRequirementItem("spin", 3, atomic=True, source_policy="default")]
    stacked = lmdb_batch.stacked_batch
    taken: list[bool] = []

    def spy(*args: Any) -> Any:
        batch = stacked(*args)
        taken.append(batch is not None)
        return batch

    for address in discover_systems(db):
        ds = DeepmdDataSetForLoader(address, MODEL_MAP)
        ds.add_data_requirement(extra)
        fids = list(range(len(ds)))[::-1]
        with monkeypatch.context() as m:
            m.setattr(lmdb_batch, "stacked_batch", spy)
            fast = ds.get_batch(fids)
        assert taken.pop() and not taken  # the fast path was taken, once
        with monkeypatch.context() as m:
            m.setattr(lmdb_batch, "stacked_batch", lambda *a: None)
            slow = ds.get_batch(fids)
        assert fast.keys() == slow.keys()
        for key, want in slow.items():
            got = fast[key]
            if hasattr(want, "numpy"):
                assert got.dtype == want.dtype and got.shape == want.shape, key
                np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=key)
            else:
                assert type(got) is type(want) and got == want, key
