"""What differs between the torch releases mdloader supports, in one place.

Each difference is found by looking at the API (a keyword, an attribute), never by comparing
version strings, so a backport or a nightly build takes the right branch. Every module that meets
such a difference calls the function here; no other module tests torch's version.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist


@functools.cache
def _takes_group_src() -> bool:
    """Whether the rooted collectives take ``group_src=`` (a rank within the group; torch 2.6)."""
    return "group_src" in inspect.signature(dist.broadcast).parameters


def broadcast_from(tensor: torch.Tensor, group: Any, group_rank: int) -> Any:
    """Launch an asynchronous broadcast of ``tensor`` from ``group_rank`` of ``group``; the work.

    Older torch takes the source as a global rank only (``src=``), newer takes either.
    """
    if _takes_group_src():
        return dist.broadcast(tensor, group=group, group_src=group_rank, async_op=True)
    return dist.broadcast(tensor, src=dist.get_global_rank(group, group_rank), group=group,
                          async_op=True)


def gather_to(tensor: torch.Tensor, gathered: list[torch.Tensor] | None, group: Any,
              group_rank: int) -> Any:
    """Launch an asynchronous gather of every member's ``tensor`` into ``gathered`` (given on
    ``group_rank`` only) of ``group``; the work."""
    if _takes_group_src():  # the same release added group_dst=
        return dist.gather(tensor, gathered, group=group, group_dst=group_rank, async_op=True)
    return dist.gather(tensor, gathered, dst=dist.get_global_rank(group, group_rank),
                       group=group, async_op=True)


def launcher_keeps_the_store() -> bool:
    """Whether ``torchrun``'s agent hosts the job's store for ``--standalone`` and c10d
    rendezvous (newer torch; not 2.3), so that it outlives every rank; otherwise rank 0's
    process hosts it and a failure rank 0 published is gone with rank 0 (the others then report
    their broken connection: :mod:`mdloader.distributed.failure`)."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    return hasattr(RendezvousHandler, "use_agent_store")
