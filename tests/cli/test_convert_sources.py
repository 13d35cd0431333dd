"""``mdloader convert`` on real inputs that dpdata reads: one OUTCAR, a folder of OUTCARs, a QE
CP trajectory given by its prefix, DeePMD HDF5 files (``file.h5``, ``file.h5#/``, several
groups). The OUTCAR and the trajectory are dpdata's own test fixtures
(``tests/fixtures/NOTICE.md``);
each conversion is compared with what dpdata itself reads, or with mdloader's read of the source.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dpdata
import numpy as np
import pytest

from mdloader import DataRequirementItem, DeepmdDataSetForLoader
from mdloader.cli.convert import convert
from mdloader.cli.main import main
from mdloader.errors import MissingDataError
from mdloader.testing import make_system

REPO = Path(__file__).resolve().parents[2]
DPDATA = REPO / "tests" / "fixtures" / "dpdata-tests"
OUTCAR = DPDATA / "poscars" / "OUTCAR.Ge.vdw"
QE_TRAJ = DPDATA / "qe.traj" / "traj6"  # a prefix: traj6.pos, traj6.cel, traj6.for, ...
ROOT_H5 = REPO / "tests" / "fixtures" / "deepmd-tests" / "tf" / "test.hdf5"


def _energies(system_dir: Path) -> np.ndarray:
    return np.concatenate([np.load(p).reshape(-1)
                           for p in sorted(system_dir.glob("set.*/energy.npy"))])


def test_one_outcar_is_one_system(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(OUTCAR), str(tmp_path / "ge"), "--from", "vasp/outcar"]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'ge'}\t1 frames\t8 atoms\n"
    reference = dpdata.LabeledSystem(str(OUTCAR), fmt="vasp/outcar")
    np.testing.assert_allclose(_energies(tmp_path / "ge"), reference["energies"])


def test_a_folder_of_outcars_is_collected_by_composition(tmp_path: Path) -> None:
    for run in ("run_a", "run_b/deeper"):
        (tmp_path / "calc" / run).mkdir(parents=True)
        shutil.copy(OUTCAR, tmp_path / "calc" / run / "OUTCAR")
    report = convert(str(tmp_path / "calc"), str(tmp_path / "out"), fmt="vasp/outcar")
    assert len(report.systems) == 1 and report.nframes == (2,) and report.natoms == (8,)


def test_qe_cp_trajectory_given_by_its_prefix(tmp_path: Path) -> None:
    assert not QE_TRAJ.exists()  # only traj6.* exist: the prefix must be accepted
    report = convert(str(QE_TRAJ), str(tmp_path / "qe"), fmt="qe/cp/traj")
    reference = dpdata.LabeledSystem(str(QE_TRAJ), fmt="qe/cp/traj")
    assert report.nframes == (reference.get_nframes(),) and report.labeled
    np.testing.assert_allclose(_energies(tmp_path / "qe"), reference["energies"])
    with pytest.raises(MissingDataError, match=r"does not exist \(nor files it is the prefix "
                                               r"of\); file: .*traj7$"):
        convert(str(QE_TRAJ.with_name("traj7")), str(tmp_path / "none"), fmt="qe/cp/traj")


def _coords(address: str) -> np.ndarray:
    ds = DeepmdDataSetForLoader(address)
    return ds.get_batch(list(range(len(ds))))["coord"].numpy()


@pytest.mark.parametrize("suffix", ["", "#/"])
def test_deepmd_hdf5_root_system(tmp_path: Path, suffix: str) -> None:
    report = convert(f"{ROOT_H5}{suffix}", str(tmp_path / "npy"), fmt="deepmd/hdf5")
    assert report.systems == (str(tmp_path / "npy"),) and report.nframes == (1,)
    np.testing.assert_allclose(_coords(str(tmp_path / "npy")), _coords(f"{ROOT_H5}#/"),
                               rtol=1e-12)


def test_deepmd_hdf5_with_several_groups(tmp_path: Path) -> None:
    make_system(tmp_path, "small", natoms=3, nframes=4, backend="hdf5", h5_file="many.h5")
    make_system(tmp_path, "large", natoms=5, nframes=2, backend="hdf5", h5_file="many.h5",
                seed=1)
    report = convert(str(tmp_path / "many.h5"), str(tmp_path / "out"), fmt="deepmd/hdf5")
    assert sorted(zip(report.natoms, report.nframes)) == [(3, 4), (5, 2)]
    ds = DeepmdDataSetForLoader(report.systems[report.natoms.index(5)])
    ds.add_data_requirement([DataRequirementItem("energy", 1, must=True)])
    assert len(ds) == 2 and ds[0]["energy"].shape == (1,)
