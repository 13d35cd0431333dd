"""Every DeePMD-kit name mdloader touches, the DeePMD-kit versions they hold for, and the check.

:data:`SEAM` lists each name once -- the module names mdloader rebinds, calls or reads, and every
attribute of DeePMD-kit's trainer it reads or writes -- with what mdloader does with it
(``patch``: rebound while installed; ``wrap``: rebound to a function that calls DeePMD-kit's own;
``call``; ``read``; ``write``) and why. :func:`check` compares the installed DeePMD-kit with
:data:`SUPPORTED` and resolves every module name before
:func:`~mdloader.integrations.deepmd.patching.install` changes anything; a test records what a
real ``mdloader dp`` run touches and fails on a name the table does not hold.
:func:`deepmd_module` is the one way mdloader reaches DeePMD-kit's modules; the one place that
reads DeePMD-kit's private state is :func:`statistics_call`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import types
from collections.abc import Callable, Iterator
from typing import Any

from mdloader.errors import ConfigError

#: The DeePMD-kit releases the seam was written and tested against (a PEP 440 specifier).
SUPPORTED = ">=3.2.0,<3.3"

DATALOADER = "deepmd.pt.utils.dataloader"
MAIN = "deepmd.pt.entrypoints.main"
TRAINING = "deepmd.pt.train.training"
UPDATE_SEL = "deepmd.utils.update_sel"
ENV_MAT_STAT = "deepmd.dpmodel.utils.env_mat_stat"
STAT_ITEM = "deepmd.utils.env_mat_stat"
DP_MAIN = "deepmd.main"
COMMON = "deepmd.common"
MODEL = "deepmd.pt.model.model.model"
DESCRIPTOR = "deepmd.pt.model.descriptor.descriptor"
STAT = "deepmd.pt.utils.stat"
ATOMIC_MODEL = "deepmd.pt.model.atomic_model.base_atomic_model"
VALIDATION = "deepmd.pt_expt.train.validation"

#: DeePMD-kit's full validator class, bound to mdloader's sharded one while its builder runs.
FULL_VALIDATOR_CLASS = "FullValidator"

#: Where ``install`` imports the modules it checks and patches.
MODULES = (DATALOADER, MAIN, TRAINING, UPDATE_SEL, ENV_MAT_STAT, STAT_ITEM, DP_MAIN, COMMON,
           MODEL, DESCRIPTOR, STAT, ATOMIC_MODEL, VALIDATION)


@dataclasses.dataclass(frozen=True)
class SeamName:
    """One DeePMD-kit name: ``module`` and ``name`` (``"Class.attr"`` for a class attribute).

    ``static`` names exist on the module and are resolved by :func:`check`; the others are
    attributes of objects DeePMD-kit creates (its trainer, model, descriptor blocks), read when
    the objects exist.
    """

    module: str
    name: str
    use: str
    why: str
    static: bool = True


SEAM: tuple[SeamName, ...] = (
    SeamName(DATALOADER, "DpLoaderSet", "patch", "the loader set the trainer builds"),
    SeamName(DATALOADER, "get_weighted_sampler", "patch", "mdloader's stateful sampler"),
    SeamName(DATALOADER, "get_sampler_from_params", "patch", "mdloader's stateful sampler"),
    SeamName(MAIN, "DpLoaderSet", "patch", "the loader set `main` builds"),
    SeamName(MAIN, "process_systems", "patch",
             "deferred discovery: only rank 0 walks the data tree, inside the build"),
    SeamName(MAIN, "dist", "patch",
             "`torch.distributed` with a gloo fallback for NCCL and a barrier before "
             "`destroy_process_group`"),
    SeamName(MAIN, "is_lmdb", "patch", "an LMDB `systems` path is read by mdloader"),
    SeamName(MAIN, "get_data", "patch", "neighbour statistics data that reads nothing"),
    SeamName(MAIN, "normalize", "wrap",
             "the job's `systems` sections, built once per job; the keys only mdloader reads "
             "(balanced steps) taken out before DeePMD-kit's strict check"),
    SeamName(MAIN, "preprocess_shared_params", "wrap",
             "tasks sharing a descriptor get joint neighbour statistics"),
    SeamName(UPDATE_SEL, "BaseUpdateSel.get_nbor_stat", "wrap",
             "neighbour statistics of mdloader's data, in shares"),
    SeamName(TRAINING, "DpLoaderSet", "patch", "the loader set the trainer builds"),
    SeamName(TRAINING, "get_sampler_from_params", "patch", "mdloader's stateful sampler"),
    SeamName(TRAINING, "Trainer._run_stat_on_chief", "wrap",
             "input statistics in shares before rank 0's own action (no public hook)"),
    SeamName(TRAINING, "dp_random", "patch",
             "the task of each multi-task step from the feed's schedule: a function of (seed, "
             "step, rank), unlike the unseeded global generator"),
    SeamName(TRAINING, "Trainer.__init__", "wrap",
             "the trainer's streams become one feed; keeps the `--restart` checkpoint, whose "
             "loader state `run` restores"),
    SeamName(TRAINING, "Trainer.run", "wrap",
             "starts the trainer's feed: the loader state saved beside the `--restart` "
             "checkpoint restored (the step DeePMD-kit would run twice skipped), the task "
             "schedule set at the first step, one pool of DataLoader workers started; the "
             "feed's iterators in place of the trainer's for the run"),
    SeamName(TRAINING, "Trainer._next_training_batch", "wrap",
             "called once per training step by the loop: the feed's step (a training draw, "
             "not a display-time one); every `$MDLOADER_STOP_CHECK_STEPS` steps the ranks agree "
             "on a stop signal, and on one save the checkpoint of the last step done"),
    SeamName(TRAINING, "Trainer.save_model", "wrap",
             "writes the loader state beside each checkpoint (rank 0, atomically)"),
    SeamName(TRAINING, "NUM_WORKERS", "read",
             "the worker processes of the feed's pool (DeePMD-kit's number per DataLoader)"),
    SeamName(TRAINING, "DEVICE", "read", "the pool pins its batches' memory unless it is the CPU"),
    SeamName(TRAINING, "Trainer.model_keys", "read", "the tasks, in the trainer's order", False),
    SeamName(TRAINING, "Trainer.multi_task", "read", "whether the trainer has tasks", False),
    SeamName(TRAINING, "Trainer.training_dataloader", "read",
             "each task's mdloader sampler and loader set: the feed's training streams",
             False),
    SeamName(TRAINING, "Trainer.validation_dataloader", "read",
             "each task's mdloader sampler and loader set: the feed's validation streams",
             False),
    SeamName(TRAINING, "Trainer.training_data", "write",
             "during `run`, the feed's training draws of each task (a display-time draw reads "
             "the task's display stream)", False),
    SeamName(TRAINING, "Trainer.validation_data", "write",
             "during `run`, the feed's validation stream of each task", False),
    SeamName(TRAINING, "Trainer.disp_avg", "read",
             "without it, a multi-task display draws a batch of every task not trained, from "
             "its display stream", False),
    SeamName(TRAINING, "Trainer.disp_freq", "read",
             "with `display_in_training` and `valid_numb_batch`: the steps at which the loop "
             "draws validation batches, forecast for the worker pool", False),
    SeamName(TRAINING, "Trainer.display_in_training", "read", "see `disp_freq`", False),
    SeamName(TRAINING, "Trainer.disp_file", "read",
             "`lcurve.out`: the data-stall report (`stalls.jsonl`) is written beside it",
             False),
    SeamName(TRAINING, "Trainer.valid_numb_batch", "read", "see `disp_freq`", False),
    SeamName(TRAINING, "Trainer.model_prob", "read",
             "DeePMD-kit's resolved task probabilities, the schedule's", False),
    SeamName(TRAINING, "Trainer.num_steps", "read",
             "the exact-count window of `num_epoch_dict`", False),
    SeamName(TRAINING, "Trainer.rank", "read", "rank 0 writes the loader state and logs",
             False),
    SeamName(TRAINING, "Trainer.start_step", "write",
             "the restart step; one more when the loader state is restored", False),
    SeamName(TRAINING, "Trainer.scheduler", "read",
             "stepped once when the repeated restart step is skipped", False),
    SeamName(TRAINING, "build_full_validators", "wrap",
             "DeePMD-kit's builder of the full validators (its checks, schedule, metric, "
             "`val.log` and best checkpoints), building mdloader's sharded validators"),
    SeamName(VALIDATION, "FullValidator", "patch",
             "while `build_full_validators` runs only: a subclass whose `run` has every rank "
             "evaluate its share of the validation frames (the feed's full pass), merged in "
             "one gather, before DeePMD-kit's own `run` (best checkpoint, `val.log`) on rank 0"),
    SeamName(VALIDATION, "FullValidator.run", "wrap",
             "called by the subclass's `run` once the ranks merged their metrics"),
    SeamName(VALIDATION, "FullValidator.evaluate_all_systems", "patch",
             "in the subclass: the merged metrics instead of rank 0's pass over every system"),
    SeamName(VALIDATION, "FullValidator.should_run", "call",
             "whether the step is due (every rank asks before its share)"),
    SeamName(VALIDATION, "FullValidator._predict_outputs", "call",
             "DeePMD-kit's own model inputs and outputs, for each batch of a rank's share"),
    SeamName(VALIDATION, "FullValidator.profile", "read",
             "`compute_system_metrics` of each batch and `needs_spin`", False),
    SeamName(VALIDATION, "FullValidator.model", "read",
             "the model evaluated (`get_dim_fparam`, `get_dim_aparam`; eval mode on every "
             "rank)", False),
    SeamName(VALIDATION, "FullValidator.matmul_precision", "read",
             "the evaluation's precision policy, applied on every rank", False),
    SeamName(VALIDATION, "FullValidator.model_eval_context", "read",
             "the EMA validator's shadow weights, swapped in on every rank", False),
    SeamName(VALIDATION, "FullValidator.table_column_specs", "read",
             "the metrics of the `val.log` columns", False),
    SeamName(TRAINING, "Trainer.full_validator", "read",
             "the sharded validator, given the feed's full pass for the run", False),
    SeamName(TRAINING, "Trainer.ema_full_validator", "read",
             "the EMA weights' sharded validator, given the feed's full pass for the run",
             False),
    SeamName(TRAINING, "Trainer.nonfinite_grad_guard", "write",
             "during `run`, DeePMD-kit's guard whose check, run by every rank before a "
             "checkpoint, also gathers the feed's state to rank 0", False),
    SeamName(TRAINING, "Trainer.ckpt_store", "call",
             "on a stop signal: `path_for` and `publish` of that checkpoint, as the loop "
             "saves one", False),
    SeamName(TRAINING, "Trainer.lr_schedule", "call",
             "on a stop signal: the learning rate saved with that checkpoint", False),
    SeamName(TRAINING, "Trainer.wrapper", "read",
             "on a stop signal: the parameters the non-finite guard checks", False),
    SeamName(TRAINING, "Trainer.latest_model", "write",
             "on a stop signal: the checkpoint written, as the loop records it", False),
    SeamName(TRAINING, "torch", "patch", "CPU only: `torch.cuda.set_device` does nothing"),
    SeamName(TRAINING, "DDP", "patch", "CPU only: DDP without `device_ids`"),
    SeamName(TRAINING, "open_stat_file", "patch",
             "during `statistics_call` only: records the stat-file setting, opens nothing"),
    SeamName(TRAINING, "make_stat_input", "patch",
             "during `statistics_call` only: records the data and `data_stat_nbatch`; "
             "under `MDLOADER_STAT_FRAMES=all`, during DeePMD-kit's own statistics action: "
             "handed loaders of every frame of each system"),
    SeamName(TRAINING, "model_change_out_bias", "patch",
             "during `finetune_call` only: records the fine-tuned model, its sampled function "
             "and bias mode; during rank 0's fine-tuning action: handed the merged samples"),
    SeamName(TRAINING, "get_additional_data_requirement", "call",
             "the labels a task's training set needs, added when its input statistics are "
             "computed with the first task's"),
    SeamName(TRAINING, "Trainer.loss", "read",
             "each task's `label_requirement` (the statistics of every task in one pass)",
             False),
    SeamName(TRAINING, "Trainer.stat_file_specs", "read",
             "each task's stat-file setting (a task with a stat file keeps DeePMD-kit's "
             "statistics)", False),
    SeamName(TRAINING, "Trainer.finetune_links", "read",
             "under `--finetune`, which tasks compute input statistics (new types)", False),
    SeamName(STAT, "_compute_model_predict", "patch",
             "during rank 0's fine-tuning action only: the predictions every rank made for "
             "its share of the frames (one all-gather), instead of rank 0's forward pass"),
    SeamName(ATOMIC_MODEL, "BaseAtomicModel._get_forward_wrapper_func", "call",
             "the loaded model's forward, run by every rank on its share of the fine-tuning "
             "statistics frames"),
    SeamName(TRAINING, "Trainer.model", "read",
             "the models whose `compute_or_load_stat` the statistics action calls", False),
    SeamName(MODEL, "BaseModel.compute_or_load_stat", "call",
             "rank 0's statistics on the merged sums; recorded on the instance during "
             "`statistics_call`"),
    SeamName(MODEL, "BaseModel.atomic_model", "read",
             "`fitting_net`, `bias_keys`, `numb_fparam`/`numb_aparam` and the exclude types: "
             "whether mdloader can compute the statistics", False),
    SeamName(DESCRIPTOR, "DescriptorBlock.compute_input_stats", "read",
             "a block whose `mean`/`stddev` come from `EnvMatStatSe`; its `get_rcut`, "
             "`get_rcut_smth`, `get_sel`, `get_nsel`, `get_ntypes`, `mixed_types`, "
             "`get_env_protection` and `exclude_types` give mdloader's settings"),
    SeamName(ENV_MAT_STAT, "EnvMatStatSe", "call",
             "a block's environment settings (`last_dim`, `descriptor`, `get_stat_keys`)"),
    SeamName(ENV_MAT_STAT, "EnvMatStatSe.load_or_compute_stats", "patch",
             "during rank 0's action only: the merged `StatItem`s instead of a pass"),
    SeamName(STAT_ITEM, "StatItem", "call", "the merged sums as DeePMD-kit's statistics"),
    SeamName(DP_MAIN, "main", "call", "`mdloader dp` is DeePMD-kit's own command line"),
    SeamName(DP_MAIN, "main_parser", "call",
             "the input of `dp train`, found as DeePMD-kit finds it, is checked before any "
             "set-up"),
    SeamName(COMMON, "j_loader", "call", "reads that input (JSON or YAML) as DeePMD-kit does"),
)


class UnsupportedDeepmdError(ConfigError):
    """The installed DeePMD-kit is not one the seam holds for: nothing was patched."""


def installed_version() -> str:
    """The installed DeePMD-kit's version, from its distribution metadata (nothing imported)."""
    try:
        return importlib.metadata.version("deepmd-kit")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(importlib.import_module("deepmd"), "__version__", "unknown"))


