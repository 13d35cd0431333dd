"""A forked DataLoader worker freezes the heap it inherits before reading its first batch."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

from mdloader.loading.loader import DpLoaderSet, get_weighted_sampler
from mdloader.testing import make_system


class _FreezeProbe(Dataset):
    """Reads through the loader set and reports the worker's frozen-object count around it."""

    def __init__(self, loader_set: DpLoaderSet) -> None:
        self.loader_set = loader_set

    def __len__(self) -> int:
        return len(self.loader_set)

    def __getitem__(self, key: Any) -> tuple[int, int, int]:
        before = gc.get_freeze_count()
        batch = self.loader_set[key]
        return before, gc.get_freeze_count(), int(batch["sid"])


@pytest.mark.timeout(120)
def test_forked_workers_freeze_the_inherited_heap(tmp_path) -> None:
    paths = [make_system(tmp_path, f"sys{i}", natoms=3 + i, nframes=4, seed=i) for i in range(3)]
    ls = DpLoaderSet(paths, 1, ["O", "H"], seed=3)
    sampler = get_weighted_sampler(ls, "prob_sys_size", num_workers=2)
    gc.unfreeze()                 # whatever an earlier test froze goes back to the collector
    parent_frozen = gc.get_freeze_count()
    dl = DataLoader(_FreezeProbe(ls), sampler=sampler, batch_size=None, num_workers=2,
                    multiprocessing_context="fork", collate_fn=lambda b: b)
    got = list(dl)
    assert len(got) == len(sampler)
    assert {sid for _, _, sid in got} == {0, 1, 2}
    # Each worker starts unfrozen, freezes what it inherited at its first read, and keeps it.
    assert sum(1 for before, _, _ in got if before == parent_frozen) == 2
    assert all(after > parent_frozen for _, after, _ in got)
    # The parent's collector is left as it was.
    assert gc.get_freeze_count() == parent_frozen
