"""Process-group lifecycle and the two small collectives the training and bench jobs need.

NOTE: this is the second module importing ``torch.distributed`` (the rule is "only comm.py").
It exists because comm.py (helper A) has no init/teardown or all-reduce/gather helpers yet;
these functions are meant to move into :mod:`mdloader.comm` unchanged, leaving this module a
re-export.

The process group is started only when the job was launched for several ranks (``WORLD_SIZE``
> 1, as ``torchrun`` sets it), with NCCL when CUDA is available and gloo otherwise. Unlike
DeePMD-kit, which keys on ``LOCAL_RANK`` and silently runs W serial trainings under a launcher
that does not set it, the decision is the world size itself.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from .world import World


def init_from_env() -> World:
    """Start the default group if ``WORLD_SIZE`` > 1 and none is running; return the world."""
    world = World.from_env()
    if world.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group(backend=backend)
    if dist.is_initialized():
        return World(rank=dist.get_rank(), world_size=dist.get_world_size(),
                     local_rank=world.local_rank, local_world_size=world.local_world_size)
    return world


def device_of(world: World) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


@contextmanager
def process_group() -> Iterator[World]:
    """Run a job inside the default group, started here if needed and torn down after.

    On success every rank passes a barrier before ``destroy_process_group`` (torch 2.13 + gloo
    aborts a rank that exits without it); on failure the group is destroyed without a barrier,
    which the failed ranks' peers may never reach.
    """
    started = not is_running() and World.from_env().world_size > 1
    world = init_from_env()
    ok = False
    try:
        yield world
        ok = True
    finally:
        if started and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


def is_running() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_mean(values: np.ndarray | list[float], device: torch.device | None = None
                    ) -> np.ndarray:
    """Mean over ranks of a small float vector (identity in a single process)."""
    arr = np.asarray(values, dtype=np.float64)
    if not is_running():
        return arr
    t = torch.as_tensor(arr, device=device or torch.device("cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().numpy() / dist.get_world_size()


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (a list in rank order); ``None`` on the other ranks."""
    if not is_running():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out if dist.get_rank() == 0 else None


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not is_running():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
