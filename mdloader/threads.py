"""How many intra-op threads torch runs in each rank's main process.

torch starts one thread per core in every process. A rank whose DataLoader workers, or whose
fellow ranks on the node, share those cores then oversubscribes them, and every step waits on
threads that wait on each other. As DeePMD-kit's own warning suggests, each main process gets
its share of the cores instead: ``cores available // (ranks on this node x (1 + workers))``, at
least 1, unless ``OMP_NUM_THREADS`` or an explicit setting says otherwise (DataLoader workers
already run one thread each: torch sets that in every worker).
"""

from __future__ import annotations

import logging
import os

from mdloader.settings import resolve
from mdloader.world import World

log = logging.getLogger(__name__)


def share_of_cores(cores: int, local_world_size: int, num_workers: int) -> int:
    """The threads of one rank's main process: its share of ``cores`` among the
    ``local_world_size`` ranks of the node and their ``num_workers`` workers each (at least 1)."""
    return max(1, cores // (max(1, local_world_size) * (1 + max(0, num_workers))))


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: a Slurm or cgroup allotment)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def torch_threads(num_workers: int, *, world: World | None = None,
                  threads: int | None = None) -> tuple[int | None, str]:
    """The thread count to set (``None``: leave torch's, which ``OMP_NUM_THREADS`` set) and why.

    ``threads`` (else ``$MDLOADER_TORCH_THREADS``) wins when it is not 0; then
    ``OMP_NUM_THREADS``; then :func:`share_of_cores`.
    """
    chosen = int(resolve("torch_threads", threads, argument="threads"))
    if chosen > 0:
        return chosen, "set explicitly" if threads is not None else "MDLOADER_TORCH_THREADS"
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return None, "OMP_NUM_THREADS"
    world = world if world is not None else World.from_env()
    cores = available_cores()
    share = share_of_cores(cores, world.local_world_size, num_workers)
    return share, (f"{cores} core(s) / ({world.local_world_size} rank(s) on this node x "
                   f"(1 + {num_workers} worker(s)))")


def set_torch_threads(num_workers: int, *, world: World | None = None,
                      threads: int | None = None) -> int:
    """Set torch's intra-op threads of this process as :func:`torch_threads` says; the count.

    Call it once per rank, before the first step, with the DataLoader workers of that rank.
    """
    import torch

    count, why = torch_threads(num_workers, world=world, threads=threads)
    if count is not None and count != torch.get_num_threads():
        torch.set_num_threads(count)
    log.info("torch threads per rank: %d (%s)", torch.get_num_threads(), why)
    return torch.get_num_threads()
