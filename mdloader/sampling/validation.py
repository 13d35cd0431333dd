"""Exactly-once sharded validation (pure): every validation frame on exactly one rank, no padding.

``DistributedSampler`` pads every rank's share to the same length by repeating frames, so metrics
averaged over ranks count some frames twice; running validation on rank 0 alone leaves the other
ranks waiting. Here the frames of all validation systems, in system order, are dealt to the ranks
round-robin as one sequence: frame ``i`` of system ``s`` goes to rank ``(start_s + i) mod W``,
where ``start_s`` counts the frames of the systems before ``s``. One pass therefore serves every
frame exactly once, and every rank gets ``floor(N / W)`` or ``ceil(N / W)`` of the ``N`` frames,
even when systems have fewer frames than there are ranks. A batch holds frames of one system
(up to that system's batch size), as in training; the last batch of a system on a rank may be
short.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from mdloader.errors import ConfigError
from mdloader.sampling.plan import LoaderPlan
from mdloader.sampling.streams import BatchKey


def validation_frames(nframes: int, first: int, rank: int, world_size: int) -> np.ndarray:
    """The frames of a system that fall to ``rank``, when its frame 0 is frame ``first`` of the
    whole validation set: ``i`` with ``(first + i) mod world_size == rank``, in order."""
    return np.arange((rank - first) % world_size, nframes, world_size, dtype=np.int64)


class ShardedValidationSampler(Sampler[BatchKey]):
    """The batch keys of one full validation pass on this rank; every ``iter()`` is a full pass.

    Use it like the training sampler: ``DataLoader(loader_set, sampler=sampler, batch_size=None,
    num_workers=K, collate_fn=...)``. Reduce the per-rank sums and counts of a metric with
    :func:`mdloader.distributed.collectives.reduce_sums`.

    Parameters
    ----------
    nframes, batch_sizes
        Frames and batch size of every validation system.
    rank, world_size
        This rank among how many.
    """

    def __init__(self, nframes: Sequence[int] | np.ndarray, batch_sizes: Sequence[int] | np.ndarray,
                 *, rank: int = 0, world_size: int = 1) -> None:
        self.nframes = np.asarray(nframes, dtype=np.int64)
        self.batch_sizes = np.asarray(batch_sizes, dtype=np.int64)
        if len(self.nframes) != len(self.batch_sizes):
            raise ConfigError(f"{len(self.batch_sizes)} batch sizes for {len(self.nframes)} "
                              "systems")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size), got rank {rank} of {world_size}")
        self.rank, self.world_size = int(rank), int(world_size)
        self.first = np.concatenate(([0], np.cumsum(self.nframes)[:-1])).astype(np.int64)
        share = (self.nframes - (self.rank - self.first) % self.world_size).clip(min=0)
        self.frames_per_system = -(-share // self.world_size)
        """Frames of every system on this rank."""

    @classmethod
    def of_plan(cls, plan: LoaderPlan, rank: int = 0) -> ShardedValidationSampler:
        """The validation pass of ``rank`` over the systems, batch sizes and world size of a
        loader plan."""
        return cls(plan.nframes, plan.batch_sizes, rank=rank, world_size=plan.world_size)

    @property
    def num_frames(self) -> int:
        """Frames this rank validates in one pass."""
        return int(self.frames_per_system.sum())

    def __len__(self) -> int:
        return int((-(-self.frames_per_system // self.batch_sizes)).sum())

    def __iter__(self) -> Iterator[BatchKey]:
        step = 0
        for sid in np.flatnonzero(self.frames_per_system):
            frames = validation_frames(int(self.nframes[sid]), int(self.first[sid]), self.rank,
                                       self.world_size)
            size = int(self.batch_sizes[sid])
            for start in range(0, len(frames), size):
                yield BatchKey(int(sid), tuple(frames[start:start + size].tolist()), step)
                step += 1


__all__ = ["validation_frames", "ShardedValidationSampler"]
