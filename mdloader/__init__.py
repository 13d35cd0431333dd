"""mdloader: a distributed, file-system-friendly loader of DeePMD data systems.

The public names follow DeePMD-kit's PyTorch backend (``DpLoaderSet``,
``DeepmdDataSetForLoader``, ``get_weighted_sampler``, ``collate_batch``) and its LMDB names
(``LmdbDataReader``, ``LmdbBatchSampler``, ``LmdbDataset``, ``merge_lmdb``, ...) so that switching
is an import change. Heavy modules are imported on first use, so ``import mdloader`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DeepmdDataSetForLoader": "mdloader.data.dataset",
    "DataRequirementItem": "mdloader.data.schema",
    "SystemMeta": "mdloader.data.formats.base",
    "build_system_meta": "mdloader.data.system",
    "discover_systems": "mdloader.catalog.discover",
    "collate_batch": "mdloader.data.collate",
    "World": "mdloader.world",
    "set_torch_threads": "mdloader.threads",
    "DpLoaderSet": "mdloader.loading.loader",
    "get_weighted_sampler": "mdloader.loading.loader",
    "get_sampler_from_params": "mdloader.loading.loader",
    "get_validation_sampler": "mdloader.loading.loader",
    "ShardedValidationSampler": "mdloader.sampling.validation",
    "merge_rank_states": "mdloader.sampling.elastic",
    "reduce_sums": "mdloader.distributed.collectives",
    "WeightedSystemSampler": "mdloader.sampling.samplers",
    "StatefulLoader": "mdloader.loading.stateful_loader",
    "Stateful": "mdloader.state",
    "gather_to_main": "mdloader.distributed.collectives",
    "BatchKey": "mdloader.sampling.samplers",
    "build_systems": "mdloader.loading.build",
    "build_systems_with_report": "mdloader.loading.build",
    "BroadcastingDataLoader": "mdloader.distributed.broadcasting",
    "is_source_rank": "mdloader.distributed.broadcasting",
    "broadcast_batch": "mdloader.distributed.broadcasting",
    "LmdbDataReader": "mdloader.loading.lmdb_names",
    "LmdbBatchSampler": "mdloader.loading.lmdb_names",
    "DistributedLmdbBatchSampler": "mdloader.loading.lmdb_names",
    "SameNlocBatchSampler": "mdloader.loading.lmdb_names",
    "DistributedSameNlocBatchSampler": "mdloader.loading.lmdb_names",
    "LmdbDataset": "mdloader.loading.lmdb_names",
    "LmdbBatchDataLoader": "mdloader.loading.lmdb_names",
    "merge_lmdb": "mdloader.data.formats.lmdb.merge",
    "compute_block_targets": "mdloader.loading.lmdb_names",
    "is_lmdb": "mdloader.loading.lmdb_names",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mdloader' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
