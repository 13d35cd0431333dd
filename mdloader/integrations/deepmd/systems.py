"""The trainer's training systems under mdloader: found and read only by mdloader's build.

``main``'s ``process_systems`` becomes :func:`defer_discovery` (no rank walks the data tree
before the build), its ``is_lmdb`` :func:`not_lmdb` (an LMDB path is a ``systems`` entry like any
other) and its ``get_data`` :func:`neighbour_stat_data`: data that reads nothing, whose neighbour
statistics (``sel: "auto"``, ``min_nbor_dist``) :func:`mdloader_nbor_stat` computes with
mdloader, in shares over the ranks, with DeePMD-kit's values.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mdloader.errors import ConfigError
from mdloader.integrations.deepmd.seam import MAIN
from mdloader.loading.build import build_systems
from mdloader.loading.loader import DpLoaderSet, LazySystemBatches
from mdloader.loading.statistics import neighbour_statistics


class DeferredSystems(list):
    """The user's ``systems`` entries, not yet discovered, plus the ``rglob_patterns``.

    Returned in place of DeePMD-kit's ``process_systems`` result so that no rank walks the tree
    before the build; :class:`DeepmdDpLoaderSet` hands both to mdloader's rank-0 discovery.
    """

    def __init__(self, entries: Sequence[str], patterns: Sequence[str] | None = None) -> None:
        super().__init__(entries)
        self.patterns = list(patterns) if patterns else None


def defer_discovery(systems: str | Sequence[str],
                    patterns: Sequence[str] | None = None) -> DeferredSystems:
    """Replacement for ``deepmd.utils.data_system.process_systems``: no file-system access."""
    if isinstance(systems, str):
        return DeferredSystems([systems], patterns)
    if isinstance(systems, (list, tuple)):
        return DeferredSystems(list(systems), patterns)
    raise ConfigError(f"systems must be a path or a list of paths, got {type(systems).__name__}",
                      path="training.training_data.systems")


class LoaderSetBatches(LazySystemBatches):
    """``dataloaders`` that name their loader set: what DeePMD-kit's ``make_stat_input`` is
    handed, so the input statistics find the set it reads from."""

    def __init__(self, owner: DpLoaderSet) -> None:
        super().__init__(owner)
        self.loader_set = owner


class DeepmdDpLoaderSet(DpLoaderSet):
    """mdloader's ``DpLoaderSet`` with DeePMD-kit's positional signature.

    Accepts a :class:`DeferredSystems` (from :func:`defer_discovery`) and forwards its
    ``rglob_patterns``; DeePMD-kit's ``[rank, seed]`` convention is understood by the base class.
    """

    def __init__(self, systems: Any, batch_size: Any, type_map: Sequence[str] | None,
                 seed: int | Sequence[int] | None = None, shuffle: bool = True,
                 modifier: Any = None) -> None:
        patterns = getattr(systems, "patterns", None)
        if isinstance(systems, DeferredSystems):
            systems = list(systems)
        super().__init__(systems, batch_size, type_map, seed, shuffle, modifier,
                         rglob_patterns=patterns)
        self.dataloaders = LoaderSetBatches(self)


def not_lmdb(systems: Any) -> bool:
    """``main.is_lmdb``: the trainer's LMDB branch is never taken, mdloader reads the path."""
    return False


class NeighbourStatData:
    """What ``main.get_data`` returns under mdloader: the training systems, not yet read.

    DeePMD-kit passes it to ``update_sel``; :func:`mdloader_nbor_stat` builds the systems once
    (rank 0 discovers them; under ``torchrun`` the process group is created first) and
    computes their statistics in shares.
    """

    def __init__(self, systems: Any, patterns: Sequence[str] | None,
                 type_map: Sequence[str] | None, dist_module: Any) -> None:
        self.systems = systems
        self.patterns = list(patterns) if patterns else None
        self.type_map = list(type_map) if type_map else None
        self._dist = dist_module
        self._datasets: Any = None

    def datasets(self) -> Any:
        """The training systems, built (once) as the trainer's ``DpLoaderSet`` will build them."""
        if self._datasets is None:
            if os.environ.get("LOCAL_RANK") is not None and not self._dist.is_initialized():
                self._dist.init_process_group(backend="cuda:nccl,cpu:gloo")  # DeePMD-kit's
            self._datasets = build_systems(
                self.systems, self.type_map, rglob_patterns=self.patterns,
                key="training.training_data.systems")
        return self._datasets


def neighbour_stat_data(jdata: Any, rcut: Any, type_map: Any, modifier: Any, *args: Any,
                        **kwargs: Any) -> NeighbourStatData:
    """``main.get_data``, which ``main`` calls only for the neighbour statistics: no I/O."""
    if modifier is not None:
        raise ConfigError("data modifiers are not supported by mdloader",
                          path="model.modifier")
    dist_module = sys.modules[MAIN].dist
    return NeighbourStatData(jdata["systems"], jdata.get("rglob_patterns"), type_map,
                             dist_module)


def mdloader_nbor_stat(original: Callable[..., Any]) -> Callable[..., Any]:
    """``BaseUpdateSel.get_nbor_stat``: mdloader's sharded statistics for
    :class:`NeighbourStatData`, DeePMD-kit's own for any other data."""

    def get_nbor_stat(self: Any, train_data: Any, type_map: Sequence[str] | None, rcut: float,
                      mixed_type: bool = False) -> tuple[float, Any]:
        if not isinstance(train_data, NeighbourStatData):
            return original(self, train_data, type_map, rcut, mixed_type=mixed_type)
        import numpy as np

        from mdloader.stats.neighbours import min_nbor_dist

        if type_map is not None and len(type_map) == 0:
            type_map = None
        datasets = train_data.datasets()
        stats = neighbour_statistics(datasets, rcut, type_map=type_map, mixed_type=mixed_type)
        return min_nbor_dist(stats), np.asarray(stats.max_neighbours, dtype=int)

    return get_nbor_stat
