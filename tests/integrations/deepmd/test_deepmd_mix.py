"""``batch_size: "mix:N"`` under ``mdloader dp`` on an LMDB database written by ``mdloader
pack``'s writer (frames of 3, 4 and 6 atoms): the same learning curve, validation included, as
``dp --pt train`` at one rank (statistics over every frame, so that no sample differs),
DeePMD-kit's batches at one and two gloo ranks, and a restart from a checkpoint, on the same or
another number of ranks, that trains the batches of an uninterrupted run. Each launch is a tiny
model for a few steps."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from support.deepmd_env import require_deepmd_python
from support.deepmd_inputs import LR
from support.deepmd_ref import DEEPMD_DP, run_job
from support.deepmd_spy import dp_train, lcurve_rows, spied

import mdloader
from mdloader.sampling import lmdb_batches as lb
from mdloader.testing import make_lmdb, make_system

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
RULE = "mix:12"
SEED = 7


def _config(database: str, save_freq: int = 100) -> dict:
    return {
        "model": {"type_map": ["O", "H"], "data_stat_nbatch": 100,
                  "descriptor": {"type": "se_e2_a", "sel": [12, 24], "rcut_smth": 0.5,
                                 "rcut": 4.0, "neuron": [4, 8], "axis_neuron": 4, "seed": 1},
                  "fitting_net": {"neuron": [8, 8], "seed": 1}},
        "learning_rate": LR,  # one rate whatever numb_steps: a restart's rows are comparable
        "loss": {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
                 "limit_pref_f": 1},
        "training": {"training_data": {"systems": database, "batch_size": RULE},
                     "validation_data": {"systems": database, "batch_size": "mix:8",
                                         "numb_btch": 2},
                     "numb_steps": 3, "seed": SEED, "disp_freq": 1, "save_freq": save_freq},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("mix")
    systems = [make_system(root / "data", f"s{n}", natoms=n, nframes=6, seed=n,
                           keys=("energy", "force")) for n in (3, 4, 6)]
    database = make_lmdb(root / "train.lmdb", systems)
    run = SimpleNamespace(database=database, root=root)
    run.reference = root / "deepmd"
    run.reference.mkdir()
    (run.reference / "input.json").write_text(json.dumps(_config(database)))
    run_job([require_deepmd_python(), "-c", DEEPMD_DP, "--pt", "train", "input.json",
             "--skip-neighbor-stat"], run.reference)
    run.one = root / "w1"
    dp_train(run.one, _config(database), steps=3)
    run.whole = root / "w2"
    dp_train(run.whole, _config(database, save_freq=3), steps=8, world=2)
    run.parts = root / "parts"
    dp_train(run.parts, _config(database, save_freq=3), steps=3, world=2)
    run.state = json.loads((run.parts / "model.ckpt-3.pt.mdloader").read_text())
    run.elastic = root / "elastic"
    run.elastic.mkdir()
    for name in ("model.ckpt-3.pt", "model.ckpt-3.pt.mdloader", "input.json"):
        shutil.copy(run.parts / name, run.elastic / name)
    dp_train(run.parts, _config(database, save_freq=3), "--restart", "model.ckpt-3.pt",
             steps=8, world=2)
    run.restarted = spied(run.parts, 2)
    dp_train(run.elastic, _config(database, save_freq=3), "--restart", "model.ckpt-3.pt",
             steps=8)
    run.after = spied(run.elastic)[0]
    return run


def _batches(run: SimpleNamespace, epoch: int) -> list[list[int]]:
    """DeePMD-kit's batches of pass ``epoch`` (mdloader's LmdbBatchSampler, the same as
    DeePMD-kit's for a seed: tests/loading/test_lmdb_names.py)."""
    reader = mdloader.LmdbDataReader(run.database, ["O", "H"], RULE)
    sampler = mdloader.LmdbBatchSampler(reader, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    return sampler.batches()


def _fids(spy: dict) -> list[list[int]]:
    return [fids for _sid, fids in spy["drawn"]["Default"]]


@pytest.mark.timeout(900)
def test_one_rank_trains_deepmds_batches_with_deepmds_learning_curve(
        runs: SimpleNamespace) -> None:
    assert _fids(spied(runs.one)[0]) == _batches(runs, 0)[:3]
    assert lcurve_rows(runs.one) == lcurve_rows(runs.reference)
    assert len(lcurve_rows(runs.one)) == 3


@pytest.mark.timeout(900)
def test_two_gloo_ranks_train_deepmds_split_and_a_new_order_every_pass(
        runs: SimpleNamespace) -> None:
    ranks = [_fids(spy) for spy in spied(runs.whole, 2)]
    first, second = _batches(runs, 0), _batches(runs, 1)
    steps = -(-len(first) // 2)
    assert 3 <= steps < 8 and first != second
    for rank in range(2):
        expected = lb.rank_batches(first, rank, 2) + lb.rank_batches(second, rank, 2)
        assert ranks[rank] == expected[:8]
    mixed = [b for b in first if len({6 if i >= 10 else 4 if i >= 5 else 3 for i in b}) > 1]
    assert mixed, "no batch of mixed atom counts in the pass"


@pytest.mark.timeout(900)
def test_a_restart_trains_the_batches_of_an_uninterrupted_run(runs: SimpleNamespace) -> None:
    stream = runs.state["streams"]["training"]
    assert runs.state["next_step"] == 3 and stream["kind"] == "lmdb-mix"
    assert runs.state["streams"]["validation"]["kind"] == "lmdb-mix"
    assert (stream["epoch"], stream["consumed"]) == (0, 6)
    whole = [_fids(spy) for spy in spied(runs.whole, 2)]
    assert [_fids(spy) for spy in runs.restarted] == [rank[3:] for rank in whole]
    assert lcurve_rows(runs.parts, 3) == lcurve_rows(runs.whole, 3)
    # on one rank: exactly the rest of the interrupted pass, then the next pass whole
    first, second = _batches(runs, 0), _batches(runs, 1)
    assert _fids(runs.after) == (first[6:] + second)[:5]
