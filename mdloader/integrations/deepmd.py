"""Run DeePMD-kit's own trainer (``dp --pt train input.json``) on mdloader.

Most users never write a training loop, so the loader must slot *under* DeePMD-kit's trainer.
:func:`install` rebinds the names that DeePMD-kit's PyTorch backend looks up, in the modules
that bound them at import time:

====================================  =======================================================
``deepmd.pt.utils.dataloader``        ``DpLoaderSet``, ``get_weighted_sampler``,
                                      ``get_sampler_from_params``
``deepmd.pt.entrypoints.main``        ``DpLoaderSet``; ``process_systems`` (deferred: only
                                      rank 0 walks the data tree, inside the build);
                                      ``dist`` (see below); ``is_lmdb`` and ``get_data``
                                      (LMDB, below)
``deepmd.pt.train.training``          ``DpLoaderSet``, ``get_sampler_from_params``
====================================  =======================================================

The trainer then builds systems on rank 0 and broadcasts compact metadata, draws batches from
mdloader's stateful sampler (``sampler.weights`` is there for its summary and epoch arithmetic)
and computes statistics from ``DpLoaderSet.dataloaders`` -- lazy per-system batch iterables, no
per-system torch ``DataLoader``. DeePMD-kit's ``[rank, seed]`` becomes the job seed, so frame
permutations agree across ranks.

``dist``: under ``torchrun`` DeePMD-kit calls ``init_process_group("cuda:nccl,cpu:gloo")``, which
fails on a CPU-only torch ("Distributed package doesn't have NCCL built in"). The trainer's view
of ``torch.distributed`` is wrapped so that the NCCL half is dropped when NCCL or CUDA is missing,
and a barrier precedes ``destroy_process_group`` (gloo may otherwise abort a rank at exit).
The wrapper holds DeePMD-kit's own reference to the module; mdloader itself does not import it.

Logs: while installed, records of the ``mdloader`` loggers are handed to DeePMD-kit's
``deepmd`` logger, so DeePMD-kit's level and handlers (``dp``'s log file, ``assertLogs``)
decide about them as about its own; :func:`uninstall` restores the ``mdloader`` logger.

LMDB: a ``systems`` string that DeePMD-kit takes for an LMDB database goes through mdloader too.
``main``'s ``is_lmdb`` answers ``False``, so the trainer builds a ``DpLoaderSet`` on the path,
whose build expands the database into its groups on rank 0.

Neighbour statistics (``sel: "auto"``, ``min_nbor_dist``): ``main``'s ``get_data`` returns a
:class:`NeighbourStatData` that reads nothing, and ``BaseUpdateSel.get_nbor_stat`` (called by
every descriptor's ``update_sel``) computes the statistics of such data with mdloader
(:func:`mdloader.loading.statistics.neighbour_statistics`): under ``torchrun`` the process group
is created at that point (DeePMD-kit's own ``init_process_group`` then finds it), rank 0 builds
the systems, every rank takes a share and one all-gather merges them. The values are
DeePMD-kit's exactly; DeePMD-kit's own pass over all data on every rank does not run.

Input statistics (``davg``/``dstd``, energy bias): ``Trainer._run_stat_on_chief`` is wrapped.
Unless something mdloader does not compute is needed (:func:`_unsupported`), every rank first
computes its share of the environment sums and energy samples and one all-gather per block
merges them (:class:`InputStatPlan`); rank 0 then runs DeePMD-kit's own ``compute_or_load_stat``
with ``EnvMatStatSe`` handed the merged ``StatItem``s and a sampled function holding only
energies and type counts, so DeePMD-kit's code derives the values. The frames of each system are
those a one-rank job's ``make_stat_input`` reads (its first ``data_stat_nbatch`` batches of pass
0, :func:`mdloader.sampling.order.statistics_frames`; all frames when they cover the system), so
the values equal DeePMD-kit's one-rank run over mdloader's ``DpLoaderSet`` at any world size.
Otherwise DeePMD-kit's action runs as is.

Not covered: data modifiers (``model.modifier``) are rejected.

DeePMD-kit is an optional dependency: importing this module does not import it.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from mdloader.distributed.group import current_world
from mdloader.errors import ConfigError
from mdloader.loading.build import build_systems
from mdloader.loading.loader import DpLoaderSet, get_sampler_from_params, get_weighted_sampler
from mdloader.loading.statistics import input_statistics, neighbour_statistics

log = logging.getLogger(__name__)

_DATALOADER = "deepmd.pt.utils.dataloader"
_MAIN = "deepmd.pt.entrypoints.main"
_TRAINING = "deepmd.pt.train.training"
_UPDATE_SEL = "deepmd.utils.update_sel"
_saved: dict[tuple[str, str], Any] = {}
_saved_logger: dict[str, Any] = {}


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


class _TrainerDist(types.ModuleType):
    """DeePMD-kit's ``torch.distributed`` reference, with a CPU fallback for its NCCL backend."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def init_process_group(self, backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if self._real.is_initialized():  # created earlier for mdloader's neighbour statistics
            return None
        return self._real.init_process_group(cpu_fallback_backend(backend, self._real),
                                             *args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        real = self._real
        if group is None and real.is_initialized() and real.get_world_size() > 1:
            real.barrier()
        real.destroy_process_group(group)


class _TrainerTorch(types.ModuleType):
    """The trainer's ``torch`` without CUDA: ``torch.cuda.set_device`` becomes a no-op."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real
        self.cuda = _NoCuda(real.cuda)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _NoCuda(types.ModuleType):
    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def set_device(self, device: Any) -> None:
        """Nothing to select on a CPU-only machine (DeePMD-kit calls it for every DDP run)."""


def _cpu_ddp(real_ddp: type) -> type:
    """DDP that ignores ``device_ids``/``output_device``, which must be None for CPU modules."""

    class CpuDistributedDataParallel(real_ddp):  # type: ignore[misc, valid-type]
        def __init__(self, module: Any, *args: Any, device_ids: Any = None,
                     output_device: Any = None, **kwargs: Any) -> None:
            super().__init__(module, *args, **kwargs)

    return CpuDistributedDataParallel


def cpu_fallback_backend(backend: Any, dist_module: Any) -> Any:
    """``backend`` with its NCCL part dropped when NCCL or CUDA is unavailable."""
    if not isinstance(backend, str) or "nccl" not in backend:
        return backend
    import torch

    if dist_module.is_nccl_available() and torch.cuda.is_available():
        return backend
    log.info("NCCL/CUDA unavailable: process-group backend %r -> 'gloo'", backend)
    return "gloo"


class _ToDeepmdLogger(logging.Handler):
    """Hand each ``mdloader`` record to the ``deepmd`` logger, at that logger's level."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("deepmd")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def _route_logs_to_deepmd() -> None:
    """The ``mdloader`` logger stops propagating and forwards to ``deepmd`` (saved to undo)."""
    logger = logging.getLogger("mdloader")
    _saved_logger.update(level=logger.level, propagate=logger.propagate)
    _saved_logger["handler"] = handler = _ToDeepmdLogger()
    logger.addHandler(handler)
    logger.propagate = False
    if logger.level == logging.NOTSET:  # a level the user chose stays; otherwise DeePMD's decides
        logger.setLevel(1)


def _restore_logs() -> None:
    if not _saved_logger:
        return
    logger = logging.getLogger("mdloader")
    logger.removeHandler(_saved_logger.pop("handler"))
    logger.setLevel(_saved_logger.pop("level"))
    logger.propagate = _saved_logger.pop("propagate")


def _import_deepmd() -> dict[str, types.ModuleType]:
    try:
        return {name: importlib.import_module(name)
                for name in (_DATALOADER, _MAIN, _TRAINING, _UPDATE_SEL)}
    except (ImportError, RuntimeError, OSError) as exc:
        raise ConfigError(
            f"DeePMD-kit's PyTorch backend cannot be imported ({type(exc).__name__}: {exc}); "
            "install it next to your torch with pip install -c scripts/deepmd-constraints.txt "
            "-e \".[deepmd]\" in mdloader's repository (docs/migrating.md: keeping your torch, "
            "and DeePMD-kit's compiled ops)") from exc


def _patches(mods: dict[str, types.ModuleType]) -> dict[tuple[str, str], Any]:
    main = mods[_MAIN]
    real_dist = _saved.get((_MAIN, "dist"), main.dist)
    real_nbor_stat = _saved.get((_UPDATE_SEL, "BaseUpdateSel.get_nbor_stat"),
                                mods[_UPDATE_SEL].BaseUpdateSel.get_nbor_stat)
    real_run_stat = _saved.get((_TRAINING, "Trainer._run_stat_on_chief"),
                               mods[_TRAINING].Trainer._run_stat_on_chief)
    return {
        (_DATALOADER, "DpLoaderSet"): DeepmdDpLoaderSet,
        (_DATALOADER, "get_weighted_sampler"): get_weighted_sampler,
        (_DATALOADER, "get_sampler_from_params"): get_sampler_from_params,
        (_MAIN, "DpLoaderSet"): DeepmdDpLoaderSet,
        (_MAIN, "process_systems"): defer_discovery,
        (_MAIN, "dist"): _TrainerDist(real_dist),
        (_MAIN, "is_lmdb"): not_lmdb,
        (_MAIN, "get_data"): neighbour_stat_data,
        (_UPDATE_SEL, "BaseUpdateSel.get_nbor_stat"): mdloader_nbor_stat(real_nbor_stat),
        (_TRAINING, "DpLoaderSet"): DeepmdDpLoaderSet,
        (_TRAINING, "get_sampler_from_params"): get_sampler_from_params,
        (_TRAINING, "Trainer._run_stat_on_chief"): mdloader_run_stat_on_chief(real_run_stat),
    }


def _cpu_patches(mods: dict[str, types.ModuleType]) -> dict[tuple[str, str], Any]:
    """Only without CUDA: DeePMD-kit's DDP set-up assumes a GPU per rank and would crash."""
    import torch

    if torch.cuda.is_available():
        return {}
    training = mods[_TRAINING]
    return {(_TRAINING, "torch"): _TrainerTorch(_saved.get((_TRAINING, "torch"), training.torch)),
            (_TRAINING, "DDP"): _cpu_ddp(_saved.get((_TRAINING, "DDP"), training.DDP))}


def install() -> None:
    """Make DeePMD-kit's PyTorch trainer load its data through mdloader (idempotent).

    Raises
    ------
    ConfigError
        DeePMD-kit's PyTorch backend is not importable.
    """
    mods = _import_deepmd()
    for (module, name), value in {**_patches(mods), **_cpu_patches(mods)}.items():
        owner, attr = _owner(mods[module], name)
        if (module, name) not in _saved:
            _saved[(module, name)] = owner.__dict__[attr]
        setattr(owner, attr, value)
    if not _saved_logger:
        _route_logs_to_deepmd()
    log.debug("DeePMD-kit's trainer now loads data through mdloader")


def uninstall() -> None:
    """Restore DeePMD-kit's own names (for tests and interactive sessions)."""
    for (module, name), value in list(_saved.items()):
        owner, attr = _owner(sys.modules[module], name)
        setattr(owner, attr, value)
        del _saved[(module, name)]
    _restore_logs()


def _owner(module: types.ModuleType, name: str) -> tuple[Any, str]:
    """The object holding ``name`` (``"Class.attr"`` names a class attribute) and the attr."""
    *path, attr = name.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_saved)


