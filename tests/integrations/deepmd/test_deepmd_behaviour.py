"""What DeePMD-kit's own loader tests check, as mdloader's tests, on real data.

The sources are DeePMD-kit's ``source/tests/pt/test_sampler.py``, ``test_dploaderset.py`` (its
batch-size numbers are in ``test_loader.py``) and ``source/tests/consistent/
test_make_stat_input.py``: sampler weights per style, ``sid``/``fid`` pointing back at the frame,
empirical system frequencies, identical streams under identical seeds, and the per-system
statistics input that ``make_stat_input`` packs. No DeePMD-kit import: the expected weights were
computed with DeePMD-kit 3.2.0 (``DeepmdDataSystem.set_sys_probs`` and its PyTorch
``get_weighted_sampler``, which agree), and ``test_deepmd_reference.py`` recomputes them live.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from mdloader import DataRequirementItem, DpLoaderSet, get_sampler_from_params, get_weighted_sampler

REPO = Path(__file__).resolve().parents[3]
WATER = REPO / "examples" / "water" / "data"
FIXTURES = REPO / "tests" / "fixtures" / "deepmd-tests"
SINGLE = FIXTURES / "pt" / "model" / "water" / "data" / "single"  # one frame
NIO = FIXTURES / "pt" / "NiO" / "data" / "data_0"
MIXED = FIXTURES / "tf" / "finetune" / "data_mixed_type"

# [single, data_1, data_0]: 1, 160 and 80 frames of 192 atoms, batch "auto" (1 frame): written
# in this order on purpose, since probabilities are positional.
SYSTEMS = [str(SINGLE), str(WATER / "data_1"), str(WATER / "data_0")]
INDEX = [1, 160, 80]
EXPECTED = {  # DeePMD-kit 3.2.0's numbers for SYSTEMS
    "prob_uniform": [1 / 3, 1 / 3, 1 / 3],
    "prob_sys_size": [1 / 241, 160 / 241, 80 / 241],
    "prob_sys_size;0:1:0.2;1:3:0.8": [0.2, 0.8 * 160 / 240, 0.8 * 80 / 240],
    "prob_sys_size;0:2:0.5;2:3:0.5": [0.5 / 161, 0.5 * 160 / 161, 0.5],
}
EXPECTED_SYS_PROBS = [([0.2, 0.3, 0.5], [0.2, 0.3, 0.5]),
                      ([0.6, -1, -1], [0.6, 0.4 * 160 / 240, 0.4 * 80 / 240]),
                      ([0.5, 0.5, 0.0], [0.5, 0.5, 0.0])]
ENERGY_FORCE = [DataRequirementItem("energy", 1, atomic=False, must=False, high_prec=True),
                DataRequirementItem("force", 3, atomic=True, must=False, high_prec=False)]


def _loader_set(systems=SYSTEMS, **kw) -> DpLoaderSet:
    return DpLoaderSet(systems, kw.pop("batch_size", "auto"), ["O", "H"], seed=10,
                       shuffle=False, **kw)


def _outer(ls: DpLoaderSet, sampler) -> DataLoader:
    """The outer loader of DeePMD-kit's tests and trainer."""
    return DataLoader(ls, sampler=sampler, batch_size=None, num_workers=0, drop_last=False,
                      collate_fn=lambda batch: batch)


def _sid_stream(loader: DataLoader, steps: int) -> list[tuple[int, tuple[int, ...]]]:
    """(sid, fids) of ``steps`` batches, restarting the loader when it ends (DeePMD-kit's loop)."""
    out, it = [], iter(loader)
    while len(out) < steps:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        out.append((int(batch["sid"]), tuple(batch["fid"])))
    return out


def test_the_order_written_is_the_order_of_systems_index_and_sid() -> None:
    ls = _loader_set()
    assert [s.system for s in ls.systems] == SYSTEMS and ls.index == INDEX


@pytest.mark.parametrize("style", list(EXPECTED))
def test_sampler_weights_per_style_are_deepmd_numbers(style: str) -> None:
    sampler = get_weighted_sampler(_loader_set(), prob_style=style)
    assert sampler.weights.dtype == torch.float64
    np.testing.assert_allclose(np.asarray(sampler.weights), EXPECTED[style], rtol=1e-12)


