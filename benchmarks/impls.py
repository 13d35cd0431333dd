"""The two loaders under test, behind one small adapter interface.

Each adapter does what the loader's own training entry point does, nothing more:

* DeePMD-kit (``deepmd.pt.entrypoints.main``): every rank runs ``process_systems`` (a recursive
  walk of the data tree), then ``DpLoaderSet(systems, batch_size, type_map, seed=[rank, seed])``,
  which builds on rank 0 and ``broadcast_object_list``\\ s the systems;
* mdloader: ``DpLoaderSet`` given the data root; rank 0 discovers and builds, the others receive.

The import of each package happens in :meth:`Adapter.load` so that the benchmark can take its
memory baseline *after* the imports (the brief's "RSS growth over the import baseline").
"""

from __future__ import annotations

from typing import Any

TYPE_MAP = ["O", "H"]


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
