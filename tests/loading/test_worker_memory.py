"""A forked DataLoader worker shares the heap it inherits: the parent freezes it for the moment
of the fork (and unfreezes at once, so its own cycles are still collected), has imported what the
read path imports lazily, and the worker freezes what it made before its first batch."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

from mdloader.loading import worker_memory
from mdloader.loading.loader import DpLoaderSet, get_weighted_sampler
from mdloader.testing import make_system


class _FreezeProbe(Dataset):
    """Reads through the loader set and reports, around it, the worker's frozen-object count and
    whether the worker has settled (frozen what it made since the fork)."""

    def __init__(self, loader_set: DpLoaderSet) -> None:
        self.loader_set = loader_set

    def __len__(self) -> int:
        return len(self.loader_set)

    def __getitem__(self, key: Any) -> tuple[int, bool, bool, int]:
        frozen, settled = gc.get_freeze_count(), worker_memory._settled_pid == os.getpid()
        batch = self.loader_set[key]
        return frozen, settled, worker_memory._settled_pid == os.getpid(), int(batch["sid"])


@pytest.mark.timeout(120)
def test_forked_workers_share_the_frozen_inherited_heap(tmp_path) -> None:
    paths = [make_system(tmp_path, f"sys{i}", natoms=3 + i, nframes=4, seed=i) for i in range(3)]
    ls = DpLoaderSet(paths, 1, ["O", "H"], seed=3)
    assert "numpy.ma" in sys.modules  # np.unique's lazy import, done here and not per worker
    sampler = get_weighted_sampler(ls, "prob_sys_size", num_workers=2)
    gc.unfreeze()                 # whatever an earlier test froze goes back to the collector
    parent_frozen = gc.get_freeze_count()
    dl = DataLoader(_FreezeProbe(ls), sampler=sampler, batch_size=None, num_workers=2,
                    multiprocessing_context="fork", collate_fn=lambda b: b)
    try:
        got = list(dl)
        frozen_after_forks = gc.get_freeze_count()
    finally:
        gc.unfreeze()  # leave this process's collector as the test found it
    assert len(got) == len(sampler)
    assert {sid for *_, sid in got} == {0, 1, 2}
    # The parent unfroze right after each fork: its collector still reaches its own cycles ...
    assert frozen_after_forks == parent_frozen
    # ... while each worker started with the inherited heap frozen ...
    assert all(frozen > parent_frozen for frozen, *_ in got)
    # ... and settles (freezes what it made since the fork) at its first read, once.
    assert sum(1 for _, before, after, _ in got if not before and after) == 2
    assert all(after for _, _, after, _ in got)