def supported(version: str) -> bool:
    """Whether DeePMD-kit ``version`` is in :data:`SUPPORTED` (a development build of a
    supported release, ``3.2.1.dev3+g1234567``, is too)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(SUPPORTED).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def owner_of(module: types.ModuleType, name: str) -> tuple[Any, str]:
    """The object holding ``name`` (``"Class.attr"`` names a class attribute) and the attr."""
    *path, attr = name.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def deepmd_module(name: str) -> types.ModuleType:
    """DeePMD-kit's module ``name``, one of :data:`MODULES` (the only way mdloader imports
    DeePMD-kit)."""
    return importlib.import_module(name)


def import_modules() -> dict[str, types.ModuleType]:
    """DeePMD-kit's modules of :data:`MODULES`, imported."""
    try:
        return {name: deepmd_module(name) for name in MODULES}
    except (ImportError, RuntimeError, OSError) as exc:
        raise ConfigError(
            f"DeePMD-kit's PyTorch backend cannot be imported ({type(exc).__name__}: {exc}); "
            "install it next to your torch with pip install -c scripts/deepmd-constraints.txt "
            "-e \".[deepmd]\" in mdloader's repository (docs/migrating.md: keeping your torch, "
            "and DeePMD-kit's compiled ops)") from exc


def check() -> dict[str, types.ModuleType]:
    """DeePMD-kit's modules, once its version is supported and every static name resolves.

    Raises
    ------
    UnsupportedDeepmdError
        The version is outside :data:`SUPPORTED`, or a listed name is missing.
    ConfigError
        DeePMD-kit's PyTorch backend is not importable.
    """
    try:
        version: str | None = installed_version()
    except (ImportError, RuntimeError, OSError):  # import_modules says why
        version = None
    if version is not None and not supported(version):
        raise UnsupportedDeepmdError(
            f"DeePMD-kit {version} is installed, but mdloader's DeePMD-kit integration supports "
            f"deepmd-kit{SUPPORTED}; install one of those (nothing was patched)")
    mods = import_modules()
    missing = []
    for entry in SEAM:
        if entry.static:
            try:
                owner, attr = owner_of(mods[entry.module], entry.name)
                getattr(owner, attr)
            except AttributeError:
                missing.append(f"{entry.module}.{entry.name}")
    if missing:
        raise UnsupportedDeepmdError(
            f"DeePMD-kit {version} lacks {', '.join(missing)}, which mdloader's DeePMD-kit "
            f"integration uses; it supports deepmd-kit{SUPPORTED} (nothing was patched)")
    return mods


