"""Cells that hold no volume (an all-zero box) or are too small for the cutoff, in every format:
``check --deep`` lists them, the box check before training names the system, file and frame,
LMDB frames (boxes read with the frames) are refused when read, and a step that draws a box too
small names the system and entry instead of "found: nan A"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mdloader.cli.check import check_input, config_for_paths
from mdloader.errors import DataError
from mdloader.loading.build import build_systems
from mdloader.loading.loader import DpLoaderSet
from mdloader.testing import make_lmdb, make_system
from mdloader.train.guards import check_boxes
from mdloader.train.job import LABELS
from mdloader.train.model import RadialPotential
from mdloader.train.step import Stepper
from mdloader.world import World


def _npy(tmp_path: Path, frames: list[int], box: np.ndarray | None = None) -> tuple[str, Path]:
    """A 4-frame periodic npy system whose ``frames`` get ``box`` (default all zero)."""
    address = make_system(tmp_path / "src", "s", natoms=4, nframes=4, keys=("energy", "force"))
    path = Path(address) / "set.000" / "box.npy"
    cells = np.load(path)
    cells[frames] = np.zeros(9) if box is None else box
    np.save(path, cells)
    return address, path


def _system(tmp_path: Path, fmt: str, frames: list[int],
            box: np.ndarray | None = None) -> tuple[str, str]:
    """(the system's address in ``fmt``, what names the file holding frame ``frames[0]``)."""
    address, path = _npy(tmp_path, frames, box)
    if fmt == "npy":
        return address, str(path)
    if fmt == "hdf5":
        import h5py

        h5 = make_system(tmp_path, "s", natoms=4, nframes=4, keys=("energy", "force"),
                         backend="hdf5", h5_file="d.h5")
        with h5py.File(h5.partition("#")[0], "a") as fh:
            fh["s/set.000/box.npy"][...] = np.load(path)
        return h5, f"{h5}/set.000/box.npy"
    db = make_lmdb(tmp_path / "d.lmdb", [address])
    return f"{db}#system=0,natoms=4", f"{db}/data.mdb[{frames[0]:012d}]"


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "lmdb"])
@pytest.mark.parametrize("frames", [[1], [0, 1, 2, 3]])
def test_check_deep_lists_cells_of_volume_zero(tmp_path: Path, fmt: str,
                                               frames: list[int]) -> None:
    """Before: heights 0/0 = NaN passed ``NaN < 2 rcut``, and ``check --deep`` said OK."""
    address, where = _system(tmp_path, fmt, frames)
    report = check_input(config_for_paths([address], type_map=["O", "H"]), deep=True)
    (problem,) = report.problems
    assert "a box of volume 0 (degenerate cell)" in problem.message
    assert f"{len(frames)} frame(s)" in problem.message
    assert (address if fmt == "lmdb" else where) in problem.message
    assert str(frames) in problem.message or f"ids {frames[0]}" in problem.message


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_the_box_check_before_training_refuses_a_cell_of_volume_zero(tmp_path: Path,
                                                                   fmt: str) -> None:
    address, where = _system(tmp_path, fmt, [2])
    systems = build_systems([address], ["O", "H"])
    with pytest.raises(DataError, match=r"^the box of frame 2 encloses no volume \(a degenerate "
                       rf"cell\); 1 frame\(s\) of this set; system: {address}; file: {where}; "
                       r"expected: a cell of volume > 0; found: box \[0\.0, .*\]$"):
        check_boxes(systems, 1.0, World())


def test_the_box_check_refuses_a_flat_cell(tmp_path: Path) -> None:
    """Two parallel edges: volume 0 but no zero entry."""
    flat = np.array([[5.0, 0, 0], [10.0, 0, 0], [0, 0, 5.0]]).reshape(9)
    address, where = _system(tmp_path, "npy", [0], flat)
    with pytest.raises(DataError, match=rf"^the box of frame 0 encloses no volume .*file: "
                       rf"{where}"):
        check_boxes(build_systems([address], ["O", "H"]), 1.0, World())


def test_an_lmdb_frame_with_a_cell_of_volume_zero_is_refused_when_read(tmp_path: Path) -> None:
    address, entry = _system(tmp_path, "lmdb", [1])
    ls = DpLoaderSet([address], 2, ["O", "H"], seed=0)
    message = (r"^the box of frame 1 encloses no volume \(a degenerate cell\); system: "
               rf"{address}; file: {entry.replace('[', '.').replace(']', '.')}")
    with pytest.raises(DataError, match=message):
        ls.systems[0][1]
    with pytest.raises(DataError, match=message):  # the stacked batch path too
        ls.systems[0].get_batch([0, 1])
    ls.systems[0].get_batch([2, 3])


def test_a_step_that_draws_a_box_too_small_names_the_system_and_entry(tmp_path: Path) -> None:
    """LMDB boxes are checked against the cutoff at the step that draws them; the model alone
    knew neither the system nor the file."""
    address, entry = _system(tmp_path, "lmdb", [1], np.diag([4.0, 9.0, 9.0]).reshape(9))
    ls = DpLoaderSet([address], 4, ["O", "H"], seed=0)
    ls.add_data_requirement(LABELS)
    model = RadialPotential(2, rcut=2.5, nbasis=4, hidden=(8,))
    stepper = Stepper(model, model, torch.optim.SGD(model.parameters(), lr=0.1),
                      lambda pred, labels, lr: (pred["energy"].sum(), {"mse": 0.0}),
                      ls.systems, device=torch.device("cpu"))
    with pytest.raises(DataError, match=r"^the box is too small for the model cutoff .*; frame 1 "
                       rf"of the batch \[\d, \d, \d, \d\]; system: {address}; file: "
                       rf"{entry.replace('[', '.').replace(']', '.')}; expected: height >= 5 A; "
                       r"found: 4 A$"):
        stepper.step(ls[0], 0.1, 1, False)
