"""DeePMD-kit's own trainer on mdloader (``mdloader.integrations.deepmd``).

The pure pieces run everywhere. The end-to-end runs need an interpreter that can import
DeePMD-kit's PyTorch backend (:mod:`deepmd_env`: the venv of ``scripts/deepmd-env.sh``, which
the README's test command creates). They run
``dp --pt train`` for a few steps on generated data, single rank and under
``torchrun --nproc_per_node=2``, with a spy that records which loader and sampler the trainer
really used, how many batches mdloader read, and whether DeePMD-kit's own discovery ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from support.deepmd_env import require_deepmd_python
from support.inputs import write_input

from mdloader.errors import ConfigError
from mdloader.integrations.deepmd import (
    DeepmdDpLoaderSet,
    DeferredSystems,
    InputStatTakeover,
    cpu_fallback_backend,
    defer_discovery,
)
from mdloader.integrations.deepmd.shims import trainer_dist as _TrainerDist
from mdloader.testing import make_dataset, make_system

REPO = Path(__file__).resolve().parents[3]
STEPS = 6

SPY = r'''
import json, os, sys
import mdloader.integrations.deepmd as md
md.install()
import deepmd.utils.data_system as ds
import deepmd.pt.train.training as tr
calls = {"deepmd_process_systems": 0, "mdloader_reads": 0}
_ps = ds.process_systems
def process_systems(*a, **k):
    calls["deepmd_process_systems"] += 1
    return _ps(*a, **k)
ds.process_systems = process_systems
_read = md.DeepmdDpLoaderSet.read
def read(self, sid, fids):
    calls["mdloader_reads"] += 1
    return _read(self, sid, fids)
md.DeepmdDpLoaderSet.read = read
_run = tr.Trainer.run
def run(self):
    _run(self)
    dl = self.training_dataloader
    name = lambda o: type(o).__module__ + "." + type(o).__qualname__
    info = {"dataset": name(dl.dataset), "sampler": name(dl.sampler), "rank": self.rank,
            "world": self.world_size, "nsys": len(dl.dataset),
            "weights_sum": float(dl.sampler.weights.sum()), "sampler_rank": dl.sampler.order.rank,
            "sampler_seed": dl.sampler.order.seed, "steps": self.num_steps, **calls}
    with open(f"spy.rank{self.rank}.json", "w") as fh:
        json.dump(info, fh)
tr.Trainer.run = run
sys.exit(md.run_dp(sys.argv[1:]))
'''


# -- pure pieces ------------------------------------------------------------------------------
def test_defer_discovery_touches_nothing_and_keeps_patterns() -> None:
    deferred = defer_discovery("/does/not/exist", ["data_*"])
    assert list(deferred) == ["/does/not/exist"] and deferred.patterns == ["data_*"]
    assert defer_discovery(["a", "b"]).patterns is None


def test_defer_discovery_rejects_other_types() -> None:
    with pytest.raises(ConfigError, match=r"training.training_data.systems: systems must be a "
                                          r"path or a list of paths, got int"):
        defer_discovery(3)  # type: ignore[arg-type]


def test_loader_set_with_deepmd_signature(tmp_path: Path) -> None:
    make_dataset(tmp_path / "d", 3, nframes=4, seed=1)
    (tmp_path / "d" / "other").mkdir()
    make_dataset(tmp_path / "d" / "other", 1, nframes=4, seed=2)
    ls = DeepmdDpLoaderSet(DeferredSystems([str(tmp_path / "d")], ["sys.*"]), 2, ["O", "H"],
                           seed=[0, 11])
    assert len(ls) == 4 and ls.seed == 11
    only_top = DeepmdDpLoaderSet([str(tmp_path / "d" / "other")], 2, ["O", "H"], seed=5)
    assert len(only_top) == 1


def test_statistics_frames_are_a_one_rank_jobs_first_batches(tmp_path: Path) -> None:
    """The frames each system gives the input statistics: what DeePMD-kit's ``make_stat_input``
    reads through the per-system loaders of a one-rank job (its first ``data_stat_nbatch``
    batches of pass 0), ``None`` where they cover the system."""
    systems = [make_system(tmp_path, f"s{i}", natoms=n, nframes=f, seed=i)
               for i, (n, f) in enumerate([(4, 6), (6, 13), (8, 20), (3, 9)])]
    data = DeepmdDpLoaderSet(systems, "auto:12", ["O", "H"], seed=[0, 11])  # sizes 3, 2, 2, 4
    takeover = InputStatTakeover(None, data, lambda: None, None, [], nbatch=3)
    counts = takeover.frame_counts()
    for sid, loader in enumerate(data.dataloaders):
        first = [f for j, _ in zip(range(3), range(len(loader)))
                 for f in data.frame_order.fids(sid, j)]
        assert counts[sid] == len(first) == len(set(first))
        chosen = takeover.frames(sid)
        if chosen is None:
            assert sorted(first) == list(range(len(data.systems[sid])))
        else:
            assert chosen.tolist() == first and len(first) < len(data.systems[sid])
    assert [takeover.frames(i) is None for i in range(4)] == [True, False, False, True]
    other = InputStatTakeover(None, DeepmdDpLoaderSet(systems, "auto:12", ["O", "H"], seed=[0, 12]),
                          lambda: None, None, [], nbatch=3)
    assert takeover.frames(2).tolist() != other.frames(2).tolist()  # the job's seed draws them


def test_cpu_fallback_backend() -> None:
    fake = types.SimpleNamespace(is_nccl_available=lambda: False)
    assert cpu_fallback_backend("cuda:nccl,cpu:gloo", fake) == "gloo"
    assert cpu_fallback_backend("nccl", fake) == "gloo"
    assert cpu_fallback_backend("gloo", fake) == "gloo"
    assert cpu_fallback_backend(None, fake) is None


def test_trainer_dist_barrier_before_destroy() -> None:
    calls: list[str] = []
    real = types.ModuleType("torch.distributed")
    real.is_initialized = lambda: True  # type: ignore[attr-defined]
    real.get_world_size = lambda: 2  # type: ignore[attr-defined]
    real.barrier = lambda: calls.append("barrier")  # type: ignore[attr-defined]
    real.destroy_process_group = lambda g=None: calls.append("destroy")  # type: ignore
    real.get_rank = lambda: 1  # type: ignore[attr-defined]
    shim = _TrainerDist(real)
    shim.destroy_process_group()
    assert calls == ["barrier", "destroy"] and shim.get_rank() == 1


def test_install_without_deepmd_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from mdloader.integrations.deepmd import install

    monkeypatch.setitem(sys.modules, "deepmd", None)  # as if DeePMD-kit were not installed
    with pytest.raises(ConfigError, match="DeePMD-kit's PyTorch backend cannot be imported"):
        install()


def test_installed_logs_are_deepmd_records(caplog: pytest.LogCaptureFixture) -> None:
    """While installed, mdloader's records reach the ``deepmd`` logger at its level, as
    DeePMD-kit's test ``assertLogs(logger="deepmd")`` expects of DpLoaderSet's filter warning."""
    import logging

    from mdloader.integrations.deepmd.patching import _restore_logs, _route_logs_to_deepmd
    from mdloader.sampling.batching import resolve_batch_sizes

    deepmd, mdl = logging.getLogger("deepmd"), logging.getLogger("mdloader")
    before = (mdl.level, mdl.propagate, list(mdl.handlers), deepmd.level)
    records: list[logging.LogRecord] = []
    catcher = logging.Handler()
    catcher.emit = records.append  # type: ignore[method-assign]
    deepmd.addHandler(catcher)
    deepmd.setLevel(logging.WARNING)
    _route_logs_to_deepmd()
    try:
        with pytest.raises(ValueError, match="No system left"):
            resolve_batch_sizes("filter:191", [192])
        logging.getLogger("mdloader.loading.build").info("below the deepmd level: dropped")
        assert [r.getMessage() for r in records] == [
            "Remove 1 systems with more than 191 atoms"]
        assert mdl.propagate is False  # the root sees it once, through "deepmd"
        assert [r.name for r in caplog.records] == ["mdloader.sampling.batching"]
    finally:
        _restore_logs()
        deepmd.removeHandler(catcher)
        deepmd.setLevel(before[3])
    assert (mdl.level, mdl.propagate, list(mdl.handlers)) == before[:3]


# -- end to end with DeePMD-kit ---------------------------------------------------------------
@pytest.fixture(scope="module")
def peer() -> str:
    return require_deepmd_python()


def dp_job(tmp_path: Path, systems: object, batch_size: object) -> Path:
    """A small ``dp --pt train`` job in ``tmp_path``: its ``input.json`` and the spy."""
    config = {
        "model": {"type_map": ["O", "H"],
                  "descriptor": {"type": "se_e2_a", "sel": [12, 24], "rcut_smth": 0.5,
                                 "rcut": 4.0, "neuron": [4, 8], "axis_neuron": 4, "seed": 1},
                  "fitting_net": {"neuron": [8, 8], "seed": 1}},
        "learning_rate": {"type": "exp", "decay_steps": 5, "start_lr": 1e-3, "stop_lr": 1e-5},
        "loss": {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
                 "limit_pref_f": 1},
        "training": {"training_data": {"systems": systems, "batch_size": batch_size},
                     "numb_steps": STEPS, "seed": 7, "disp_freq": 2, "save_freq": STEPS},
    }
    write_input(tmp_path, config)
    (tmp_path / "spy.py").write_text(SPY)
    return tmp_path


def _job(tmp_path: Path) -> Path:
    make_dataset(tmp_path / "data", 6, nframes=8, seed=3)
    return dp_job(tmp_path, [str(tmp_path / "data")], 2)


def _run(cmd: list[str], cwd: Path, **env: str) -> str:
    full_env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _check(job: Path, world: int) -> list[dict]:
    spies = [json.loads((job / f"spy.rank{r}.json").read_text()) for r in range(world)]
    for r, spy in enumerate(spies):
        assert spy["dataset"] == "mdloader.integrations.deepmd.systems.DeepmdDpLoaderSet"
        assert spy["sampler"] == "mdloader.sampling.samplers.WeightedSystemSampler"
        assert (spy["rank"], spy["world"], spy["sampler_rank"]) == (r, world, r)
        assert spy["nsys"] == 6 and spy["sampler_seed"] == 7 and spy["steps"] == STEPS
        assert spy["weights_sum"] == pytest.approx(1.0)
        assert spy["deepmd_process_systems"] == 0  # DeePMD-kit's own walk never ran
    steps = [int(line.split()[0]) for line in (job / "lcurve.out").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert steps[-1] == STEPS
    assert (job / f"model.ckpt-{STEPS}.pt").exists()
    return spies


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp_train_single_rank(peer: str, tmp_path: Path) -> None:
    job = _job(tmp_path)
    out = _run([peer, "spy.py", "--pt", "train", "input.json", "--skip-neighbor-stat"], job,
               NUM_WORKERS="0")
    (spy,) = _check(job, 1)
    # data_stat_nbatch=10 covers every frame of each system: mdloader computes the input
    # statistics in shares (not through the per-system loaders); then one read per step
    assert "input statistics: all frames of 6 systems, in shares on 1 ranks" in out
    assert spy["mdloader_reads"] >= STEPS


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_dp_train_torchrun_two_ranks(peer: str, tmp_path: Path) -> None:
    job = _job(tmp_path)
    out = _run([peer, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "spy.py", "--pt", "train", "input.json", "--skip-neighbor-stat"], job,
               NUM_WORKERS="2")
    _check(job, 2)
    # the data-stall report, every disp_freq steps beside lcurve.out, then the run's summary
    stalls = [json.loads(line) for line in (job / "stalls.jsonl").read_text().splitlines()]
    assert [(r["kind"], r.get("last_step"), r["ranks"]) for r in stalls] == [
        *(("window", step, 2) for step in range(2, STEPS + 1, 2)), ("summary", None, 2)]
    assert f"data stalls, steps {STEPS - 1}-{STEPS} (2 ranks)" in out
    assert f"data stalls over the run ({STEPS} steps, 2 ranks)" in out
