"""Run DeePMD-kit's own trainer (``dp --pt train input.json``) on mdloader.

Most users never write a training loop, so the loader slots *under* DeePMD-kit's trainer:
:func:`install` checks the installed DeePMD-kit against :mod:`~.seam` (the supported versions
and every DeePMD-kit name mdloader touches) and then rebinds those names (:mod:`~.patching`).
The trainer then builds systems on rank 0 and broadcasts compact metadata (:mod:`~.systems`:
deferred discovery, neighbour statistics), draws batches from mdloader's stateful sampler,
computes its input statistics in shares (:mod:`~.input_stats`) and runs on CPU-only torch
(:mod:`~.shims`). DeePMD-kit's ``[rank, seed]`` becomes the job seed, so frame permutations
agree across ranks. Data modifiers (``model.modifier``) are rejected.

DeePMD-kit is an optional dependency: importing this package does not import it.
"""

from mdloader.integrations.deepmd.input_stats import (
    InputStatTakeover,
    env_settings,
    mdloader_run_stat_on_chief,
    output_sampled,
)
from mdloader.integrations.deepmd.patching import install, installed, run_dp, uninstall
from mdloader.integrations.deepmd.seam import SEAM, SUPPORTED, UnsupportedDeepmdError
from mdloader.integrations.deepmd.shims import cpu_fallback_backend
from mdloader.integrations.deepmd.systems import (
    DeepmdDpLoaderSet,
    DeferredSystems,
    NeighbourStatData,
    defer_discovery,
    mdloader_nbor_stat,
    neighbour_stat_data,
    not_lmdb,
)

__all__ = [
    "SEAM", "SUPPORTED", "DeepmdDpLoaderSet", "DeferredSystems", "InputStatTakeover",
    "NeighbourStatData", "UnsupportedDeepmdError", "cpu_fallback_backend", "defer_discovery",
    "env_settings", "install", "installed", "mdloader_nbor_stat", "mdloader_run_stat_on_chief",
    "neighbour_stat_data", "not_lmdb", "output_sampled", "run_dp", "uninstall",
]