@pytest.mark.parametrize("sys_probs,expected", EXPECTED_SYS_PROBS)
def test_sys_probs_are_deepmd_numbers_and_win_over_auto_prob(sys_probs, expected) -> None:
    ls = _loader_set()
    direct = get_weighted_sampler(ls, sys_probs, sys_prob=True)
    params = get_sampler_from_params(ls, {"sys_probs": sys_probs, "auto_prob": "prob_uniform"})
    np.testing.assert_allclose(np.asarray(direct.weights), expected, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(params.weights), expected, rtol=1e-12)
    fallback = get_sampler_from_params(ls, {"sys_probs": None, "auto_prob": "prob_uniform"})
    np.testing.assert_allclose(np.asarray(fallback.weights), EXPECTED["prob_uniform"])


def test_sid_and_fid_point_back_at_the_frame() -> None:
    ls = _loader_set(batch_size=2)
    sampler = get_weighted_sampler(ls, prob_style="prob_sys_size")
    for batch in _outer(ls, sampler):
        sid, fids = int(batch["sid"]), batch["fid"]
        for row, fid in enumerate(fids):
            frame = ls.systems[sid][fid]
            np.testing.assert_array_equal(batch["coord"][row].numpy(), frame["coord"])
        if sid != 0:  # one batch of data_0 or data_1 is enough after the single frame
            break


def _steps_for(ls: DpLoaderSet, weights: np.ndarray, num_epoch: float) -> int:
    """DeePMD-kit's steps for ``num_epoch``: ceil(num_epoch * ceil(max_i nb_i / p_i))."""
    p = weights / weights.sum()
    per_epoch = math.ceil(max(n / q for n, q in zip(ls.index, p) if q > 0))
    return math.ceil(num_epoch * per_epoch)


def test_empirical_frequencies_follow_the_weights_and_seeds_repeat_the_stream() -> None:
    params = {"sys_probs": [0.2, 0.3, 0.5], "auto_prob": "prob_sys_size"}
    ls = _loader_set()
    sampler = get_sampler_from_params(ls, params)
    weights = np.asarray(sampler.weights)
    steps = _steps_for(ls, weights, 1.5)
    stream = _sid_stream(_outer(ls, sampler), steps)
    counts = np.bincount([sid for sid, _ in stream], minlength=3)
    np.testing.assert_allclose(counts / steps, weights / weights.sum(), atol=0.1)
    again = _loader_set()  # a new loader with the same seed: the very same stream
    assert _sid_stream(_outer(again, get_sampler_from_params(again, params)), steps) == stream
    other = DpLoaderSet(SYSTEMS, "auto", ["O", "H"], seed=11, shuffle=False)
    assert _sid_stream(_outer(other, get_sampler_from_params(other, params)), steps) != stream


def test_two_tasks_drawn_by_an_outer_rng_repeat_their_streams() -> None:
    """DeePMD-kit's multi-task stability check: each task's loader keeps its own stream."""
    def run() -> tuple[list[int], list[list[int]]]:
        tasks = [(_loader_set(SYSTEMS[1:]), [0.7, 0.3]), (_loader_set(SYSTEMS[:2]), [0.4, 0.6])]
        loaders = [iter(_outer(ls, get_weighted_sampler(ls, p, sys_prob=True)))
                   for ls, p in tasks]
        rng = np.random.default_rng(321)
        chosen, sids = [], [[], []]
        for _ in range(300):
            task = int(rng.choice(2, p=[0.4, 0.6]))
            chosen.append(task)
            sids[task].append(int(next(loaders[task])["sid"]))
        return chosen, sids

    first, second = run(), run()
    assert first == second
    chosen, sids = first
    for task, probs in ((0, [0.7, 0.3]), (1, [0.4, 0.6])):
        freq = np.bincount(sids[task], minlength=2) / chosen.count(task)
        np.testing.assert_allclose(freq, probs, atol=0.1)


