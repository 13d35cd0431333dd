"""``batch_size: "mix:N"`` under ``mdloader train``: frames of different atom counts in one padded
batch from one LMDB database, DeePMD-kit 3.2's batches, statistics from the ``max:N`` view of the
same systems, exact restarts on one and on two gloo ranks, and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.distributed_utils import run_ranks, values
from support.inputs import write_input

import mdloader
from mdloader.cli.main import main
from mdloader.config.input_json import parse_config
from mdloader.errors import ConfigError
from mdloader.testing import make_lmdb, make_system
from mdloader.train.io import load_checkpoint
from mdloader.train.job import ModelOptions, train

SMALL = ModelOptions(rcut=2.0, nbasis=4, hidden=(8,))
TYPE_MAP = ["O", "H"]
SEED = 7


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training database of systems of 3 to 6 atoms and a validation database of 4 and 5."""
    root = tmp_path_factory.mktemp("mixtrain")
    train_systems = [make_system(root / "src", f"s{i}", natoms=3 + i, nframes=5 + i, seed=i,
                                 keys=("energy", "force")) for i in range(4)]
    make_lmdb(root / "train.lmdb", train_systems)
    valid_systems = [make_system(root / "vsrc", f"v{i}", natoms=4 + i, nframes=3, seed=10 + i,
                                 keys=("energy", "force")) for i in range(2)]
    make_lmdb(root / "valid.lmdb", valid_systems)
    return root


def _raw(steps: int = 8, batch: str = "mix:12", systems: object = "train.lmdb") -> dict:
    return {"model": {"type_map": TYPE_MAP},
            "training": {"training_data": {"systems": systems, "batch_size": batch},
                         "validation_data": {"systems": "valid.lmdb", "batch_size": "mix:10",
                                             "numb_btch": 2},
                         "numb_steps": steps, "seed": SEED, "disp_freq": 2, "save_freq": 4}}


def _config(data: Path, **kwargs: object):
    return parse_config(_raw(**kwargs), base_dir=str(data), mixed=True)


def _deepmd_batches(data: Path) -> list[list[int]]:
    """DeePMD-kit's pass 0 of the training database under the job seed (its LmdbBatchSampler)."""
    reader = mdloader.LmdbDataReader(str(data / "train.lmdb"), TYPE_MAP, "mix:12")
    return [list(b) for b in mdloader.LmdbBatchSampler(reader, seed=SEED).batches()]


def _lcurve_rows(path: str) -> list[list[float]]:
    return [[float(x) for x in line.split()] for line in Path(path).read_text().splitlines()
            if not line.startswith("#")]


def test_one_rank_trains_deepmds_padded_batches_and_restarts_exactly(
        data: Path, tmp_path: Path) -> None:
    whole = train(_config(data), output=str(tmp_path / "whole"), num_workers=0, options=SMALL)
    trained = [list(fids) for _, _, fids in whole.batches]
    assert whole.step == 8 and trained == _deepmd_batches(data)[:8]
    nlocs = mdloader.LmdbDataReader(str(data / "train.lmdb"), TYPE_MAP, "mix:12").frame_nlocs
    assert any(len({int(nlocs[f]) for f in fids}) > 1 for fids in trained), "no mixed batch"
    rows = _lcurve_rows(whole.lcurve)
    assert [int(r[0]) for r in rows] == [1, 2, 4, 6, 8]
    assert np.isfinite(rows).all() and len(rows[0]) == 8  # step, 3 valid, 3 train, lr
    weights = load_checkpoint(str(tmp_path / "whole" / "model.ckpt-8.pt"))["model"]
    part = train(_config(data), output=str(tmp_path / "part"), num_workers=2, options=SMALL,
                 stop_after=4)
    assert part.step == 4 and [b[2] for b in part.batches] == [b[2] for b in whole.batches[:4]]
    rest = train(_config(data), output=str(tmp_path / "part"), num_workers=2, options=SMALL,
                 restart=str(tmp_path / "part" / "model.ckpt-4.pt"))
    assert [b[2] for b in rest.batches] == [b[2] for b in whole.batches[4:]]
    resumed = load_checkpoint(str(tmp_path / "part" / "model.ckpt-8.pt"))["model"]
    for name, value in weights.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-12, atol=1e-12)
    assert _lcurve_rows(rest.lcurve) == rows  # validation batches continued too