def markdown_table() -> str:
    """:data:`SEAM` as the Markdown table of the docs (checked equal by the tests)."""
    rows = ["| DeePMD-kit name | use | why |", "|---|---|---|"]
    rows += [f"| `{e.module}.{e.name}` | {e.use} | {e.why} |" for e in SEAM]
    return "\n".join(rows)


@dataclasses.dataclass
class StatisticsCall:
    """What DeePMD-kit's statistics initialization computes with: the model, its sampled
    function, the observed types given, the stat-file setting, the data and its
    ``make_stat_input`` arguments."""

    model: Any
    get_sample: Callable[[], Any]
    preset_observed_type: Any
    stat_file_spec: Any
    data: Any
    nbatch: Any
    min_pair_dist: Any


@contextlib.contextmanager
def patched(owner: Any, attr: str, value: Any) -> Iterator[None]:
    """``owner.attr`` is ``value`` while active (DeePMD-kit's own again afterwards)."""
    had = attr in vars(owner)
    before = vars(owner).get(attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, attr, before)
        else:
            delattr(owner, attr)


def statistics_calls(trainer: Any, action: Callable[[], None]) -> list[StatisticsCall] | None:
    """Run DeePMD-kit's statistics ``action`` with its callees recording their arguments.

    The action is a closure of ``Trainer.__init__`` (no public hook hands its values out):
    ``open_stat_file`` and every model's ``compute_or_load_stat`` (each model of a multi-task
    trainer) record what the action passes, then each sampled function's undecorated body runs
    with ``make_stat_input`` recording the data. Nothing is read or computed. One call per
    model the action computes, in its order; ``None`` when the action does not call them so.
    """
    training = deepmd_module(TRAINING)
    models = trainer.model
    models = list(models.values()) if isinstance(models, dict) else [models]
    specs: list[Any] = []
    seen: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def open_stat_file(spec: Any) -> Iterator[None]:
        specs.append(spec)
        yield None

    def recorder(model: Any) -> Callable[..., None]:
        def compute_or_load_stat(sampled_func: Any, stat_file_path: Any = None,
                                 preset_observed_type: Any = None) -> None:
            seen.append({"model": model, "get_sample": sampled_func,
                         "preset": preset_observed_type,
                         "spec": specs[-1] if specs else None, "opened": bool(specs)})
        return compute_or_load_stat

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(training, "open_stat_file", open_stat_file))
        for model in models:
            stack.enter_context(patched(model, "compute_or_load_stat", recorder(model)))
        action()
    calls = []
    for entry in seen:
        data = _sampled_input(entry["get_sample"]) if entry["opened"] else None
        if data is None:
            return None
        calls.append(StatisticsCall(entry["model"], entry["get_sample"], entry["preset"],
                                    entry["spec"], *data))
    return calls or None