def _stat_input(ls: DpLoaderSet, nbatches: int) -> list[dict]:
    """What DeePMD-kit's PyTorch ``make_stat_input`` packs from ``systems``/``dataloaders``."""
    packed = []
    for sid in range(len(ls.systems)):
        stat: dict = {}
        for j, batch in enumerate(ls.dataloaders[sid]):
            if j == nbatches:
                break
            if batch.get("find_fparam", None) == 0.0 and "fparam" in batch:
                batch.pop("fparam"), batch.pop("find_fparam")
            for key, value in batch.items():
                if isinstance(value, torch.Tensor):
                    stat.setdefault(key, []).append(value)
                elif value is None or isinstance(value, np.float32):
                    stat[key] = value
        packed.append({k: torch.cat(v) if isinstance(v, list) else v for k, v in stat.items()})
    return packed


def _check_stat(stat: dict, natoms: int, ntypes: int, nframes: int, flags: dict) -> None:
    widths = {"coord": 3 * natoms, "force": 3 * natoms, "energy": 1, "box": 9,
              "atype": natoms, "natoms": ntypes + 2}
    for key, flag in flags.items():
        assert isinstance(stat[f"find_{key}"], np.float32) and stat[f"find_{key}"] == flag
    for key, width in widths.items():
        value = stat[key]
        assert value.shape[0] == nframes and value[0].numel() == width, (key, value.shape)
        assert value.device.type == "cpu"


def test_stat_input_normal_systems() -> None:
    ls = DpLoaderSet([str(WATER / "data_0"), str(WATER / "data_1")], 1, ["O", "H"], seed=10)
    ls.add_data_requirement(ENERGY_FORCE)
    stats = _stat_input(ls, nbatches=2)
    assert len(stats) == 2
    for stat in stats:
        _check_stat(stat, 192, 2, 2, {"energy": 1.0, "force": 1.0})
        assert stat["energy"].dtype == torch.float64


def test_stat_input_mixed_type_has_real_natoms_vec() -> None:
    ls = DpLoaderSet([str(MIXED)], 1, ["O", "H"], seed=10)
    ls.add_data_requirement(ENERGY_FORCE)
    (stat,) = _stat_input(ls, nbatches=2)
    natoms = ls.systems[0]._natoms
    _check_stat(stat, natoms, 2, 2, {"energy": 1.0, "force": 1.0})
    real = stat["real_natoms_vec"]
    assert real.shape == (2, 4) and (real[:, 0] == natoms).all()
    assert (real[:, 2:].sum(-1) == natoms).all()  # every atom is a real O or H


def test_stat_input_spin_keeps_a_repeated_system_twice() -> None:
    ls = DpLoaderSet([str(NIO), str(NIO)], 1, ["Ni", "O"], seed=10, shuffle=False)
    ls.add_data_requirement([*ENERGY_FORCE,
                             DataRequirementItem("spin", 3, atomic=True, must=True)])
    stats = _stat_input(ls, nbatches=2)
    assert len(stats) == 2  # DeePMD-kit's test feeds [data_0, data_0] and expects 2 systems
    for stat in stats:
        _check_stat(stat, 32, 2, 2, {"energy": 1.0, "force": 1.0, "spin": 1.0})
        assert stat["spin"].shape == (2, 32, 3)
    torch.testing.assert_close(stats[0]["spin"], stats[1]["spin"])  # unshuffled: same frames


def test_stat_input_fparam_present_in_one_system_only() -> None:
    fparam = REPO / "tests" / "fixtures" / "deepmd-examples" / "fparam" / "data" / "e3000_i2000"
    ls = DpLoaderSet([str(fparam), str(WATER / "data_0")], 1, None, seed=10)
    ls.add_data_requirement([DataRequirementItem("fparam", 1, atomic=False),
                             DataRequirementItem("aparam", 1, atomic=True)])
    with_fparam, without = _stat_input(ls, nbatches=2)
    assert with_fparam["find_fparam"] == 1.0 and with_fparam["fparam"].shape == (2, 1)
    assert with_fparam["find_aparam"] == 1.0 and with_fparam["aparam"].shape == (2, 54, 1)
    assert "fparam" not in without and "find_fparam" not in without  # popped, as DeePMD-kit
    assert without["find_aparam"] == 0.0
