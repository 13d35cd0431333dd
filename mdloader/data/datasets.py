"""The datasets of a job as a list that makes each :class:`DeepmdDataSetForLoader` on first use.

What the build hands every rank: a :class:`~mdloader.data.table.SystemTable` behind the list
interface of ``DpLoaderSet.systems``. Counting atoms and frames reads the table's columns, so a
rank that never touches most systems never pays for their objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.table import SystemTable


class SystemDatasets(Sequence):
    """``DeepmdDataSetForLoader`` objects over a table, each made (once) when indexed."""

    def __init__(self, table: SystemTable) -> None:
        self.table = table
        self._made: list[DeepmdDataSetForLoader | None] = [None] * len(table)

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not isinstance(index, (int, np.integer)) or not -n <= index < n:
            raise IndexError(f"system index {index!r} out of range for {n} systems")
        row = int(index) % n
        made = self._made[row]
        if made is None:
            made = self._made[row] = DeepmdDataSetForLoader(self.table.meta(row),
                                                            origin=self.table.origin)
        return made

    def __iter__(self) -> Iterator[DeepmdDataSetForLoader]:
        return (self[i] for i in range(len(self)))

    def natoms(self) -> np.ndarray:
        return self.table.natoms()

    def nframes(self) -> np.ndarray:
        return self.table.nframes()

    def __reduce__(self) -> tuple[Any, ...]:
        # DataLoader workers (spawn) receive the table and the datasets already made.
        made = {i: d for i, d in enumerate(self._made) if d is not None}
        return (_restore, (self.table, made))


def _restore(table: SystemTable, made: dict[int, DeepmdDataSetForLoader]) -> SystemDatasets:
    datasets = SystemDatasets(table)
    for row, dataset in made.items():
        datasets._made[row] = dataset
    return datasets


def natoms_of(systems: Sequence[Any]) -> np.ndarray:
    """Atoms per system (int64), from the columns when ``systems`` is a :class:`SystemDatasets`."""
    if isinstance(systems, SystemDatasets):
        return systems.natoms()
    return np.fromiter((s._natoms for s in systems), dtype=np.int64, count=len(systems))


def nframes_of(systems: Sequence[Any]) -> np.ndarray:
    """Frames per system (int64), from the columns when ``systems`` is a :class:`SystemDatasets`."""
    if isinstance(systems, SystemDatasets):
        return systems.nframes()
    return np.fromiter((len(s) for s in systems), dtype=np.int64, count=len(systems))