def test_the_statistics_are_those_of_the_max_n_view_of_the_same_systems(
        data: Path, tmp_path: Path) -> None:
    """``numb_steps`` 0 saves the untrained model: its bias and feature scales under ``mix:12``
    equal those under ``max:12`` (the frames ``mdloader dp`` takes for its statistics)."""
    stats = {}
    for batch in ("mix:12", "max:12"):
        train(_config(data, steps=0, batch=batch), output=str(tmp_path / batch[:3]),
              num_workers=0, options=SMALL)
        stats[batch] = load_checkpoint(str(tmp_path / batch[:3] / "model.ckpt-0.pt"))["model"]
    for name in ("energy_bias", "feat_mean", "feat_std"):
        assert torch.equal(stats["mix:12"][name], stats["max:12"][name]), name
    assert float(stats["mix:12"]["energy_bias"].abs().sum()) > 0


def _train_rank(rank: int, world_size: int, data: str, out: str, kwargs: dict):
    return train(_config(Path(data)), output=out, num_workers=0, options=SMALL, **kwargs)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_gloo_ranks_train_deepmds_split_and_restart_exactly(data: Path,
                                                                 tmp_path: Path) -> None:
    """Rank ``r`` trains DeePMD-kit's batches ``r, r + 2, ...``; a restart at step 4 on two ranks
    trains what the uninterrupted run trained, and ends on the same weights; on one rank it
    continues elastically from the same state."""
    whole = values(run_ranks(_train_rank, 2, str(data), str(tmp_path / "whole"), {},
                             timeout=150, daemon=False))
    batches = _deepmd_batches(data)
    first = len(batches) // 2  # steps of pass 0 before its padded tail; pass 1 follows
    assert 2 <= first < 8
    for rank, result in enumerate(whole):
        assert result.step == 8
        assert [list(b[2]) for b in result.batches][:first] == batches[rank::2][:first]
    values(run_ranks(_train_rank, 2, str(data), str(tmp_path / "part"), {"stop_after": 4},
                     timeout=150, daemon=False))
    rest = values(run_ranks(_train_rank, 2, str(data), str(tmp_path / "part"),
                            {"restart": str(tmp_path / "part" / "model.ckpt-4.pt")},
                            timeout=150, daemon=False))
    for rank in range(2):
        assert [b[2] for b in rest[rank].batches] == [b[2] for b in whole[rank].batches[4:]]
    ends = [load_checkpoint(str(tmp_path / run / "model.ckpt-8.pt"))["model"]
            for run in ("whole", "part")]
    for name, value in ends[0].items():
        torch.testing.assert_close(ends[1][name], value, rtol=1e-12, atol=1e-12)
    ckpt = str(tmp_path / "part" / "model.ckpt-4.pt")
    one = train(_config(data), output=str(tmp_path / "one"), num_workers=0, options=SMALL,
                restart=ckpt)  # elastic: the rest of the job on one rank
    assert [list(b[2]) for b in one.batches] == _resumed_keys(data, ckpt, 4)


def _resumed_keys(data: Path, ckpt: str, count: int) -> list[list[int]]:
    """The first ``count`` keys of one rank's mix:N key source resumed from ``ckpt``."""
    from mdloader.loading.mixed_stream import MixedLmdbBatches
    from mdloader.train.job import LABELS
    from mdloader.world import World

    batches = MixedLmdbBatches(str(data / "train.lmdb"), TYPE_MAP, "mix:12")
    batches.add_data_requirement(LABELS)
    sampler = batches.sampler(seed=SEED, world=World())
    sampler.load_state_dict(load_checkpoint(ckpt)["loader_state"]["streams"]["training"])
    return [list(sampler.next_key()) for _ in range(count)]


def test_the_padded_loss_divides_each_frame_by_its_own_atoms() -> None:
    """Frames of 2 and 3 atoms padded to 3: DeePMD-kit's masked energy and force terms; the same
    frames without padding give what the plain loss gives for each frame."""
    from mdloader.config.input_json import LossConfig
    from mdloader.train.objective import EnergyForceLoss

    loss = EnergyForceLoss.from_config(LossConfig(), 1e-3)
    gen = torch.Generator().manual_seed(3)
    force = torch.randn(2, 3, 3, generator=gen, dtype=torch.float64)
    real = torch.tensor([[True, True, False], [True, True, True]])
    force[0, 2] = 0.0
    pred = {"energy": torch.tensor([[1.0], [2.0]], dtype=torch.float64),
            "force": force * 0.5}
    label = {"energy": torch.tensor([0.5, 3.5], dtype=torch.float64), "force": force,
             "real": real}
    value, mse = loss(pred, label, 1e-3)
    pref_e, pref_f = loss.prefactors(1e-3)
    se = torch.tensor([0.25, 2.25], dtype=torch.float64)
    n = torch.tensor([2.0, 3.0], dtype=torch.float64)
    sf = float(torch.sum((force * 0.5) ** 2)) / (3 * 5)
    assert float(value) == pytest.approx(pref_e * float(torch.mean(se / n)) + pref_f * sf)
    assert mse["mse_e"] == pytest.approx(float(torch.mean(se / n ** 2)))
    assert mse["mse_f"] == pytest.approx(sf)
    full = {"energy": label["energy"][1:], "force": force[1:]}
    plain = loss({"energy": pred["energy"][1:], "force": pred["force"][1:]}, full, 1e-3)[1]
    masked = loss({"energy": pred["energy"][1:], "force": pred["force"][1:]},
                  {**full, "real": real[1:]}, 1e-3)[1]
    assert masked == pytest.approx(plain)


