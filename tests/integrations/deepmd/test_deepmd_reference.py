"""mdloader against DeePMD-kit 3.2.0 itself, run in the reference environment (:mod:`deepmd_env`).

The checks of DeePMD-kit's own tests, with DeePMD-kit computing the expected side live: its
PyTorch loader's system order, ``index`` and sampler weights; its universal ``make_stat_input``
(``DeepmdDataSystem``) against its PyTorch ``make_stat_input`` fed by mdloader's ``systems`` and
``dataloaders`` (normal, mixed type, spin with a repeated system); its whole-set reader on the
flat ``aparam.npy`` of the fparam example; ``assertLogs(logger="deepmd")`` under ``install()``;
and its trainer under ``install()`` with the invalid CUDA default device its tests set.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.deepmd_env import require_deepmd_python

from mdloader.testing import make_dataset

REPO = Path(__file__).resolve().parents[3]

COMPARE = r'''
import json, sys, unittest
import numpy as np
import torch
import deepmd.pt.utils.dataloader as dl
from deepmd.pt.utils.stat import make_stat_input as pt_stat
from deepmd.utils.data import DataRequirementItem as Item, DeepmdData
from deepmd.utils.data_system import DeepmdDataSystem
from deepmd.utils.model_stat import make_stat_input as universal_stat
import mdloader

repo = sys.argv[1]
water = f"{repo}/examples/water/data"
fixtures = f"{repo}/tests/fixtures/deepmd-tests"
single = f"{fixtures}/pt/model/water/data/single"
nio = f"{fixtures}/pt/NiO/data/data_0"
out = {}

systems = [single, f"{water}/data_1", f"{water}/data_0"]
theirs = dl.DpLoaderSet(systems, "auto", ["O", "H"], seed=10, shuffle=False)
ours = mdloader.DpLoaderSet(systems, "auto", ["O", "H"], seed=10, shuffle=False)
out["systems"] = [[s.system for s in theirs.systems], [s.system for s in ours.systems]]
out["index"] = [theirs.index, ours.index]
out["weights"] = {}
for style in ["prob_uniform", "prob_sys_size", "prob_sys_size;0:1:0.2;1:3:0.8"]:
    out["weights"][style] = [dl.get_weighted_sampler(theirs, style).weights.tolist(),
                             mdloader.get_weighted_sampler(ours, style).weights.tolist()]
for probs in ([0.2, 0.3, 0.5], [0.6, -1, -1]):
    out["weights"][str(probs)] = [
        dl.get_weighted_sampler(theirs, probs, sys_prob=True).weights.tolist(),
        mdloader.get_weighted_sampler(ours, probs, sys_prob=True).weights.tolist()]


def compare_stat(systems, type_map, items):
    """DeePMD-kit's consistency test: per system, key presence, find flags, frames, sizes."""
    reference = DeepmdDataSystem(systems=systems, batch_size=1, test_size=1, rcut=3.0,
                                 type_map=type_map)
    for it in items:
        reference.add(it.key, it.ndof, atomic=it.atomic, must=it.must, high_prec=it.high_prec)
    expected = universal_stat(reference, 2)
    loader = mdloader.DpLoaderSet(systems, 1, type_map, seed=10)
    loader.add_data_requirement(items)
    got = pt_stat(loader.systems, loader.dataloaders, 2)
    bad = []
    for i, (u, p) in enumerate(zip(expected, got)):
        for key in u:
            if key not in p:
                bad.append(f"{i}:{key} missing")
                continue
            a = np.asarray(u[key], dtype=np.float64)
            b = p[key].cpu().numpy() if isinstance(p[key], torch.Tensor) else p[key]
            b = np.asarray(b, dtype=np.float64)
            if key.startswith("find_"):
                if bool(a) != bool(np.ravel(b)[0] > 0.5):
                    bad.append(f"{i}:{key} flag")
                continue
            na, nb = (a.shape[0] if a.ndim >= 2 else 1), (b.shape[0] if b.ndim >= 2 else 1)
            if na != nb or a.size // na != b.size // nb:
                bad.append(f"{i}:{key} {a.shape} vs {b.shape}")
    return [len(expected), len(got), bad]


energy_force = [Item("energy", 1, atomic=False, must=False, high_prec=True),
                Item("force", 3, atomic=True, must=False, high_prec=False)]
out["stat"] = {
    "normal": compare_stat([f"{water}/data_0", f"{water}/data_1"], ["O", "H"], energy_force),
    "mixed": compare_stat([f"{fixtures}/tf/finetune/data_mixed_type"], ["O", "H"],
                          energy_force),
    "spin": compare_stat([nio, nio], ["Ni", "O"],
                         energy_force + [Item("spin", 3, atomic=True, must=True)]),
}

