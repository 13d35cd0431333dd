"""The two loaders under test, behind one small adapter interface.

Each adapter does what the loader's own training entry point does, nothing more:

* DeePMD-kit (``deepmd.pt.entrypoints.main``): every rank runs ``process_systems`` (a recursive
  walk of the data tree), then ``DpLoaderSet(systems, batch_size, type_map, seed=[rank, seed])``,
  which builds on rank 0 and ``broadcast_object_list``\\ s the systems;
* mdloader: ``DpLoaderSet`` given the data root; rank 0 discovers and builds, the others receive.

The LMDB suite has its own pair (:data:`LMDB_ADAPTERS`): mdloader's ``DpLoaderSet`` on a
database, as ``mdloader dp`` trains, and DeePMD-kit 3.2.0's LMDB path as its trainer builds it
(``LmdbDataset``, ``DistributedLmdbBatchSampler``, ``LmdbBatchDataLoader``).

The import of each package happens in :meth:`Adapter.load` so that the benchmark can take its
memory baseline *after* the imports (the brief's "RSS growth over the import baseline").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from benchmarks.data import TYPE_MAP


class Adapter:
    """What the benchmark needs from a loader."""

    name = "?"
    report: dict[str, Any] = {}
    """The loader's own account of its build phases, when it gives one."""

    def load(self) -> None:
        """Import the package (outside the measured build)."""

    def discover(self, root: str, rank: int) -> Any:
        """What the training entry point does before building; returns the build input."""
        return root

    def build(self, systems: Any, batch_size: Any, seed: int, rank: int) -> Any:
        raise NotImplementedError

    def add_requirements(self, loader_set: Any) -> None:
        """Ask for the labels an energy/force model trains on (energy, force)."""
        raise NotImplementedError

    def sampler(self, loader_set: Any) -> Any:
        """The outer sampler, made as DeePMD-kit's trainer makes it."""
        raise NotImplementedError


class DeepmdAdapter(Adapter):
    """DeePMD-kit 3.2.0, PyTorch backend (the peer)."""

    name = "deepmd"

    def load(self) -> None:
        import deepmd.pt.utils.dataloader as dl
        from deepmd.utils.data import DataRequirementItem
        from deepmd.utils.data_system import process_systems

        self._dl, self._item, self._process = dl, DataRequirementItem, process_systems

    def discover(self, root: str, rank: int) -> Any:
        return self._process(root)

    def build(self, systems: Any, batch_size: Any, seed: int, rank: int) -> Any:
        # main.py passes the per-rank seed list [rank, seed % 2**32].
        return self._dl.DpLoaderSet(systems, batch_size, TYPE_MAP, seed=[rank, seed % 2**32])

    def add_requirements(self, loader_set: Any) -> None:
        loader_set.add_data_requirement(_requirements(self._item))

    def sampler(self, loader_set: Any) -> Any:
        return self._dl.get_sampler_from_params(loader_set, {"auto_prob": "prob_sys_size"})


class MdloaderAdapter(Adapter):
    """mdloader: the same public names, built on rank 0 and broadcast as compact metadata."""

    name = "mdloader"

    def load(self) -> None:
        import mdloader.loading.build as build
        import mdloader.loading.loader as loader
        from mdloader.data.schema import DataRequirementItem

        self._loader, self._item = loader, DataRequirementItem
        original = build.build_systems_with_report

        def recording(*args: Any, **kwargs: Any) -> Any:
            datasets, report = original(*args, **kwargs)
            self.report = {"discovery_s": report.discovery_seconds,
                           "build_s": report.build_seconds,
                           "broadcast_s": report.broadcast_seconds,
                           "payload_bytes": report.payload_bytes,
                           "build_threads": report.num_workers,
                           "source": report.source, "index_s": report.index_seconds,
                           "described": report.described, "reused": report.reused}
            return datasets, report

        build.build_systems_with_report = recording

    def build(self, systems: Any, batch_size: Any, seed: int, rank: int) -> Any:
        return self._loader.DpLoaderSet(systems, batch_size, TYPE_MAP, seed=seed)

    def add_requirements(self, loader_set: Any) -> None:
        loader_set.add_data_requirement(_requirements(self._item))

    def sampler(self, loader_set: Any) -> Any:
        return self._loader.get_sampler_from_params(loader_set, {"auto_prob": "prob_sys_size"})


def _requirements(item_cls: Any) -> list[Any]:
    """Energy and force, as DeePMD-kit's energy loss requests them."""
    return [
        item_cls("energy", ndof=1, atomic=False, must=False, high_prec=True),
        item_cls("force", ndof=3, atomic=True, must=False, high_prec=False),
    ]


ADAPTERS: dict[str, type[Adapter]] = {"deepmd": DeepmdAdapter, "mdloader": MdloaderAdapter}


class MdloaderLmdb:
    """mdloader's loader as ``mdloader dp --pt train`` builds it."""

    def __init__(self) -> None:
        import mdloader.loading.loader as loader
        from mdloader.data.formats.lmdb import metadata as lmdb_metadata
        from mdloader.data.schema import DataRequirementItem

        self.loader, self.item, self.meta = loader, DataRequirementItem, lmdb_metadata

    def scanned(self) -> int:
        return self.meta.scanned_frames()

    def build(self, path: str, rank: int, world: int) -> Any:
        ls = self.loader.DpLoaderSet(path, "auto", TYPE_MAP, seed=1)
        ls.add_data_requirement(_requirements(self.item))
        return ls

    def batches(self, ls: Any, workers: int) -> Iterator[Any]:
        from torch.utils.data import DataLoader

        sampler = self.loader.get_sampler_from_params(ls, {"auto_prob": "prob_sys_size"})
        dl = DataLoader(ls, sampler=sampler, batch_size=None, num_workers=workers,
                        collate_fn=_identity)
        while True:
            yield from dl


class DeepmdLmdb:
    """DeePMD-kit 3.2.0's LMDB path as ``training.py`` builds it (``seed`` = training seed)."""

    def __init__(self) -> None:
        import deepmd.dpmodel.utils.lmdb_data as lmdb_data
        from deepmd.pt.utils.lmdb_dataset import LmdbBatchDataLoader, LmdbDataset
        from deepmd.utils.data import DataRequirementItem

        self.lmdb_data, self.item = lmdb_data, DataRequirementItem
        self.dataset_cls, self.loader_cls = LmdbDataset, LmdbBatchDataLoader
        self.frames_scanned = 0
        scan = lmdb_data._scan_frame_nlocs

        def counted(env: Any, nframes: int, *args: Any) -> Any:
            self.frames_scanned += nframes
            return scan(env, nframes, *args)

        lmdb_data._scan_frame_nlocs = counted

    def scanned(self) -> int:
        return self.frames_scanned

    def build(self, path: str, rank: int, world: int) -> Any:
        ds = self.dataset_cls(path, TYPE_MAP, "auto")
        ds.add_data_requirement(_requirements(self.item))
        ds.rank_world = (rank, world)
        return ds

    def batches(self, ds: Any, workers: int) -> Iterator[Any]:
        rank, world = ds.rank_world
        sampler = self.lmdb_data.DistributedLmdbBatchSampler(
            ds._reader, rank=rank, world_size=world, shuffle=True, seed=1)
        dl = self.loader_cls(ds, sampler, pin_memory=False, num_workers=workers)
        while True:
            yield from dl


def _identity(batch: Any) -> Any:
    return batch


LMDB_ADAPTERS: dict[str, type[MdloaderLmdb | DeepmdLmdb]] = {"mdloader": MdloaderLmdb,
                                                             "deepmd": DeepmdLmdb}

