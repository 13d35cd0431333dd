"""``mdloader dp --pt train`` with an LMDB ``systems``: DeePMD-kit's trainer runs on mdloader's
loader (the database's groups are its systems), not on DeePMD-kit's LMDB path, and its
neighbour statistics still read the database through DeePMD-kit's own LMDB sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_deepmd_integration import STEPS, _run, dp_job, peer  # noqa: F401 - the fixture

from mdloader.catalog.discover import discover_systems
from mdloader.testing import make_dataset, make_lmdb


def _job(tmp_path: Path) -> tuple[Path, int]:
    db = make_lmdb(tmp_path / "train.lmdb", make_dataset(tmp_path / "src", 6, nframes=8, seed=3))
    return dp_job(tmp_path, db, "auto"), len(discover_systems(db))


def _spies(job: Path, world: int, groups: int) -> None:
    for rank in range(world):
        spy = json.loads((job / f"spy.rank{rank}.json").read_text())
        assert spy["dataset"] == "mdloader.integrations.deepmd.systems.DeepmdDpLoaderSet"
        assert spy["sampler"] == "mdloader.sampling.samplers.WeightedSystemSampler"
        assert spy["nsys"] == groups and spy["steps"] == STEPS
        assert spy["deepmd_process_systems"] == 0
        if world == 1:  # with workers, the batches are read in the workers, out of sight
            assert spy["mdloader_reads"] >= STEPS
    assert (job / f"model.ckpt-{STEPS}.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp_train_on_an_lmdb_uses_mdloader(peer: str, tmp_path: Path) -> None:  # noqa: F811
    job, groups = _job(tmp_path)
    _run([peer, "spy.py", "--pt", "train", "input.json"], job, NUM_WORKERS="0")
    _spies(job, 1, groups)
    assert groups == 6


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_dp_train_on_an_lmdb_torchrun_two_ranks(peer: str, tmp_path: Path) -> None:  # noqa: F811
    job, groups = _job(tmp_path)
    _run([peer, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "spy.py",
          "--pt", "train", "input.json", "--skip-neighbor-stat"], job, NUM_WORKERS="2")
    _spies(job, 2, groups)
