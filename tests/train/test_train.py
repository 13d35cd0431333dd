"""The reference training job: model physics, DeePMD-style schedule/loss, lcurve, restart."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from support.distributed_utils import run_ranks, values

from mdloader.config.input_json import LearningRateConfig, LossConfig, parse_config
from mdloader.errors import ConfigError, DataError, StateDictError
from mdloader.stats.output import OutputSamples, output_bias
from mdloader.testing import make_system
from mdloader.train.io import Lcurve, load_checkpoint
from mdloader.train.job import ModelOptions, train
from mdloader.train.model import RadialPotential, minimum_image
from mdloader.train.objective import EnergyForceLoss, ExpDecayLR

SMALL = ModelOptions(rcut=2.5, nbasis=4, hidden=(8,))


def _frames(natoms: int = 5, nframes: int = 2, cell: float = 6.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    coord = torch.tensor(rng.random((nframes, natoms, 3)) * cell)
    atype = torch.tensor(np.arange(natoms) % 2).repeat(nframes, 1)
    box = torch.tensor(np.diag([cell] * 3).reshape(1, 9)).repeat(nframes, 1).double()
    return coord, atype, box


@pytest.mark.parametrize("periodic", [True, False])
def test_forces_are_minus_the_energy_gradient(periodic: bool) -> None:
    torch.manual_seed(0)
    model = RadialPotential(2, rcut=2.5, nbasis=4, hidden=(8,))
    coord, atype, box = _frames()
    box = box if periodic else None
    force = model(coord, atype, box, create_graph=False)["force"]
    eps = 1e-5
    for atom, axis in [(0, 0), (3, 2)]:
        plus, minus = coord.clone(), coord.clone()
        plus[:, atom, axis] += eps
        minus[:, atom, axis] -= eps
        e_plus = model(plus, atype, box, create_graph=False)["energy"].detach()
        e_minus = model(minus, atype, box, create_graph=False)["energy"].detach()
        numeric = -(e_plus - e_minus).squeeze(-1) / (2 * eps)
        torch.testing.assert_close(force[:, atom, axis], numeric, rtol=1e-5, atol=1e-7)


def test_periodic_images_and_translation_leave_the_energy_unchanged() -> None:
    torch.manual_seed(1)
    model = RadialPotential(2, rcut=2.5, nbasis=4, hidden=(8,))
    coord, atype, box = _frames()
    e0 = model(coord, atype, box, create_graph=False)["energy"]
    moved = coord.clone()
    moved[:, 2] += torch.tensor([6.0, -6.0, 12.0], dtype=torch.float64)  # box vectors
    shifted = coord + 0.37
    torch.testing.assert_close(model(moved, atype, box, create_graph=False)["energy"], e0)
    torch.testing.assert_close(model(shifted, atype, box, create_graph=False)["energy"], e0)


def test_pairs_beyond_the_cutoff_do_not_interact() -> None:
    model = RadialPotential(1, rcut=2.0, nbasis=3, hidden=(4,))
    atype = torch.zeros(1, 2, dtype=torch.long)
    far = torch.tensor([[[0.0, 0, 0], [2.01, 0, 0]]], dtype=torch.float64)
    out = model(far, atype, None, create_graph=False)
    assert torch.count_nonzero(model.features(far, atype, None)) == 0
    assert torch.all(out["force"] == 0)


def test_minimum_image_wraps_to_the_nearest_copy() -> None:
    coord = torch.tensor([[[0.5, 0, 0], [9.5, 0, 0]]], dtype=torch.float64)
    box = torch.tensor([[10.0, 0, 0, 0, 10, 0, 0, 0, 10]], dtype=torch.float64)
    diff = minimum_image(coord, box, rcut=4.0)
    torch.testing.assert_close(diff[0, 0, 1], torch.tensor([-1.0, 0, 0], dtype=torch.float64))


def test_box_too_small_for_the_cutoff() -> None:
    model = RadialPotential(2, rcut=4.0)
    coord, atype, box = _frames(cell=6.0)
    with pytest.raises(DataError, match=r"^the box is too small for the model cutoff .*expected: "
                       r"height >= 8 A; found: 6 A$"):
        model(coord, atype, box)


def test_virtual_atoms_are_ignored() -> None:
    torch.manual_seed(2)
    model = RadialPotential(2, rcut=2.5, nbasis=4, hidden=(8,))
    coord, atype, box = _frames(natoms=4, nframes=1)
    padded = torch.cat([coord, torch.zeros(1, 1, 3, dtype=torch.float64)], dim=1)
    ptype = torch.cat([atype, torch.tensor([[-1]])], dim=1)
    full = model(coord, atype, box, create_graph=False)
    pad = model(padded, ptype, box, create_graph=False)
    torch.testing.assert_close(pad["energy"], full["energy"])
    assert torch.all(pad["force"][0, -1] == 0)


def _bias(counts: np.ndarray, energies: np.ndarray) -> np.ndarray:
    samples = OutputSamples("energy", counts, energies.reshape(-1, 1),
                            np.column_stack([np.zeros(len(counts)), np.arange(len(counts))]))
    return output_bias(samples)[0][:, 0]


def test_energy_bias_least_squares() -> None:
    counts = np.array([[1, 2], [2, 1], [3, 3], [0, 4]])
    bias = np.array([-3.5, -1.25])
    np.testing.assert_allclose(_bias(counts, counts @ bias), bias)
    degenerate = np.array([[64, 128], [64, 128]])  # water: one composition only
    fitted = _bias(degenerate, np.array([-100.0, -102.0]))
    np.testing.assert_allclose(degenerate @ fitted, [-101.0, -101.0])


def test_learning_rate_follows_deepmd() -> None:
    lr = ExpDecayLR.from_config(LearningRateConfig(start_lr=1e-3, stop_lr=1e-8, decay_steps=5000),
                                numb_steps=1_000_000)
    assert lr.decay_steps == 5000
    assert lr.value(0) == 1e-3 and lr.value(4999) == 1e-3
    assert math.isclose(lr.value(1_000_000), 1e-8, rel_tol=1e-9)
    assert math.isclose(lr.value(5000), 1e-3 * lr.decay_rate)
    short = ExpDecayLR.from_config(LearningRateConfig(decay_steps=5000), numb_steps=300)
    assert short.decay_steps == 4  # DeePMD-kit: numb_steps // 100 + 1 when decay >= steps
    with pytest.raises(ConfigError, match=r"^learning_rate\.type: mdloader train implements the "
                       r"'exp' schedule only, found 'cosine'$"):
        ExpDecayLR.from_config(LearningRateConfig(type="cosine"), 10)


def test_loss_prefactors_and_values() -> None:
    loss = EnergyForceLoss.from_config(LossConfig(), start_lr=1e-3)
    assert loss.prefactors(1e-3) == pytest.approx((0.02, 1000.0))
    assert loss.prefactors(0.0) == (1.0, 1.0)
    pe, pf = loss.prefactors(5e-4)
    assert math.isclose(pe, 0.51) and math.isclose(pf, 500.5)
    pred = {"energy": torch.tensor([[1.0]], dtype=torch.float64),
            "force": torch.zeros(1, 4, 3, dtype=torch.float64)}
    label = {"energy": torch.tensor([[3.0]], dtype=torch.float64),
             "force": torch.ones(1, 4, 3, dtype=torch.float64)}
    value, mse = loss(pred, label, 1e-3)
    assert float(value) == pytest.approx(0.02 * 4.0 / 4 + 1000.0 * 1.0)
    assert mse == pytest.approx({"mse": float(value), "mse_e": 4.0 / 16, "mse_f": 1.0})
    with pytest.raises(ConfigError, match=r"^loss\.type: mdloader train implements the 'ener' "):
        EnergyForceLoss.from_config(LossConfig(type="dos"), 1e-3)


def test_lcurve_has_deepmd_columns(tmp_path: Path) -> None:
    curve = Lcurve(str(tmp_path / "lcurve.out"), with_validation=True)
    curve.write(100, 1e-3, {"rmse": 2.0, "rmse_e": 0.01, "rmse_f": 0.3},
                {"rmse": 2.5, "rmse_e": 0.02, "rmse_f": 0.4})
    curve.close()
    head, line = (tmp_path / "lcurve.out").read_text().splitlines()
    assert head.split() == ["#", "step", "rmse_val", "rmse_trn", "rmse_e_val", "rmse_e_trn",
                            "rmse_f_val", "rmse_f_trn", "lr"]
    assert line == ("    100      2.50e+00    2.00e+00      2.00e-02    1.00e-02      "
                    "4.00e-01    3.00e-01    1.0e-03")


def _config(tmp_path: Path, *, steps: int | None = 8, valid: bool = True, **training: object):
    return parse_config(_raw(tmp_path, steps=steps, valid=valid, **training),
                        base_dir=str(tmp_path))


def _raw(tmp_path: Path, *, steps: int | None = 8, valid: bool = True,
         **training: object) -> dict:
    data = tmp_path / "data"
    for i, n in enumerate((5, 7)):
        make_system(data, f"sys{i}", natoms=n, nframes=6, seed=i, keys=("energy", "force"))
    make_system(data, "val", natoms=6, nframes=4, seed=9, keys=("energy", "force"))
    raw = {"model": {"type_map": ["O", "H"]},
           "training": {"training_data": {"systems": ["data/sys0", "data/sys1"],
                                          "batch_size": 2},
                        "numb_steps": steps, "seed": 7, "disp_freq": 2, "save_freq": 4,
                        **training}}
    if valid:
        raw["training"]["validation_data"] = {"systems": "data/val", "batch_size": 1,
                                              "numb_btch": 2}
    if steps is None:
        del raw["training"]["numb_steps"]
    return raw


@pytest.mark.timeout(120)
def test_restart_continues_exactly(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    full = train(cfg, output=str(tmp_path / "full"), num_workers=0, options=SMALL)
    assert full.step == 8 and len(full.batches) == 8
    part = train(cfg, output=str(tmp_path / "part"), num_workers=2, stop_after=5, options=SMALL)
    assert part.step == 5 and part.checkpoint == str(tmp_path / "part" / "model.ckpt-5.pt")
    rest = train(cfg, output=str(tmp_path / "part"), num_workers=1, options=SMALL,
                 restart=str(tmp_path / "part" / "model.ckpt-5.pt"))
    assert part.batches + rest.batches == full.batches
    full_curve = (tmp_path / "full" / "lcurve.out").read_text()
    assert (tmp_path / "part" / "lcurve.out").read_text() == full_curve
    assert len(full_curve.splitlines()) == 1 + 5  # header, steps 1, 2, 4, 6, 8
    names = sorted(os.listdir(tmp_path / "full"))
    assert names == ["checkpoint", "lcurve.out", "model.ckpt-4.pt", "model.ckpt-8.pt",
                     "model.ckpt.pt", "stalls.jsonl"]
    assert os.readlink(tmp_path / "full" / "model.ckpt.pt") == "model.ckpt-8.pt"


def test_checkpoint_errors(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=2, valid=False)
    out = train(cfg, output=str(tmp_path / "o"), num_workers=0, options=SMALL)
    assert out.last_valid is None and set(out.last_train) == {"rmse", "rmse_e", "rmse_f"}
    ckpt = str(tmp_path / "o" / "model.ckpt-2.pt")
    state = load_checkpoint(ckpt)["loader_state"]
    assert (state["next_step"], set(state["streams"])) == (2, {"training"})
    assert state["streams"]["training"]["generations"] == [[1, 2]]
    with pytest.raises(StateDictError, match=r"^checkpoint not found: .*nope\.pt$"):
        load_checkpoint(str(tmp_path / "nope.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(StateDictError, match=r"^cannot read checkpoint .*junk\.pt"):
        load_checkpoint(str(tmp_path / "junk.pt"))
    other = ModelOptions(rcut=2.0, nbasis=4, hidden=(8,))
    with pytest.raises(StateDictError, match=r"holds a model .*'rcut': 2\.5.* but this run "
                       r"builds .*'rcut': 2\.0"):
        train(cfg, output=str(tmp_path / "o2"), num_workers=0, options=other, restart=ckpt)


def test_steps_are_required_and_epochs_convert(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=None, valid=False)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^training\.numb_steps: mdloader train needs the "
                       r"number of steps"):
        train(cfg, output=str(tmp_path / "o"), num_workers=0, options=SMALL)
    cfg = _config(tmp_path, steps=None, valid=False, numb_epoch=0.5)  # type: ignore[arg-type]
    out = train(cfg, output=str(tmp_path / "e"), num_workers=0, options=SMALL)
    # 2 systems of 6 frames, batch 2: 3 batches each, p = 1/2 -> ceil(0.5 * ceil(3 / 0.5)) = 3
    assert out.step == 3


def _train_rank(rank: int, world_size: int, raw: dict, base: str, out: str, kwargs: dict):
    return train(parse_config(raw, base_dir=base), output=out, num_workers=0, options=SMALL,
                 **kwargs)


def _resumed_keys(cfg, ckpt: str, rank: int, world: int, n: int) -> list:
    """The first ``n`` keys of rank ``rank`` of ``world`` resumed from ``ckpt`` (no training)."""
    from mdloader import DpLoaderSet, get_sampler_from_params
    from mdloader.world import World

    data = cfg.training_data
    ls = DpLoaderSet(list(data.systems), None, list(cfg.type_map), seed=cfg.seed,
                     spec=data.sampling, world=World(rank=rank, world_size=world))
    sampler = get_sampler_from_params(ls, data.sampling.sampler_params(), num_workers=0)
    sampler.load_state_dict(load_checkpoint(ckpt)["loader_state"]["streams"]["training"])
    return [(k.sid, k.fids) for k in (sampler.next_key() for _ in range(n))]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_restart_on_another_number_of_ranks(tmp_path: Path) -> None:
    """2 ranks stop at step 4; the job goes on with 1 rank (2 workers) and with 3 ranks."""
    raw = _raw(tmp_path, steps=None, numb_epoch=2)  # 8 steps on 2 ranks, 12 on 1, 4 on 3
    cfg, base = parse_config(raw, base_dir=str(tmp_path)), str(tmp_path)
    part = values(run_ranks(_train_rank, 2, raw, base, str(tmp_path / "part"),
                            {"stop_after": 4}, timeout=150))
    assert [r.step for r in part] == [4, 4]
    ckpt = str(tmp_path / "part" / "model.ckpt-4.pt")
    one = train(cfg, output=str(tmp_path / "one"), num_workers=2, options=SMALL, restart=ckpt,
                full_validation=True)
    three = values(run_ranks(_train_rank, 3, raw, base, str(tmp_path / "three"),
                             {"restart": ckpt, "full_validation": True}, timeout=200))
    for world, results in ((1, [one]), (3, three)):
        assert [r.step for r in results] == [8] * world  # the job's 8 steps, not 12 or 4
        for rank, result in enumerate(results):
            trained = [(sid, fids) for _, sid, fids in result.batches]
            assert trained == _resumed_keys(cfg, ckpt, rank, world, 4)
        state = load_checkpoint(str(tmp_path / ("one" if world == 1 else "three") /
                                    "model.ckpt-8.pt"))
        generations = state["loader_state"]["streams"]["training"]["generations"]
        assert generations == [[2, 4, 4], [world, *[4] * world]]
        fulls = [r.full_valid for r in results]
        assert all([f.step for f in full] == [8] for full in fulls)
        assert {(f[0].frames, f[0].rmse_e, f[0].rmse_f) for f in fulls} == {
            (4, fulls[0][0].rmse_e, fulls[0][0].rmse_f)}  # every frame once, same on every rank
    lines = (tmp_path / "three" / "lcurve.out").read_text().splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["6", "8"]


def test_zero_steps_save_the_untrained_model_with_its_statistics(tmp_path: Path) -> None:
    """DeePMD-kit's numb_steps 0: statistics, then the model saved at step 0, no training."""
    cfg = _config(tmp_path, steps=0, valid=False)
    out = train(cfg, output=str(tmp_path / "o"), num_workers=0, options=SMALL)
    assert (out.step, out.batches) == (0, [])
    assert out.checkpoint == str(tmp_path / "o" / "model.ckpt-0.pt")
    state = load_checkpoint(out.checkpoint)
    assert state["step"] == 0 and state["numb_steps"] == 0
    assert torch.count_nonzero(state["model"]["energy_bias"]) > 0  # the statistics were made
    assert (tmp_path / "o" / "lcurve.out").read_text().count("\n") == 1  # its header only
    override = train(_config(tmp_path, valid=False), output=str(tmp_path / "p"), num_workers=0,
                     options=SMALL, numb_steps=0)
    assert override.step == 0 and override.checkpoint is not None
    with pytest.raises(ConfigError, match=r"^--numb-steps: must be an integer >= 0, got -1$"):
        train(cfg, output=str(tmp_path / "q"), num_workers=0, options=SMALL, numb_steps=-1)
    assert ExpDecayLR.from_config(LearningRateConfig(), 0).value(0) == pytest.approx(1e-3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_water_forces_are_learned(tmp_path: Path, water_data: Path) -> None:
    water = water_data
    cfg = parse_config({
        "model": {"type_map": ["O", "H"]},
        "learning_rate": {"start_lr": 3e-3, "stop_lr": 1e-4, "decay_steps": 20},
        "training": {"training_data": {"systems": [str(water / "data_0"), str(water / "data_1"),
                                                   str(water / "data_2")], "batch_size": 1},
                     "validation_data": {"systems": str(water / "data_3"), "batch_size": 1,
                                         "numb_btch": 3},
                     "numb_steps": 40, "seed": 1, "disp_freq": 40, "save_freq": 40}})
    forces = np.concatenate([np.load(p).ravel() for p in water.glob("data_*/set.*/force.npy")])
    out = train(cfg, output=str(tmp_path), num_workers=0)
    assert out.last_valid is not None
    assert out.last_valid["rmse_f"] < 0.6 * forces.std()  # std 0.81 eV/A; ~0.3 after 40 steps