def test_npy_systems_and_a_full_validation_of_mix_batches_are_refused_in_one_line(
        data: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one LMDB") as npy:
        _config(data, systems=["src/s0", "src/s1"])
    assert npy.value.path == "training.training_data.batch_size"
    with pytest.raises(ConfigError, match="frame by frame") as full:
        train(_config(data), output=str(tmp_path / "o"), num_workers=0, options=SMALL,
              full_validation=True)
    assert full.value.path == "training.validation_data.batch_size"
    assert not (tmp_path / "o").exists()  # refused before any set-up


def test_check_for_train_agrees(data: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """``mdloader check --for train`` passes the LMDB input and refuses the npy one with the
    line ``mdloader train`` gives."""
    good = write_input(data, _raw(), name="mix_train.json")
    assert main(["check", str(good), "--for", "train"]) == 0
    bad = write_input(data, _raw(systems=["src/s0", "src/s1"]), name="mix_npy.json")
    capsys.readouterr()
    assert main(["check", str(bad), "--for", "train"]) == 2
    check_err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert main(["train", str(bad), "--output", str(tmp_path / "o")]) == 2
    train_err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(check_err) == 1 and check_err == train_err, (check_err, train_err)
    assert "training.training_data.batch_size" in check_err[0]


def test_a_nan_force_in_a_padded_batch_names_the_database_entry(tmp_path: Path) -> None:
    """The step guard on a ``mix:N`` batch: the error names the database, the frame (a database
    index) and its entry, not one of the groups the batch crosses."""
    systems = [make_system(tmp_path / "src", f"s{i}", natoms=3 + i, nframes=4, seed=i,
                           keys=("energy", "force")) for i in range(2)]
    force = np.load(Path(systems[1]) / "set.000" / "force.npy")
    force[2, 0] = np.nan
    np.save(Path(systems[1]) / "set.000" / "force.npy", force)
    database = make_lmdb(tmp_path / "nan.lmdb", systems)
    raw = _raw(steps=8, systems="nan.lmdb")
    del raw["training"]["validation_data"]
    with pytest.raises(mdloader.errors.NonFiniteError) as caught:
        train(parse_config(raw, base_dir=str(tmp_path), mixed=True), output=str(tmp_path / "o"),
              num_workers=0, options=SMALL)
    message = str(caught.value)
    assert "force holds NaN/inf in frames [6]" in message, message
    assert caught.value.system == database and "nan.lmdb" in str(caught.value.file), message


def test_numb_epoch_counts_mix_passes(data: Path, tmp_path: Path) -> None:
    """``numb_epoch`` 1 trains one ``mix:N`` pass: DeePMD-kit's pass 0, each batch once."""
    raw = _raw()
    del raw["training"]["numb_steps"]
    raw["training"]["numb_epoch"] = 1
    raw["training"]["save_freq"] = 100
    result = train(parse_config(raw, base_dir=str(data), mixed=True), output=str(tmp_path),
                   num_workers=0, options=SMALL)
    assert [list(b[2]) for b in result.batches] == _deepmd_batches(data)


def test_a_small_box_in_a_validation_batch_names_the_validation_database(tmp_path: Path) -> None:
    """LMDB boxes are checked as they are read: a validation batch's box under ``2 * rcut`` names
    the validation database and the frame's entry, not the training data."""
    big = [make_system(tmp_path / "src", f"b{n}", natoms=n, nframes=3, seed=n,
                       keys=("energy", "force")) for n in (8, 9)]
    make_lmdb(tmp_path / "train.lmdb", big)
    small = [make_system(tmp_path / "vsrc", "v3", natoms=3, nframes=3, seed=1,
                         keys=("energy", "force"))]
    valid = make_lmdb(tmp_path / "valid.lmdb", small)
    raw = _raw(steps=4)
    raw["training"]["validation_data"]["batch_size"] = "mix:6"
    with pytest.raises(mdloader.errors.DataError, match="too small") as caught:
        train(parse_config(raw, base_dir=str(tmp_path), mixed=True), output=str(tmp_path / "o"),
              num_workers=0, options=ModelOptions(rcut=2.45, nbasis=4, hidden=(8,)))
    assert caught.value.system == valid and "valid.lmdb" in str(caught.value.file)
