"""``mdloader train``'s model statistics on the sharded, cached path: every training system's
statistics frames (DeePMD-kit's ``make_stat_input`` frames of a one-rank job), the same numbers
as a direct one-process computation, at W = 1 and W = 2, from the cache at the next first start,
and a failure on any rank's share reaching every rank with the system and the file."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from support.distributed_utils import errors, run_ranks, values

from mdloader.config.input_json import parse_config
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.errors import ConfigError
from mdloader.sampling.order import statistics_frames
from mdloader.stats.shards import share, system_weights
from mdloader.testing import make_system
from mdloader.train.io import load_checkpoint
from mdloader.train.job import LABELS, ModelOptions, train
from mdloader.train.model import RadialPotential

SMALL = ModelOptions(rcut=2.5, nbasis=4, hidden=(8,))
TYPE_MAP = ["O", "H"]
SEED, BATCH, NBATCH = 7, 2, 2  # 2 batches of 2 frames: a shuffled subset of most systems


def _data(root: Path) -> list[str]:
    """Five systems: npy with two sets, npy, HDF5, non-periodic, mixed type; 4 to 6 frames."""
    return [make_system(root, "sys0", natoms=5, nframes=6, nsets=2, seed=1,
                        keys=("energy", "force")),
            make_system(root, "sys1", natoms=7, nframes=6, seed=2, keys=("energy", "force")),
            make_system(root, "h5", natoms=6, nframes=5, backend="hdf5", seed=3,
                        keys=("energy", "force")),
            make_system(root, "free", natoms=4, nframes=4, pbc=False, seed=4,
                        keys=("energy", "force")),
            make_system(root, "mixed", types=(0, 0, 0, 1, 1), nframes=5, mixed_type=True,
                        seed=5, keys=("energy", "force"))]


def _raw(systems: list[str]) -> dict:
    return {"model": {"type_map": TYPE_MAP, "data_stat_nbatch": NBATCH},
            "training": {"training_data": {"systems": systems, "batch_size": BATCH},
                         "numb_steps": 0, "seed": SEED}}


def _statistics(raw: dict, output: Path) -> dict[str, torch.Tensor]:
    """The model statistics a ``numb_steps: 0`` run saves."""
    result = train(parse_config(raw), output=str(output), num_workers=0, options=SMALL)
    state = load_checkpoint(str(result.checkpoint))["model"]
    return {k: state[k] for k in ("energy_bias", "feat_mean", "feat_std")}


def _direct(systems: list[str]) -> dict[str, torch.Tensor]:
    """One process, system after system: the features of every real atom of the first statistics
    batch, their mean and std, and the least-squares energy per type over the statistics
    frames."""
    model = RadialPotential(len(TYPE_MAP), rcut=SMALL.rcut, nbasis=SMALL.nbasis)
    feats, counts, energies = [], [], []
    for sid, address in enumerate(systems):
        ds = DeepmdDataSetForLoader(address, TYPE_MAP)
        ds.add_data_requirement(LABELS)
        first = ds.get_batch(statistics_frames(SEED, sid, len(ds), BATCH, 1).tolist())
        atype = first["atype"].long()
        with torch.no_grad():
            f = model.features(first["coord"].double(), atype, first["box"])
        feats.append(f[atype >= 0])
        batch = ds.get_batch(statistics_frames(SEED, sid, len(ds), BATCH, NBATCH).tolist())
        counts.append(batch.get("real_natoms_vec", batch["natoms"])[:, 2:].numpy())
        energies.append(batch["energy"].numpy().reshape(-1))
    rows = torch.cat(feats)
    bias = np.linalg.lstsq(np.concatenate(counts).astype(np.float64), np.concatenate(energies),
                           rcond=None)[0]
    return {"energy_bias": torch.as_tensor(bias), "feat_mean": rows.mean(0),
            "feat_std": rows.std(0).clamp(min=1e-3)}


def _assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for key, want in expected.items():
        torch.testing.assert_close(got[key], want.to(got[key].dtype), rtol=1e-12, atol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " statistics: " in r.getMessage()]


def test_one_rank_equals_a_direct_computation_and_the_cache_serves_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    systems = _data(tmp_path / "data")
    assert len(statistics_frames(SEED, 0, 6, BATCH, NBATCH)) == 4  # a subset of the frames
    with caplog.at_level(logging.INFO, logger="mdloader"):
        first = _statistics(_raw(systems), tmp_path / "a")
        _assert_close(first, _direct(systems))
        assert [re.sub(r" in \S+ s", "", m) for m in _lines(caplog)] == [
            "feature statistics: 5 systems (cached 0, computed 5 on 1 ranks)",
            "output statistics: 5 systems (cached 0, computed 5 on 1 ranks)"]
        caplog.clear()
        again = _statistics(_raw(systems), tmp_path / "b")  # a second first start: the cache
        assert [re.sub(r" in \S+ s", "", m) for m in _lines(caplog)] == [
            "feature statistics: 5 systems (cached 5, computed 0 on 1 ranks)",
            "output statistics: 5 systems (cached 5, computed 0 on 1 ranks)"]
        for key in first:
            assert torch.equal(again[key], first[key])
        caplog.clear()
        energy = Path(systems[1]) / "set.000" / "energy.npy"  # new labels for one system
        np.save(energy, np.load(energy) + 0.5)
        changed = _statistics(_raw(systems), tmp_path / "c")
        assert [re.sub(r" in \S+ s", "", m) for m in _lines(caplog)] == [
            "feature statistics: 5 systems (cached 4, computed 1 on 1 ranks)",
            "output statistics: 5 systems (cached 4, computed 1 on 1 ranks)"]
        _assert_close(changed, _direct(systems))
        assert not torch.equal(changed["energy_bias"], first["energy_bias"])
        caplog.clear()
        restart = tmp_path / "c" / "model.ckpt-0.pt"
        train(parse_config(_raw(systems)), output=str(tmp_path / "c"), restart=str(restart),
              num_workers=0, options=SMALL, numb_steps=1)
        assert _lines(caplog) == []  # a restart computes nothing


def _rank_statistics(rank: int, world_size: int, raw: dict, output: str) -> list[str]:
    """Train ``numb_steps: 0``; the systems whose features this rank computed."""
    import mdloader.train.statistics as statistics

    computed: list[str] = []
    real = getattr(statistics, "system_features", None)

    def spy(model, dataset, fids, **kwargs):
        computed.append(dataset.meta.address)
        return real(model, dataset, fids, **kwargs)

    if real is not None:
        statistics.system_features = spy
    train(parse_config(raw), output=output, num_workers=0, options=SMALL)
    return computed


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_compute_disjoint_shares_and_set_what_one_rank_sets(tmp_path: Path) -> None:
    systems = _data(tmp_path / "data")
    one = _statistics(_raw(systems), tmp_path / "one")
    env = {"MDLOADER_CACHE_DIR": str(tmp_path / "cache2")}
    computed = values(run_ranks(_rank_statistics, 2, _raw(systems), str(tmp_path / "two"),
                                timeout=240, env=env, daemon=False))
    assert computed[0] and computed[1] and not set(computed[0]) & set(computed[1])
    assert sorted(computed[0] + computed[1]) == sorted(systems)
    two = {k: v for k, v in load_checkpoint(str(tmp_path / "two" / "model.ckpt-0.pt"))[
        "model"].items() if k in one}
    _assert_close(two, one)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_nonfinite_energy_in_rank_1s_share_fails_both_ranks_naming_system_and_file(
        tmp_path: Path) -> None:
    systems = _data(tmp_path / "data")
    metas = [DeepmdDataSetForLoader(s, TYPE_MAP).meta for s in systems]
    nframes, natoms = [m.nframes for m in metas], [m.natoms for m in metas]
    sid = next(int(s) for s in share(system_weights(nframes, natoms), 1, 2)
               if "sys" in Path(systems[s]).name)  # an npy system of rank 1's share
    frame = int(statistics_frames(SEED, sid, nframes[sid], BATCH, NBATCH)[0])
    sets = sorted(Path(systems[sid]).glob("set.*"))
    for set_dir in sets:  # the set that holds ``frame``
        energy = set_dir / "energy.npy"
        values_ = np.load(energy)
        if frame < len(values_):
            values_[frame] = np.nan
            np.save(energy, values_)
            break
        frame -= len(values_)
    global_frame = int(statistics_frames(SEED, sid, nframes[sid], BATCH, NBATCH)[0])
    env = {"MDLOADER_CACHE_DIR": str(tmp_path / "cache")}
    outcomes = run_ranks(_rank_statistics, 2, _raw(systems), str(tmp_path / "o"),
                         timeout=240, env=env, daemon=False)
    lines = set()
    for e in errors(outcomes):
        assert e.exc_type == "RemoteError"
        lines.add(e.message.splitlines()[0])
    (line,) = lines  # the same line on both ranks
    assert line.startswith("rank 1 failed (feature statistics): NonFiniteError: the statistics "
                           f"cannot use these frames: energy holds NaN/inf in frames "
                           f"[{global_frame}] of the batch; system: {systems[sid]}; "
                           f"file: {energy}"), line


def test_data_stat_nbatch_is_read_and_checked() -> None:
    raw = _raw(["sys"])
    assert parse_config(raw).data_stat_nbatch == NBATCH
    del raw["model"]["data_stat_nbatch"]
    assert parse_config(raw).data_stat_nbatch == 10  # DeePMD-kit's default
    raw["model"]["data_stat_nbatch"] = 0
    with pytest.raises(ConfigError, match=r"^model\.data_stat_nbatch: bad value 0: expected a "
                                          r"positive integer$"):
        parse_config(raw)
