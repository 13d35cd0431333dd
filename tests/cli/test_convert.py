"""mdloader convert: dpdata formats in, DeePMD npy / HDF5 out, clear errors."""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mdloader.cli.convert import check_format, convert, readable_formats
from mdloader.cli.main import main
from mdloader.errors import ConfigError, DataError, MissingDataError

FRAME = """3
Lattice="10.0 0.0 0.0 0.0 10.0 0.0 0.0 0.0 10.0" Properties=species:S:1:pos:R:3:forces:R:3 \
energy={e} pbc="T T T"
O 0.0 0.0 {z} 0.1 0.2 0.3
H 0.96 0.0 0.0 -0.1 0.0 0.0
H -0.24 0.93 0.0 0.0 -0.2 -0.3
"""


def _extxyz(tmp_path: Path, nframes: int = 3) -> Path:
    path = tmp_path / "water.xyz"
    path.write_text("".join(FRAME.format(e=-10.0 - i, z=0.01 * i) for i in range(nframes)))
    return path


def test_extxyz_to_npy(tmp_path: Path) -> None:
    report = convert(str(_extxyz(tmp_path)), str(tmp_path / "out"), fmt="extxyz")
    assert report.systems == (str(tmp_path / "out" / "H2O1"),)
    assert (report.nframes, report.natoms, report.labeled) == ((3,), (3,), True)
    sys_dir = tmp_path / "out" / "H2O1"
    assert (sys_dir / "type_map.raw").read_text().split() == ["H", "O"]
    energy = np.load(sys_dir / "set.000" / "energy.npy")
    np.testing.assert_allclose(np.sort(energy.ravel()), [-12.0, -11.0, -10.0])
    assert np.load(sys_dir / "set.000" / "force.npy").shape == (3, 9)


def test_extxyz_to_hdf5_with_type_map(tmp_path: Path) -> None:
    dest = tmp_path / "out.h5"
    report = convert(str(_extxyz(tmp_path)), str(dest), fmt="extxyz", to="deepmd/hdf5",
                     type_map=["O", "H"])
    assert report.systems == (f"{dest}#/O1H2",)
    with h5py.File(dest) as fh:
        assert [t.decode() for t in fh["O1H2/type_map.raw"][()]] == ["O", "H"]
        assert fh["O1H2/set.000/coord.npy"].shape == (3, 9)


def test_npy_to_hdf5_keeps_every_frame(tmp_path: Path, water_data: Path) -> None:
    src = water_data / "data_1"  # two sets of 80 frames
    dest = tmp_path / "w.h5"
    report = convert(str(src), str(dest), fmt="deepmd/npy", to="deepmd/hdf5", set_size=100)
    assert report.systems == (f"{dest}#/",) and report.nframes == (160,)
    with h5py.File(dest) as fh:
        assert sorted(k for k in fh if k.startswith("set.")) == ["set.000", "set.001"]
        coord = np.concatenate([fh["set.000/coord.npy"][()], fh["set.001/coord.npy"][()]])
    original = np.concatenate([np.load(src / s / "coord.npy") for s in ("set.000", "set.001")])
    np.testing.assert_allclose(coord, original, rtol=1e-6)


def test_formats_come_from_dpdata() -> None:
    kinds = readable_formats()
    for name in ("vasp/outcar", "lammps/dump", "extxyz", "deepmd/npy", "deepmd/hdf5"):
        assert name in kinds
    assert check_format("VASP/OUTCAR") == kinds["vasp/outcar"]


def test_unknown_format_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"^--from: unknown input format 'extxyzz' \(did you "
                       r"mean extxyz.*\); dpdata reads: .*lammps/dump.*vasp/outcar"):
        check_format("extxyzz")


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--to: unknown output format 'lmdb': expected one "
                       r"of deepmd/npy, deepmd/hdf5$"):
        convert("x", "y", fmt="extxyz", to="lmdb")
    with pytest.raises(ConfigError, match=r"^--set-size: must be a positive integer, got 0$"):
        convert("x", "y", fmt="extxyz", set_size=0)
    with pytest.raises(MissingDataError, match=r"^the input to convert does not exist \(nor files "
                                               r"it is the prefix of\); file: "):
        convert(str(tmp_path / "nope"), str(tmp_path / "o"), fmt="vasp/outcar")


def test_unreadable_input_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "OUTCAR"
    bad.write_text("this is not an OUTCAR\n")
    with pytest.raises(DataError, match=r"file: .*OUTCAR"):
        convert(str(bad), str(tmp_path / "o"), fmt="vasp/outcar")
    garbage = tmp_path / "bad.xyz"
    garbage.write_text("3\nno lattice here\nO 0 0\n")
    with pytest.raises(DataError, match=r"^dpdata could not read the input as 'extxyz': .*; "
                       r"file: .*bad\.xyz$"):
        convert(str(garbage), str(tmp_path / "o2"), fmt="extxyz")


def test_cli_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _extxyz(tmp_path, 2)
    assert main(["convert", str(src), str(tmp_path / "o"), "--from", "extxyz"]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'o' / 'H2O1'}\t2 frames\t3 atoms"
    assert main(["convert", str(src), str(tmp_path / "o"), "--from", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mdloader: error: --from: unknown input format 'nope'")
    assert "Traceback" not in err
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "o"),
                 "--from", "extxyz"]) == 1
    assert "does not exist" in capsys.readouterr().err
