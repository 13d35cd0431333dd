"""The loader a data section describes, assembled once for ``train`` and ``bench``.

Build (rank 0 reads, every rank receives), batch sizes, the requested labels, the sampler from
``sys_probs``/``auto_prob``, and the stateful outer ``DataLoader``: the same steps in the same
order for every application, so what ``bench`` measures is what ``train`` runs. The data
section is anything shaped like ``mdloader.config.input_json.DataConfig`` (:class:`DataSection`),
so that loading needs nothing of the configuration layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mdloader.loading.build import BuildReport, build_systems_with_report
from mdloader.loading.loader import DpLoaderSet, get_sampler_from_params
from mdloader.loading.stateful_loader import StatefulLoader
from mdloader.sampling.samplers import WeightedSystemSampler
from mdloader.world import World


class DataSection(Protocol):
    """What the assembly reads of a data section of ``input.json``."""

    systems: Sequence[str]
    rglob_patterns: Sequence[str] | None
    index_file: str | None
    json_path: str
    balance_window: int
    balance_cost: str

    def batch_size_value(self) -> int | list[int] | str:
        """The section's ``batch_size``."""

    def sampler_params(self) -> dict[str, Any]:
        """The section's ``sys_probs`` and ``auto_prob``."""


@dataclass
class ConfiguredLoader:
    """The pieces of one data section's loader: dataset, sampler, loader, and the build report."""

    dataset: DpLoaderSet
    sampler: WeightedSystemSampler
    loader: StatefulLoader
    report: BuildReport


def configured_loader(data: DataSection, *, type_map: Sequence[str] | None, seed: int | None,
                      world: World, labels: Sequence[Any], num_workers: int,
                      **dataloader_kwargs: Any) -> ConfiguredLoader:
    """Build the systems of ``data`` and the stateful loader over them (a collective)."""
    tmap = list(type_map) if type_map else None
    datasets, report = build_systems_with_report(list(data.systems), tmap,
                                                 rglob_patterns=data.rglob_patterns,
                                                 index_file=data.index_file,
                                                 key=f"{data.json_path}.systems")
    dataset = DpLoaderSet(datasets, data.batch_size_value(), tmap, seed=seed, world=world,
                          json_path=data.json_path, balance_window=data.balance_window,
                          balance_cost=data.balance_cost)
    dataset.add_data_requirement(labels)
    sampler = get_sampler_from_params(dataset, data.sampler_params(), num_workers=num_workers,
                                      json_path=data.json_path)
    loader = StatefulLoader(dataset, sampler, num_workers=num_workers, **dataloader_kwargs)
    return ConfiguredLoader(dataset, sampler, loader, report)
