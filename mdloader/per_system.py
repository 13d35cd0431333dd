"""``DpLoaderSet.dataloaders``: DeePMD-kit's per-system loaders, for statistics.

DeePMD-kit keeps a torch ``DataLoader`` and an iterator per system. Here each system's batches
are a small object created on demand, with no state: 100 000 systems cost nothing until used.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mdloader.loader import DpLoaderSet


class SystemBatches:
    """The batches of one system on this rank, for statistics: DeePMD-kit's per-system loader.

    ``len()`` is the batch count the sampler uses; every ``iter()`` starts again at the first
    batch of the rank's shard of pass 0. No torch ``DataLoader``, no state: creating one is free.
    """

    def __init__(self, owner: DpLoaderSet, sid: int) -> None:
        self._owner, self.sid = owner, sid
        self.dataset = owner.systems[sid]
        self.batch_size = int(owner.batch_sizes[sid])

    def __len__(self) -> int:
        return int(self._owner.index[self.sid])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for j in range(len(self)):
            yield self._owner.read(self.sid, self._owner._order.fids(self.sid, j))


class LazySystemBatches(Sequence):
    """``dataloaders``: one :class:`SystemBatches` per system, created when indexed."""

    def __init__(self, owner: DpLoaderSet) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return len(self._owner.systems)

    def __getitem__(self, sid: int) -> SystemBatches:  # type: ignore[override]
        n = len(self)
        if not isinstance(sid, (int, np.integer)) or not -n <= sid < n:
            raise IndexError(f"system index {sid!r} out of range for {n} systems")
        return SystemBatches(self._owner, int(sid) % n)
