"""The datasets of a job as a list that makes each :class:`DeepmdDataSetForLoader` on first use.

What the build hands every rank: a :class:`~mdloader.catalog.table.SystemTable` behind the list
interface of ``DpLoaderSet.systems``. Counting atoms and frames reads the table's columns, so a
rank that never touches most systems never pays for their objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mdloader.catalog.table import SystemTable
from mdloader.data.dataset import DeepmdDataSetForLoader


class SystemDatasets(Sequence):
    """``DeepmdDataSetForLoader`` objects over a table (or the ``rows`` of it that were kept),
    each made (once) when indexed."""

    def __init__(self, table: SystemTable, rows: np.ndarray | None = None) -> None:
        self.table = table
        self._rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        self._made: list[DeepmdDataSetForLoader | None] = [None] * (
            len(table) if self._rows is None else len(self._rows))

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not isinstance(index, (int, np.integer)) or not -n <= index < n:
            raise IndexError(f"system index {index!r} out of range for {n} systems")
        position = int(index) % n
        made = self._made[position]
        if made is None:
            row = position if self._rows is None else int(self._rows[position])
            made = self._made[position] = DeepmdDataSetForLoader(self.table.meta(row),
                                                                 origin=self.table.origin)
        return made

    def __iter__(self) -> Iterator[DeepmdDataSetForLoader]:
        return (self[i] for i in range(len(self)))

    def subset(self, positions: Sequence[int]) -> SystemDatasets:
        """The systems at ``positions``, still made when first indexed (a batch-size filter
        keeps 10⁶ systems without making them)."""
        kept = np.asarray(positions, dtype=np.int64)
        out = SystemDatasets(self.table, kept if self._rows is None else self._rows[kept])
        out._made = [self._made[i] for i in kept.tolist()]
        return out

    def natoms(self) -> np.ndarray:
        natoms = self.table.natoms()
        return natoms if self._rows is None else natoms[self._rows]

    def nframes(self) -> np.ndarray:
        nframes = self.table.nframes()
        return nframes if self._rows is None else nframes[self._rows]

    def __reduce__(self) -> tuple[Any, ...]:
        # DataLoader workers (spawn) receive the table and the datasets already made.
        made = {i: d for i, d in enumerate(self._made) if d is not None}
        return (_restore, (self.table, made, self._rows))


def _restore(table: SystemTable, made: dict[int, DeepmdDataSetForLoader],
             rows: np.ndarray | None = None) -> SystemDatasets:
    datasets = SystemDatasets(table, rows)
    for position, dataset in made.items():
        datasets._made[position] = dataset
    return datasets


def kept_systems(systems: Sequence[Any], positions: Sequence[int]) -> Sequence[Any]:
    """``systems`` at ``positions`` (all: ``systems`` itself); a :class:`SystemDatasets` stays
    one, making no dataset."""
    if len(positions) == len(systems):
        return systems
    if isinstance(systems, SystemDatasets):
        return systems.subset(positions)
    return [systems[i] for i in positions]


def natoms_of(systems: Sequence[Any]) -> np.ndarray:
    """Atoms per system (int64), from the columns when ``systems`` is a :class:`SystemDatasets`."""
    if isinstance(systems, SystemDatasets):
        return systems.natoms()
    return np.fromiter((s.meta.natoms for s in systems), dtype=np.int64, count=len(systems))


def nframes_of(systems: Sequence[Any]) -> np.ndarray:
    """Frames per system (int64), from the columns when ``systems`` is a :class:`SystemDatasets`."""
    if isinstance(systems, SystemDatasets):
        return systems.nframes()
    return np.fromiter((len(s) for s in systems), dtype=np.int64, count=len(systems))
