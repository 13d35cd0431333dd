"""The job's process group: transport device, the world without a group, the cached CPU group."""

from __future__ import annotations

import pytest
import torch
from support.distributed_utils import run_ranks, values

from mdloader.distributed import channel, group
from mdloader.distributed import packets as pk
from mdloader.world import World


@pytest.mark.parametrize("backend, device", [
    ("gloo", "cpu"), ("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cpu"), ("mpi", "cpu"),
    ("NCCL", "cuda:3"), ("ucc", "cpu"),
])
def test_transport_device(backend: str, device: str) -> None:
    assert group.transport_device(backend, 3) == torch.device(device)


def test_current_world_without_process_group() -> None:
    assert group.current_world() == World()


def _group_cache(rank: int, world: int, port: int) -> tuple[bool, bool, bool]:
    import datetime
    import os

    import torch.distributed as dist

    first = group.cpu_group(5.0)
    other = group.cpu_group(6.0)
    same = group.cpu_group(5.0) is first and group.cpu_group(6.0) is other
    other_timeout = other is not first
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    fresh = group.cpu_group(6.0)
    chan = channel.Channel(fresh, timeout=5)
    got = pk.open_packet(chan.broadcast(pk.data_packet("hi", rank=0) if rank == 0 else None),
                         rank=rank)
    return same, other_timeout, fresh is not first and got == "hi"


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_cpu_group_is_reused_until_the_default_group_changes() -> None:
    from support.distributed_utils import free_port

    assert values(run_ranks(_group_cache, 2, free_port())) == [(True, True, True)] * 2