def _sampled_input(get_sample: Any) -> tuple[Any, Any, Any] | None:
    """The loader set, ``data_stat_nbatch`` and ``min_pair_dist`` a sampled function of
    ``Trainer.__init__`` hands ``make_stat_input``: its undecorated body runs with
    ``make_stat_input`` recording them (nothing is read); ``None`` when it does not."""
    training = deepmd_module(TRAINING)
    inner = getattr(get_sample, "__wrapped__", None)  # functools.lru_cache's
    if inner is None:
        return None
    data: dict[str, Any] = {}

    def make_stat_input(datasets: Any, dataloaders: Any, nbatch: Any,
                        min_pair_dist: Any = 0.0, **kwargs: Any) -> list[Any]:
        data.update(dataloaders=dataloaders, nbatch=nbatch, min_pair_dist=min_pair_dist)
        return []

    with patched(training, "make_stat_input", make_stat_input):
        inner()
    if "dataloaders" not in data:
        return None
    return (getattr(data["dataloaders"], "loader_set", None), data["nbatch"],
            data["min_pair_dist"])


def statistics_call(trainer: Any, action: Callable[[], None]) -> StatisticsCall | None:
    """The one :class:`StatisticsCall` of ``action`` (:func:`statistics_calls`); ``None`` when
    it computes no model, or several (then DeePMD-kit's own action runs)."""
    calls = statistics_calls(trainer, action)
    return calls[0] if calls is not None and len(calls) == 1 else None


