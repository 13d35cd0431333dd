"""Small collectives of a job: one object gathered to rank 0 or broadcast from it, a mean, sums,
flags, and a failure shared by every rank.

Every object travels as one framed packet (:mod:`mdloader.distributed.packets`), so a rank that
cannot pickle its object fails every rank with its error instead of leaving them waiting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mdloader.distributed.channel import world_channel
from mdloader.distributed.group import current_world, transport_device
from mdloader.distributed.packets import Kind, data_packet, error_packet, open_packet
from mdloader.world import World


def all_reduce_mean(values: np.ndarray | list[float]) -> np.ndarray:
    """Mean over ranks of a small float vector (identity in a single process); on the device
    the default group's backend takes (:func:`~mdloader.distributed.group.transport_device`)."""
    arr = np.asarray(values, dtype=np.float64)
    world = current_world()
    if not world.distributed:
        return arr
    tensor = torch.as_tensor(arr, device=transport_device(dist.get_backend(), world.local_rank))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu().numpy() / dist.get_world_size()


def reduce_sums(values: Mapping[str, float]) -> dict[str, float]:
    """Named sums and counts of every rank added up: the same float64 numbers on every rank.

    Every rank must pass the same names. The ranks' values are gathered and added in rank order
    with ``math.fsum`` (correctly rounded), so a metric computed from the reduced sums and counts
    (an RMSE over sharded validation frames) equals a one-rank computation up to the rounding of
    the ranks' own partial sums.
    """
    names = list(values)
    local = np.array([float(values[name]) for name in names], dtype=np.float64)
    world = current_world()
    if not world.distributed:
        return dict(zip(names, local.tolist()))
    device = transport_device(dist.get_backend(), world.local_rank)
    mine = torch.as_tensor(local, device=device)
    parts = [torch.empty_like(mine) for _ in range(world.world_size)]
    dist.all_gather(parts, mine)
    table = torch.stack(parts).cpu().numpy()
    return {name: math.fsum(table[:, i]) for i, name in enumerate(names)}


def gather_to_main(obj: Any, *, timeout: float | None = None,
                   context: str = "gathering to rank 0") -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (rank order), ``None`` elsewhere; framed like a broadcast.

    ``timeout`` overrides ``$MDLOADER_COLLECTIVE_TIMEOUT``.

    A rank whose object cannot be pickled sends an error packet, and every rank raises it.
    """
    world = current_world()
    if not world.distributed:
        return [obj]
    channel = world_channel(timeout=timeout, activity=context)
    received = channel.gather(data_packet(obj, rank=world.rank, context=context))
    for packet in received:
        if packet.kind is Kind.ERROR:
            open_packet(packet, rank=world.rank)  # raises the same RemoteError on every rank
    return [open_packet(p, rank=world.rank) for p in received] if world.is_main else None


def gather_rows_to_main(row: np.ndarray | list[float], *,
                        activity: str) -> np.ndarray | None:
    """Every rank's float vector (one length on every rank) as the rows of a matrix on rank 0,
    ``None`` elsewhere: one gather on the CPU group, bounded by
    ``$MDLOADER_COLLECTIVE_TIMEOUT``; ``activity`` is what the ranks are doing."""
    world = current_world()
    if not world.distributed:
        return np.asarray(row, dtype=np.float64)[None, :]
    return world_channel(activity=activity).gather_rows(np.asarray(row, dtype=np.float64))


def gather_from_every_rank(part: Any, error: BaseException | None = None, *,
                           timeout: float | None = None,
                           context: str = "gathering from every rank") -> list[Any]:
    """Every rank's ``part`` on every rank, in rank order: one all-gather of framed packets.

    A rank passes its ``error`` instead when its part failed (or its part cannot be pickled);
    then every rank raises the :class:`~mdloader.errors.RemoteError` of the lowest failing rank.
    In a single process ``error`` is raised as it is. Merging the parts is the caller's.
    """
    world = current_world()
    if not world.distributed:
        if error is not None:
            raise error
        return [part]
    channel = world_channel(timeout=timeout, activity=context)
    mine = (error_packet(error, rank=world.rank, context=context) if error is not None
            else data_packet(part, rank=world.rank, context=context))
    received = channel.gather(mine)
    for packet in received:
        if packet.kind is Kind.ERROR:
            open_packet(packet, rank=world.rank)  # the same RemoteError on every rank
    return [open_packet(p, rank=world.rank) for p in received]


def agreed_seed(seed: int | None, world: World) -> int:
    """``seed``, or for ``None`` a fresh random seed, rank 0's on every rank (the frame
    permutations of the ranks must agree)."""
    if seed is not None:
        return seed
    fresh = int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
    if world.world_size == 1:
        return fresh
    return int(broadcast_from_main(fresh, context="choosing the loader seed"))


def broadcast_from_main(obj: Any = None, *, timeout: float | None = None,
                        context: str = "broadcasting from rank 0") -> Any:
    """Rank 0's ``obj`` on every rank, as one framed packet (its failure fails every rank)."""
    world = current_world()
    if not world.distributed:
        return obj
    channel = world_channel(timeout=timeout, activity=context)
    mine = data_packet(obj, rank=world.rank, context=context) if channel.is_source else None
    return open_packet(channel.broadcast(mine), rank=world.rank)


def any_rank(flags: list[bool], *, activity: str) -> list[bool]:
    """For each flag, whether it is set on any rank: one tiny all-reduce on the CPU group,
    bounded by ``$MDLOADER_COLLECTIVE_TIMEOUT``; ``activity`` is what the ranks are doing."""
    if not current_world().distributed:
        return [bool(f) for f in flags]
    return world_channel(activity=activity).any_set(flags)


def fail_together(error: BaseException | None, *, context: str,
                  timeout: float | None = None) -> None:
    """Every rank passes its own failure or ``None``; if any rank failed, every rank raises the
    :class:`~mdloader.errors.RemoteError` of the lowest failing rank, naming its system and file.

    A collective (every rank calls it); a no-op check in a single process, where ``error`` is
    raised as it is.
    """
    world = current_world()
    if not world.distributed:
        if error is not None:
            raise error
        return
    channel = world_channel(timeout=timeout, activity=context)
    mine = (data_packet(None, rank=world.rank, context=context) if error is None
            else error_packet(error, rank=world.rank, context=context))
    for packet in channel.gather(mine):
        if packet.kind is Kind.ERROR:
            open_packet(packet, rank=world.rank)
