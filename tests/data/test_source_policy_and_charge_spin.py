"""DeePMD-kit 3.2's ``source_policy`` field of a data requirement and its ``charge_spin`` label,
read by mdloader as DeePMD-kit's own readers read them, on real files.

DeePMD-kit's trainer asks for ``charge_spin`` (two values per frame: total charge and spin
multiplicity) when the model embeds them, with ``source_policy="default"`` when the model has a
default (a system without ``charge_spin.npy`` is filled with it) and ``"tracked"`` otherwise.
npy and HDF5 are read by DeePMD-kit's ``DeepmdData``, which keeps the policy without
interpreting it (a default-filled label has ``find_charge_spin`` 0); its LMDB reader interprets
it (a ``"default"`` fill counts as found, 1). Each is compared with DeePMD-kit's reader's frames.
"""

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
from mdloader.data.schema import DataRequirementItem
from mdloader.testing import make_lmdb, make_system

HERE = Path(__file__).resolve().parents[1]
TYPE_MAP = ["O", "H"]
POLICIES = ("default", "tracked")


def _requirements(policy: str) -> list[dict[str, Any]]:
    return [{"key": "energy", "ndof": 1, "atomic": False, "must": False, "high_prec": True},
            {"key": "force", "ndof": 3, "atomic": True, "must": False},
            {"key": "charge_spin", "ndof": 2, "atomic": False, "must": False,
             "default": [0.0, 1.0] if policy == "default" else 0.0, "source_policy": policy},
            {"key": "fparam", "ndof": 1, "atomic": False, "must": False, "default": 0.5,
             "source_policy": policy}]


def _systems(root: Path, backend: str) -> list[str]:
    """Two systems with ``charge_spin`` and ``fparam`` (one of two sets), one without."""
    rng = np.random.default_rng(3)
    labelled = {"charge_spin": np.c_[rng.integers(-2, 3, 6), rng.integers(1, 4, 6)]
                .astype(np.float64), "fparam": rng.normal(size=(6, 1))}
    return [make_system(root, "with", natoms=5, nframes=6, nsets=2, backend=backend,
                        h5_file="with.h5", keys=("energy", "force"), extra_keys=labelled,
                        seed=1),
            make_system(root, "without", natoms=4, nframes=3, backend=backend,
                        h5_file="without.h5", keys=("energy", "force"), seed=2)]


def _deepmd(script: str, args: list[str], tmp: Path) -> Any:
    out = tmp / f"ref-{len(list(tmp.glob('ref-*')))}.pkl"
    proc = subprocess.run([require_deepmd_python(), str(HERE / "support" / script), *args,
                           str(out)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, "rb") as fh:
        return pickle.load(fh)


def _ours(address: str, policy: str) -> DeepmdDataSetForLoader:
    data = DeepmdDataSetForLoader(address, TYPE_MAP)
    data.add_data_requirement([DataRequirementItem(**r) for r in _requirements(policy)])
    return data


def _assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The labels and their ``find_`` flags: values, dtypes and shapes."""
    for key in ("energy", "force", "charge_spin", "fparam"):
        for name in (key, f"find_{key}"):
            got, want = np.asarray(ours[name]), np.asarray(theirs[name])
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["npy", "hdf5"])
@pytest.mark.parametrize("policy", POLICIES)
def test_npy_and_hdf5_read_charge_spin_and_source_policy_as_deepmd_kit(
        tmp_path: Path, backend: str, policy: str) -> None:
    systems = _systems(tmp_path / "data", backend)
    theirs = _deepmd("npy_reference.py", [json.dumps(systems), json.dumps(TYPE_MAP),
                                          json.dumps(_requirements(policy))], tmp_path)
    for system, frames in zip(systems, theirs):
        ours = _ours(system, policy)
        assert len(ours) == len(frames)
        for fid, frame in enumerate(frames):
            _assert_same(ours[fid], frame)
    missing = _ours(systems[1], policy)[0]
    assert missing["find_charge_spin"] == 0.0  # DeePMD-kit's DeepmdData: the policy is kept only
    expected = [0.0, 1.0] if policy == "default" else [0.0, 0.0]
    np.testing.assert_array_equal(missing["charge_spin"], expected)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_lmdb_reads_charge_spin_and_source_policy_as_deepmd_kit(tmp_path: Path,
                                                                policy: str) -> None:
    db = make_lmdb(tmp_path / "d.lmdb", _systems(tmp_path / "src", "npy"), type_map=TYPE_MAP)
    ref = _deepmd("lmdb_reference.py", [db, json.dumps(TYPE_MAP),
                                        json.dumps(_requirements(policy))], tmp_path)
    ours: dict[int, dict[str, Any]] = {}
    for address in discover_systems(db):
        data = _ours(address, policy)
        for frame in data.get_frames(list(range(len(data)))):
            ours[int(frame["fid"])] = frame
    assert sorted(ours) == list(range(ref["nframes"]))
    for index, frame in enumerate(ref["frames"]):
        _assert_same(ours[index], frame)
    flags = {float(f["find_charge_spin"]) for f in ref["frames"] if len(f["atype"]) == 4}
    assert flags == {1.0 if policy == "default" else 0.0}  # LMDB interprets the policy