fparam = f"{repo}/tests/fixtures/deepmd-examples/fparam/data/e3000_i2000"
whole_set = DeepmdData(fparam, type_map=None)
whole_set.add("aparam", 1, atomic=True)
expected = whole_set._load_set(whole_set.dirs[0])["aparam"]
system = mdloader.DeepmdDataSetForLoader(fparam)
system.add_data_requirement([mdloader.DataRequirementItem("aparam", 1, atomic=True)])
got = system.get_batch(list(range(100)))["aparam"].numpy().reshape(100, -1)
out["flat_aparam"] = [expected.dtype.str, got.dtype.str, bool(np.array_equal(expected, got))]

import mdloader.integrations.deepmd as md
md.install()
case = unittest.TestCase()
with case.assertLogs(logger="deepmd") as cm:
    with case.assertRaises(ValueError):
        dl.DpLoaderSet([f"{water}/data_0"], "filter:191", ["O", "H"], seed=10)
out["logs"] = cm.output[-1]
md.uninstall()
print("RESULT " + json.dumps(out))
'''

TRAINER = r'''
import json, os, sys
import torch
torch.set_default_device("cuda:9999999")  # as DeePMD-kit's tests/pt/__init__.py does
import mdloader.integrations.deepmd as md
md.install()
from deepmd.pt.entrypoints.main import get_trainer
from deepmd.utils.argcheck import normalize
from deepmd.utils.compat import update_deepmd_input

config = {
    "model": {"type_map": ["O", "H"],
              "descriptor": {"type": "se_e2_a", "sel": [12, 24], "rcut_smth": 0.5, "rcut": 4.0,
                             "neuron": [4, 8], "axis_neuron": 4, "seed": 1},
              "fitting_net": {"neuron": [8, 8], "seed": 1}, "data_stat_nbatch": 2},
    "learning_rate": {"type": "exp", "decay_steps": 5, "start_lr": 1e-3, "stop_lr": 1e-5},
    "loss": {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
             "limit_pref_f": 1},
    "training": {"training_data": {"systems": ["data"], "batch_size": 2},
                 "validation_data": {"systems": ["data"], "batch_size": 1, "numb_btch": 1},
                 "numb_steps": 3, "seed": 7, "disp_freq": 1, "save_freq": 3},
}
trainer = get_trainer(normalize(update_deepmd_input(config, warning=False)))
trainer.run()
loader = trainer.training_dataloader
print("RESULT " + json.dumps({
    "dataset": type(loader.dataset).__module__, "sampler": type(loader.sampler).__qualname__,
    "weights_device": str(loader.sampler.weights.device), "nsys": len(loader.dataset),
    "files": sorted(f for f in os.listdir(".") if f.startswith("model.ckpt"))}))
'''


@pytest.fixture(scope="module")
def peer() -> str:
    return require_deepmd_python()


def _run(python: str, script: str, cwd: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUM_WORKERS="0")
    proc = subprocess.run([python, "-c", script, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def compared(peer: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(peer, COMPARE, tmp_path_factory.mktemp("compare"), str(REPO))


@pytest.mark.slow
def test_order_index_and_weights_are_deepmd_kits(compared: dict) -> None:
    theirs, ours = compared["systems"]
    assert ours == theirs and ours[0].endswith("single")  # the order written, not sorted
    assert compared["index"] == [[1, 160, 80], [1, 160, 80]]
    for style, (expected, got) in compared["weights"].items():
        assert got == pytest.approx(expected, rel=1e-12), style


@pytest.mark.slow
@pytest.mark.parametrize("case,nsys", [("normal", 2), ("mixed", 1), ("spin", 2)])
def test_stat_input_matches_deepmd_universal_reference(compared: dict, case: str,
                                                       nsys: int) -> None:
    assert compared["stat"][case] == [nsys, nsys, []]


@pytest.mark.slow
def test_flat_aparam_is_bit_identical_to_the_whole_set_reader(compared: dict) -> None:
    assert compared["flat_aparam"] == ["<f8", "<f8", True]


@pytest.mark.slow
def test_filter_warning_is_a_deepmd_record_under_install(compared: dict) -> None:
    assert compared["logs"] == ("WARNING:mdloader.sampling.batching:Remove 1 systems with more "
                                "than 191 atoms")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepmd_trainer_under_install_with_an_invalid_cuda_default_device(
        peer: str, tmp_path: Path) -> None:
    make_dataset(tmp_path / "data", 4, nframes=6, seed=3)
    info = _run(peer, TRAINER, tmp_path)
    assert info == {"dataset": "mdloader.integrations.deepmd.systems",
                    "sampler": "WeightedSystemSampler", "weights_device": "cpu", "nsys": 4,
                    "files": ["model.ckpt-3.pt", "model.ckpt-3.pt.mdloader", "model.ckpt.pt",
                              "model.ckpt.pt.mdloader"]}  # the loader state beside each
