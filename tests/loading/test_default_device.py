"""Nothing the library creates depends on torch's default device.

Training loops call ``torch.set_default_device("cuda")``, and DeePMD-kit's own test suite sets an
invalid CUDA device on purpose to catch tensors created without a device. Each case sets a
default device that is not the CPU around both the construction and the iteration of the
loader pieces, then checks that every tensor is a CPU tensor. ``meta`` catches a tensor created
on the default device by where it lands; ``cuda:9999999`` (on a torch without CUDA) by failing
at once, as in DeePMD-kit's tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from mdloader import DataRequirementItem, DpLoaderSet, collate_batch, get_sampler_from_params
from mdloader.distributed.broadcasting import BroadcastingDataLoader
from mdloader.loading.stateful_loader import StatefulLoader
from mdloader.sampling.samplers import WeightedSystemSampler
from mdloader.testing import make_system

DEVICES = ["meta"] + ([] if torch.cuda.is_available() else ["cuda:9999999"])


@pytest.fixture(params=DEVICES)
def default_device(request: pytest.FixtureRequest) -> Iterator[str]:
    torch.set_default_device(request.param)
    try:
        yield request.param
    finally:
        torch.set_default_device("cpu")


@pytest.fixture(scope="module")
def systems(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("data")
    return [make_system(root, "a", natoms=6, nframes=7),
            make_system(root, "b", natoms=4, nframes=5, pbc=False, seed=1),
            make_system(root, "c", natoms=3, nframes=4, backend="hdf5", seed=2)]


def _all_cpu(batch: dict) -> None:
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert tensors and {v.device.type for v in tensors.values()} == {"cpu"}, {
        k: v.device for k, v in tensors.items()}


def _loader_set(systems: list[str]) -> DpLoaderSet:
    ls = DpLoaderSet(systems, 2, ["O", "H"], seed=3)
    ls.add_data_requirement([DataRequirementItem("energy", 1, must=True, high_prec=True),
                             DataRequirementItem("force", 3, atomic=True, must=True)])
    return ls


def test_a_non_cpu_default_device_really_is_in_effect(default_device: str) -> None:
    if default_device == "meta":
        assert torch.zeros(1).device.type == "meta"
    else:
        # torch's words differ between releases: "CUDA", or "no NVIDIA driver" (torch 2.3)
        with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
            torch.zeros(1)


def test_loader_set_sampler_and_outer_loader(default_device: str, systems: list[str]) -> None:
    ls = _loader_set(systems)
    sampler = get_sampler_from_params(ls, {"auto_prob": "prob_sys_size"}, num_workers=0)
    assert sampler.weights.device.type == "cpu"
    assert float(sampler.weights.sum()) == pytest.approx(1.0)
    _all_cpu(ls[0])
    _all_cpu(next(iter(ls.dataloaders[1])))
    loader = StatefulLoader(ls, sampler)
    batches = list(loader) + list(loader)  # two epochs: each iter() creates a torch iterator
    assert len(batches) == 2 * ls.total_batch == 18
    for batch in batches:
        _all_cpu(batch)
    assert loader.state_dict()["sampler"]["steps"] == 18


def test_sampler_alone(default_device: str) -> None:
    sampler = WeightedSystemSampler([5, 3], [2, 1], [0.25, 0.75], seed=1)
    assert sampler.weights.device.type == "cpu"
    assert len(list(sampler)) == 6  # one epoch: ceil(5 / 2) + 3 batches
    assert np.asarray(sampler.weights).tolist() == [0.25, 0.75]


def test_torch_dataloader_created_under_cpu_like_deepmd(default_device: str,
                                                        systems: list[str]) -> None:
    """DeePMD-kit's trainer creates its DataLoader iterator under ``torch.device("cpu")``."""
    ls = _loader_set(systems)
    sampler = get_sampler_from_params(ls, {"sys_probs": [0.5, 0.25, 0.25]}, num_workers=0)
    loader = DataLoader(ls, sampler=sampler, batch_size=None, collate_fn=lambda b: b)
    with torch.device("cpu"):
        iterator = iter(loader)
    for _ in range(6):
        _all_cpu(next(iterator))


def test_collate_and_frames(default_device: str, systems: list[str]) -> None:
    ls = _loader_set(systems)
    frames = [ls.systems[0][i] for i in range(3)]
    _all_cpu(collate_batch(frames))
    _all_cpu(ls.systems[2].get_batch([0, 3]))


def test_broadcasting_loader_in_one_process(default_device: str, systems: list[str]) -> None:
    ls = _loader_set(systems)
    sampler = get_sampler_from_params(ls, {"auto_prob": "prob_uniform"}, num_workers=0)
    loader = BroadcastingDataLoader(StatefulLoader(ls, sampler))
    for _, batch in zip(range(4), loader):
        _all_cpu(batch)
    assert loader.state_dict()["source"]["sampler"]["steps"] == 4