def finetune_call(trainer: Any, action: Callable[[], None]) -> tuple[StatisticsCall, str] | None:
    """What DeePMD-kit's fine-tuning statistics ``action`` computes with, and its bias mode
    (``"change-by-statistic"``, ``"set-by-statistic"``): ``model_change_out_bias`` records its
    arguments and returns the model unchanged, so the action's own assignment changes nothing.
    Nothing is read or computed. ``None`` when the action does not call it once."""
    training = deepmd_module(TRAINING)
    seen: list[tuple[Any, Any, str]] = []

    def model_change_out_bias(_model: Any, _sample_func: Any,
                              _bias_adjust_mode: str = "change-by-statistic") -> Any:
        seen.append((_model, _sample_func, _bias_adjust_mode))
        return _model

    with patched(training, "model_change_out_bias", model_change_out_bias):
        action()
    if len(seen) != 1:
        return None
    model, get_sample, mode = seen[0]
    data = _sampled_input(get_sample)
    if data is None:
        return None
    return StatisticsCall(model, get_sample, None, None, *data), mode


#: DeePMD-kit's private names mdloader calls (each a :data:`SEAM` name), read by :func:`private`.
FORWARD_WRAPPER = "_get_forward_wrapper_func"
COMPUTE_MODEL_PREDICT = "_compute_model_predict"


def private(owner: Any, name: str) -> Any:
    """DeePMD-kit's private attribute ``name`` of ``owner`` (a module or object), one of the
    names above: the seam is where DeePMD-kit's private names are read."""
    if name not in (FORWARD_WRAPPER, COMPUTE_MODEL_PREDICT):
        raise ConfigError(f"{name} is not a DeePMD-kit name of mdloader's seam")
    return getattr(owner, name)