def run_dp(argv: Sequence[str] | None = None) -> int:
    """``dp`` with mdloader underneath: ``run_dp(["--pt", "train", "input.json"])``.

    Works under ``torchrun`` like ``dp`` itself. Returns the exit code (argparse exits of
    DeePMD-kit's parser become return values; other exceptions propagate).
    """
    install()
    from deepmd.main import main as dp_main

    try:
        dp_main(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


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
    dist_module = sys.modules[_MAIN].dist
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


class InputStatPlan:
    """The trainer's statistics action, computed by mdloader in shares when it can be.

    Built on every rank from DeePMD-kit's ``initialize_statistics`` closure (the model, the
    training ``DpLoaderSet``, ``data_stat_nbatch``, the stat-file setting). :meth:`compute` is
    collective; :meth:`action` is what rank 0 then runs in place of DeePMD-kit's action: its
    own ``compute_or_load_stat``, fed the merged statistics.
    """

    def __init__(self, model: Any, data: DpLoaderSet, get_sample: Callable[[], Any],
                 preset_observed_type: Any, blocks: list[Any], nbatch: int) -> None:
        self.model = model
        self.data = data
        self.nbatch = int(nbatch)
        self.get_sample = get_sample
        self.preset_observed_type = preset_observed_type
        self.blocks = blocks
        self.settings = [env_settings(b) for b in blocks]

    @classmethod
    def of(cls, action: Callable[[], None]) -> InputStatPlan | None:
        """The plan for DeePMD-kit's ``action``, or ``None`` (then DeePMD-kit computes it:
        a stat file is set, fparam/aparam, exclusions or ``min_pair_dist`` are used)."""
        import inspect

        outer = inspect.getclosurevars(action).nonlocals
        model, spec = outer.get("_model"), outer.get("_stat_file_spec")
        get_sample = outer.get("get_sample")
        inner_fn = getattr(get_sample, "__wrapped__", None)
        if model is None or spec is None or inner_fn is None:
            return None
        inner = inspect.getclosurevars(inner_fn).nonlocals
        data, nbatch = inner.get("_training_data"), inner.get("_data_stat_nbatch")
        reason = _unsupported(model, data, nbatch, spec, inner.get("_min_pair_dist", 0.0))
        if reason:
            log.info("input statistics: DeePMD-kit's own (%s)", reason)
            return None
        blocks = _env_blocks(model)
        if not blocks:
            return None
        return cls(model, data, get_sample, outer.get("preset_observed_type"), blocks,
                   int(nbatch))

    def frame_counts(self) -> Any:
        """How many frames of each system enter: ``min(data_stat_nbatch, batches) x batch
        size``, at most the system's frames (:meth:`LoaderPlan.statistics_frames` has no
        repeats)."""
        import numpy as np

        nframes = np.asarray(self.data.nframes, dtype=np.int64)
        sizes = np.asarray(self.data.batch_sizes, dtype=np.int64)
        return np.minimum(np.minimum(-(-nframes // sizes), self.nbatch) * sizes, nframes)

    def frames(self, position: int) -> Any:
        """The frames system ``position`` gives the statistics, ``None`` when all do (then the
        all-frames cache entries are shared with every other ``data_stat_nbatch``)."""
        data = self.data
        nframes, size = int(data.nframes[position]), int(data.batch_sizes[position])
        if -(-nframes // size) <= self.nbatch:
            return None
        return data.plan.statistics_frames(position, self.nbatch)

    def compute(self) -> tuple[list[Any], list[Any]]:
        """The merged environment sums of each block and every system's output samples
        (collective: every rank calls it)."""
        type_map = getattr(self.data, "type_map", None)
        counts = self.frame_counts()
        total = int(sum(int(n) for n in self.data.nframes))
        world = current_world()
        if world.is_main and int(counts.sum()) == total:
            log.info("input statistics: all frames of %d systems, in shares on %d ranks",
                     len(self.data.systems), world.world_size)
        elif world.is_main:
            log.info("input statistics: %d of %d frames of %d systems (data_stat_nbatch=%d, "
                     "the frames of a one-rank job), in shares on %d ranks", int(counts.sum()),
                     total, len(self.data.systems), self.nbatch, world.world_size)
        return input_statistics(self.data.systems, self.settings, type_map=type_map,
                                frames=self.frames)

    def action(self, merged: tuple[list[Any], list[Any]]) -> Callable[[], None] | None:
        """Rank 0's statistics action on the merged results (``None``: some chosen frame has no
        energy, DeePMD-kit's own sampling decides)."""
        sums, samples = merged
        if any(len(s.counts) != int(n) for s, n in zip(samples, self.frame_counts())):
            return None
        sampled = output_sampled(samples)
        by_settings = dict(zip(self.settings, sums))
        model, preset, get_sample = self.model, self.preset_observed_type, self.get_sample

        def initialize_statistics() -> None:
            with _env_stats_from(by_settings, get_sample):
                model.compute_or_load_stat(sampled_func=lambda: sampled, stat_file_path=None,
                                           preset_observed_type=preset)

        return initialize_statistics


def _unsupported(model: Any, data: Any, nbatch: Any, spec: Any, min_pair_dist: Any) -> str:
    if not isinstance(data, DpLoaderSet):
        return "training data not read by mdloader"
    if getattr(spec, "path", None) is not None:
        return "training.stat_file is set"
    if float(min_pair_dist or 0.0) > 0:
        return "min_pair_dist filters frames"
    atomic = getattr(model, "atomic_model", None)
    fitting = getattr(atomic, "fitting_net", None)
    if atomic is None or fitting is None or list(getattr(atomic, "bias_keys", [])) != ["energy"]:
        return "not an energy model"
    if getattr(fitting, "numb_fparam", 0) or getattr(fitting, "numb_aparam", 0):
        return "fparam/aparam statistics"
    if getattr(atomic, "pair_exclude_types", None) or getattr(atomic, "atom_exclude_types", None):
        return "model-level exclude types"
    if isinstance(nbatch, bool) or not isinstance(nbatch, int) or nbatch < 1:
        return f"data_stat_nbatch={nbatch!r} is not a positive integer"
    return ""


def _env_blocks(model: Any) -> list[Any]:
    """The descriptor blocks whose ``davg``/``dstd`` come from ``EnvMatStatSe``."""
    needed = ("get_rcut", "get_rcut_smth", "get_sel", "get_nsel", "get_ntypes", "mixed_types",
              "get_env_protection", "compute_input_stats")
    return [m for m in model.modules()
            if all(hasattr(m, n) for n in needed) and hasattr(m, "mean") and
            hasattr(m, "stddev") and type(m).__name__.startswith("DescrptBlock")]


def env_settings(block: Any) -> Any:
    """The :class:`~mdloader.stats.env_mat.EnvMatSettings` of a DeePMD-kit block."""
    from deepmd.dpmodel.utils.env_mat_stat import EnvMatStatSe

    from mdloader.stats.env_mat import EnvMatSettings

    mixed = bool(block.mixed_types())
    sel = (int(block.get_nsel()),) if mixed else tuple(int(s) for s in block.get_sel())
    return EnvMatSettings(
        float(block.get_rcut()), float(block.get_rcut_smth()), sel, int(block.get_ntypes()),
        mixed_types=mixed, env_protection=float(block.get_env_protection()),
        radial_only=EnvMatStatSe(block).last_dim == 1,
        exclude_types=tuple(tuple(int(t) for t in p)
                            for p in getattr(block, "exclude_types", None) or ()))


def output_sampled(samples: Sequence[Any]) -> list[dict[str, Any]]:
    """DeePMD-kit's sampled systems, reduced to what its output statistics and observed types
    read: ``energy``, ``find_energy``, ``natoms`` and ``atype`` (virtual atoms ``-1``), on the
    CPU as ``make_stat_input`` packs them, whatever the default device."""
    import numpy as np
    import torch

    cpu = torch.device("cpu")
    out = []
    for s in samples:
        counts = np.asarray(s.counts, dtype=np.int64)
        natoms = counts.sum(axis=1, keepdims=True)
        width = int(natoms.max()) if len(natoms) else 0
        atype = np.full((len(counts), width), -1, dtype=np.int64)
        for f, row in enumerate(counts):
            types = np.repeat(np.arange(row.size), row)
            atype[f, :types.size] = types
        out.append({
            "energy": torch.as_tensor(np.asarray(s.labels, dtype=np.float64), device=cpu),
            "find_energy": np.float32(1.0),
            "natoms": torch.as_tensor(np.concatenate([natoms, natoms, counts], axis=1),
                                      device=cpu),
            "atype": torch.as_tensor(atype, device=cpu),
        })
    return out


class _env_stats_from:  # noqa: N801 - a context manager used like a function
    """While active, DeePMD-kit's ``EnvMatStatSe`` takes its ``StatItem``s from merged sums of
    the same settings; any other descriptor block samples as usual (``get_sample``)."""

    def __init__(self, by_settings: dict[Any, Any], get_sample: Callable[[], Any]) -> None:
        self.by_settings = by_settings
        self.get_sample = get_sample

    def __enter__(self) -> None:
        from deepmd.dpmodel.utils.env_mat_stat import EnvMatStatSe
        from deepmd.utils.env_mat_stat import StatItem

        by_settings, get_sample = self.by_settings, self.get_sample
        self.cls, self.original = EnvMatStatSe, EnvMatStatSe.load_or_compute_stats

        def load_or_compute_stats(stat: Any, data: Any, path: Any = None) -> None:
            sums = by_settings.get(env_settings(stat.descriptor))
            if sums is None:
                return self.original(stat, get_sample, path)
            keys = set(stat.get_stat_keys())
            stat.stats = {k: StatItem(*v) for k, v in sums.items().items() if k in keys}
            return None

        EnvMatStatSe.load_or_compute_stats = load_or_compute_stats

    def __exit__(self, *exc: Any) -> None:
        self.cls.load_or_compute_stats = self.original


def mdloader_run_stat_on_chief(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer._run_stat_on_chief``: for the statistics initialization, every rank first
    computes its share of the input statistics and one all-gather merges them; rank 0 then
    runs DeePMD-kit's ``compute_or_load_stat`` on the merged result."""

    def _run_stat_on_chief(self: Any, action: Callable[[], None], *, operation: str) -> None:
        plan = InputStatPlan.of(action) if operation == "statistics initialization" else None
        if plan is not None:
            ours = plan.action(plan.compute())
            if ours is not None:
                action = ours
        return original(self, action, operation=operation)

    return _run_stat_on_chief
