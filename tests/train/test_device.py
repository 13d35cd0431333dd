"""Where a batch goes, without a GPU: which copies may run without blocking the host, which device
a rank takes, and what a packet makes of a tensor that is not on the host.

The copy itself is checked on a GPU by ``benchmarks/gpu/run.sh`` (docs/benchmarks.md, "On a GPU");
here a stand-in tensor records the ``non_blocking`` flag each copy asks for.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mdloader.distributed import group
from mdloader.distributed import packets as pk
from mdloader.errors import ConfigError
from mdloader.transport import non_blocking_copy, to_device
from mdloader.world import World

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 1)


@pytest.mark.parametrize("source, target, pinned, expected", [
    (CPU, CUDA, True, True),     # pinned host memory to a GPU: asynchronous
    (CPU, CUDA, False, False),   # pageable memory: the host waits anyway
    (CPU, CPU, True, False),     # no device copy
    (CUDA, CPU, False, False),   # to the host: it must be complete before the host reads it
    (CUDA, torch.device("cuda", 0), False, False),
])
def test_only_pinned_host_to_gpu_copies_do_not_block(source: torch.device, target: torch.device,
                                                     pinned: bool, expected: bool) -> None:
    assert non_blocking_copy(source, target, pinned) is expected


class _Recorded:
    """A stand-in tensor on the host: pinned or not, it records each ``to`` it is asked for."""

    def __init__(self, pinned: bool) -> None:
        self.device, self.pinned, self.calls = CPU, pinned, []

    def is_pinned(self) -> bool:
        return self.pinned

    def to(self, *args: Any, **kwargs: Any) -> _Recorded:
        self.calls.append((args, kwargs))
        return self


@pytest.mark.parametrize("pinned", [True, False])
def test_a_batch_tensor_goes_to_its_gpu_by_name_then_changes_type_there(pinned: bool) -> None:
    tensor = _Recorded(pinned)
    to_device(tensor, CUDA, torch.float64)  # type: ignore[arg-type]
    assert tensor.calls == [((CUDA,), {"non_blocking": pinned}), ((torch.float64,), {})]


def test_to_device_on_the_cpu_keeps_the_values() -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert to_device(x, CPU) is x
    y = to_device(x, CPU, torch.float64)
    assert y.dtype == torch.float64 and torch.equal(y, x.double())


@pytest.mark.parametrize("local_rank, gpus, expected", [
    (0, 0, "cpu"), (3, 0, "cpu"), (0, 1, "cuda:0"), (3, 4, "cuda:3"),
])
def test_a_rank_takes_the_gpu_of_its_local_rank(local_rank: int, gpus: int,
                                                expected: str) -> None:
    assert group.rank_device(local_rank, gpus) == torch.device(expected)


def test_more_ranks_than_visible_gpus_is_refused_with_the_remedy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1 but this process sees 1 CUDA device\(s\) "
                                          r"\(CUDA_VISIBLE_DEVICES=2\): start at most one rank "
                                          r"per visible GPU"):
        group.rank_device(1, 1)


def test_without_cuda_a_rank_uses_the_cpu_and_sets_no_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: benchmarks/gpu/run.sh checks this case")
    assert group.use_device(World(local_rank=2, local_world_size=3)) == CPU


def test_a_packet_leaves_host_tensors_and_other_objects_as_they_are() -> None:
    x = torch.ones(3)
    assert pk.on_host(x) is x and pk.on_host([x]) == [x]
    meta = torch.empty(2, device="meta")
    assert pk.on_host(meta) is meta  # no data to copy: torch pickles it as it is
    got = pk.open_packet(pk.data_packet({"x": x, "n": 1}, rank=0), rank=0)
    assert got["x"].device == CPU and torch.equal(got["x"], x) and got["n"] == 1
