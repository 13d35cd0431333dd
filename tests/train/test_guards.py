"""The reference job's guards, in one process (and the box check on 2 gloo ranks): non-finite
losses and weights, boxes too small for the cutoff, restarts that trim lcurve.out, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support.distributed_utils import errors, run_ranks
from support.inputs import write_input

from mdloader.config.input_json import parse_config
from mdloader.errors import ConfigError, DataError, NonFiniteError, StaleDataError
from mdloader.testing import make_system
from mdloader.train.guards import check_boxes, nonfinite_weights
from mdloader.train.io import Lcurve, load_checkpoint
from mdloader.train.job import LABELS, ModelOptions, train
from mdloader.train.model import RadialPotential
from mdloader.world import World

ROOT = Path(__file__).resolve().parents[2]
SMALL = ModelOptions(rcut=2.5, nbasis=4, hidden=(8,))


def _raw(tmp_path: Path, steps: int = 8, **training: object) -> dict:
    for i, n in enumerate((5, 7)):
        make_system(tmp_path / "data", f"sys{i}", natoms=n, nframes=6, seed=i,
                    keys=("energy", "force"))
    return {"model": {"type_map": ["O", "H"]},
            "training": {"training_data": {"systems": ["data/sys0", "data/sys1"],
                                           "batch_size": 2},
                         "numb_steps": steps, "seed": 7, "disp_freq": 1, "save_freq": 4,
                         **training}}


def _poison(tmp_path: Path, frames: list[int]) -> Path:
    path = tmp_path / "data" / "sys1" / "set.000" / "force.npy"
    forces = np.load(path)
    forces[frames] = np.nan
    np.save(path, forces)
    return path


def test_a_nan_label_stops_training_at_its_step(tmp_path: Path) -> None:
    cfg = parse_config(_raw(tmp_path), base_dir=str(tmp_path))
    path = _poison(tmp_path, [0, 1, 2, 3, 4, 5])
    with pytest.raises(NonFiniteError, match=r"^the loss is not finite \(nan\) at step (\d+) on "
                       r"rank 0: force holds NaN/inf in frames \[\d, \d\] of the batch; system: "
                       rf".*/sys1; file: {path}; found: batch frames \[\d, \d\]$") as info:
        train(cfg, output=str(tmp_path / "o"), num_workers=0, options=SMALL)
    step = int(info.value.message.split("at step ")[1].split()[0])
    lines = (tmp_path / "o" / "lcurve.out").read_text().splitlines()[1:]
    assert [int(line.split()[0]) for line in lines] == list(range(1, step))
    assert "nan" not in "".join(lines)  # DeePMD-kit writes nan and trains on


def test_skip_leaves_the_weights_finite_and_trains_on(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    cfg = parse_config(_raw(tmp_path, steps=12), base_dir=str(tmp_path))
    _poison(tmp_path, [3])
    with caplog.at_level("WARNING", logger="mdloader"):
        out = train(cfg, output=str(tmp_path / "o"), num_workers=1, options=SMALL,
                    nonfinite="skip")
    assert out.step == 12 and out.skipped  # every rank skipped those steps' updates
    assert all(sid == 1 and 3 in fids for step, sid, fids in out.batches
               if step + 1 in out.skipped)
    assert "skipped on every rank (--nonfinite skip): the loss is not finite" in caplog.text
    state = load_checkpoint(str(tmp_path / "o" / "model.ckpt-12.pt"))
    assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())
    with pytest.raises(ConfigError, match=r"^--nonfinite: must be one of \['stop', 'skip'\]"):
        train(cfg, output=str(tmp_path / "x"), num_workers=0, options=SMALL, nonfinite="ignore")


def test_no_checkpoint_with_non_finite_weights() -> None:
    model = RadialPotential(2, rcut=2.5, nbasis=4, hidden=(8,))
    assert nonfinite_weights(model, 3) is None
    with torch.no_grad():
        model.net[0].weight[0, 0] = float("inf")
    assert str(nonfinite_weights(model, 3)) == (
        "the weights are not finite after step 3 (net.0.weight): no checkpoint written; restart "
        "from the last one")


def _boxes(tmp_path: Path, small: int) -> list:
    from mdloader.loading.build import build_systems

    for i in range(4):
        make_system(tmp_path, f"sys{i}", natoms=4, nframes=3, nsets=1 + (i == small), seed=i)
    box = tmp_path / f"sys{small}" / "set.001" / "box.npy"
    cells = np.load(box)
    cells[-1] = np.diag([4.0, 9.0, 9.0]).reshape(9)  # one frame: a box 4 A high
    np.save(box, cells)
    return build_systems(str(tmp_path), ["O", "H"])


def test_every_box_is_checked_before_the_first_step(tmp_path: Path) -> None:
    """DeePMD-kit-style: found when training reaches the frame, possibly hours in."""
    systems = _boxes(tmp_path, small=3)
    check_boxes(systems, 1.9, World())
    with pytest.raises(DataError, match=rf"^the box of frame 2 is too small for the model cutoff "
                       rf"\(minimum image needs rcut <= half the smallest box height; 1 frame\(s\) "
                       rf"of this set\); system: {tmp_path}/sys3; file: {tmp_path}/sys3/set.001/"
                       r"box.npy; expected: height >= 5 A; found: 4 A$"):
        check_boxes(systems, 2.5, World())


def test_a_box_file_rewritten_after_the_build_is_named(tmp_path: Path) -> None:
    """Read with the width of the description: a stale file is an error naming it, not a
    reshape failure inside torch."""
    from mdloader.data.formats import release_handles

    systems = _boxes(tmp_path, small=3)
    release_handles()
    box = tmp_path / "sys1" / "set.000" / "box.npy"
    np.save(box, np.zeros((3, 6)))
    with pytest.raises(StaleDataError, match=rf"; file: {box}; expected: 3 frames of width 9; "
                       r"found: 3 frames of width 6"):
        check_boxes(systems, 1.9, World())


def _check_boxes_rank(rank: int, world: int, root: str) -> None:
    from mdloader.loading.build import build_systems

    check_boxes(build_systems(root, ["O", "H"]), 2.5, World(rank=rank, world_size=world))


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_the_box_check_is_shared_by_the_ranks_and_fails_them_together(tmp_path: Path) -> None:
    _boxes(tmp_path, small=3)  # system 3: checked by rank 1 of 2
    errs = errors(run_ranks(_check_boxes_rank, 2, str(tmp_path)))
    for err in errs:
        assert err.exc_type == "RemoteError"
        assert err.message.startswith("rank 1 failed (checking every box against the model "
                                      "cutoff): DataError: the box of frame 2 is too small")
        assert f"file: {tmp_path}/sys3/set.001/box.npy" in err.message


def test_a_restart_drops_the_lines_after_its_checkpoint(tmp_path: Path) -> None:
    """A run killed after its last checkpoint had written more lines; DeePMD-kit appends, so
    those steps appear twice after the restart."""
    cfg = parse_config(_raw(tmp_path), base_dir=str(tmp_path))
    full = train(cfg, output=str(tmp_path / "full"), num_workers=0, options=SMALL)
    again = train(cfg, output=str(tmp_path / "full"), num_workers=0, options=SMALL,
                  restart=str(tmp_path / "full" / "model.ckpt-4.pt"))
    assert full.step == again.step == 8
    steps = [line.split()[0] for line in
             (tmp_path / "full" / "lcurve.out").read_text().splitlines()[1:]]
    assert steps == [str(s) for s in range(1, 9)]
    curve = tmp_path / "c.out"
    Lcurve(str(curve), with_validation=False).close()
    curve.write_text(curve.read_text() + "      1   x\n      2   y\n     10   z\n")
    Lcurve(str(curve), with_validation=False, after=2).close()
    assert curve.read_text().splitlines()[1:] == ["      1   x", "      2   y"]


@pytest.mark.timeout(120)
def test_sigterm_stops_after_a_step_with_a_checkpoint_and_exit_143(tmp_path: Path) -> None:
    raw = _raw(tmp_path, steps=100000, save_freq=100000)
    write_input(tmp_path, raw)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mdloader", "train", "input.json", "--rcut",
                             "2.5", "--num-workers", "1", "-o", "out"], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, text=True)
    curve = tmp_path / "out" / "lcurve.out"
    try:
        while not (curve.exists() and len(curve.read_text().splitlines()) > 2):
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    step = int(err.split("stopped after step ")[1].split()[0])
    assert f"(SIGTERM): continue with --restart out/model.ckpt-{step}.pt" in err
    assert load_checkpoint(str(tmp_path / "out" / "model.ckpt.pt"))["step"] == step
    assert int(curve.read_text().splitlines()[-1].split()[0]) == step


def test_nan_in_the_frames_of_the_statistics_is_named_before_training(tmp_path: Path) -> None:
    """Otherwise a NaN energy bias makes every loss NaN, and the data looks innocent."""
    cfg = parse_config(_raw(tmp_path), base_dir=str(tmp_path))
    path = tmp_path / "data" / "sys0" / "set.000" / "energy.npy"
    energies = np.load(path)
    energies[1] = np.inf
    np.save(path, energies)
    with pytest.raises(NonFiniteError, match=r"^energy of frame 1 is not finite; system: .*/sys0; "
                       rf"file: {path}; expected: finite labels; found: \[inf\]$"):
        train(cfg, output=str(tmp_path / "o"), num_workers=0, options=SMALL)


def test_gradients_that_overflow_from_finite_losses(tmp_path: Path) -> None:
    """No rank's loss names a batch: every rank says the model diverged."""
    from mdloader.loading.loader import DpLoaderSet
    from mdloader.train.step import Stepper

    address = make_system(tmp_path, "s", natoms=4, nframes=2, keys=("energy", "force"))
    ls = DpLoaderSet([address], 2, ["O", "H"], seed=0)
    ls.add_data_requirement(LABELS)
    model = RadialPotential(2, rcut=2.5, nbasis=4, hidden=(8,))

    def overflowing(pred: dict, labels: dict, lr: float) -> tuple:
        return pred["energy"].sum() * 1e300 * 1e300, {"mse": 1.0}  # reported finite

    stepper = Stepper(model, model, torch.optim.SGD(model.parameters(), lr=0.1), overflowing,
                      ls.systems, device=torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError, match=r"^the gradients are not finite at step 1, the "
                       r"losses are: the model diverged \(try a smaller "
                       r"learning_rate\.start_lr\)$"):
        stepper.step(ls[0], 0.1, 1, False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no update
    stepper.nonfinite = "skip"
    assert stepper.step(ls[0], 0.1, 2, False).skipped


def test_a_non_finite_box_is_named_before_the_first_step(tmp_path: Path) -> None:
    from mdloader.loading.build import build_systems

    make_system(tmp_path, "s", natoms=4, nframes=3)
    path = tmp_path / "s" / "set.000" / "box.npy"
    cells = np.load(path)
    cells[1, 0] = np.nan
    np.save(path, cells)
    with pytest.raises(NonFiniteError, match=rf"^the box of frame 1 holds NaN/inf; system: "
                       rf"{tmp_path}/s; file: {path}$"):
        check_boxes(build_systems(str(tmp_path), ["O", "H"]), 2.5, World())
