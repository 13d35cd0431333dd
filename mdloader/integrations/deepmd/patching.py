"""Install mdloader under DeePMD-kit's trainer: the patch set, ``install`` and ``uninstall``.

:func:`install` checks the installed DeePMD-kit against the seam
(:func:`~mdloader.integrations.deepmd.seam.check`) before it changes anything, then rebinds the
names of :data:`~mdloader.integrations.deepmd.seam.SEAM` it patches, in the modules that bound
them at import time, and hands the ``mdloader`` loggers' records to DeePMD-kit's ``deepmd``
logger, so DeePMD-kit's level and handlers decide about them as about its own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import types
from collections.abc import Sequence
from typing import Any

from mdloader.config.unsupported import refuse_under_deepmd
from mdloader.integrations.deepmd import hooks, seam
from mdloader.integrations.deepmd.failures import ending_together
from mdloader.integrations.deepmd.full_validation import sharded_builds
from mdloader.integrations.deepmd.input_stats import mdloader_run_stat_on_chief
from mdloader.integrations.deepmd.seam import MAIN, TRAINING, UPDATE_SEL, owner_of
from mdloader.integrations.deepmd.shims import cpu_ddp, trainer_dist, trainer_torch
from mdloader.integrations.deepmd.stopping import stop_signals
from mdloader.integrations.deepmd.systems import (
    DeepmdDpLoaderSet,
    deepmd_sampler_from_params,
    defer_discovery,
    forget_job,
    mdloader_nbor_stat,
    neighbour_stat_data,
    not_lmdb,
    recording_normalize,
    recording_shared_params,
)
from mdloader.loading.loader import get_weighted_sampler

log = logging.getLogger(__name__)

_saved: dict[tuple[str, str], Any] = {}
_saved_logger: dict[str, Any] = {}


def _original(mods: dict[str, types.ModuleType], module: str, name: str) -> Any:
    """DeePMD-kit's own value of ``module.name`` (saved by an earlier install, else current)."""
    if (module, name) in _saved:
        return _saved[(module, name)]
    owner, attr = owner_of(mods[module], name)
    return getattr(owner, attr)


def patches(mods: dict[str, types.ModuleType]) -> dict[tuple[str, str], Any]:
    """The value mdloader gives every name :func:`install` rebinds, keyed ``(module, name)``."""
    table: dict[tuple[str, str], Any] = {
        (seam.DATALOADER, "DpLoaderSet"): DeepmdDpLoaderSet,
        (seam.DATALOADER, "get_weighted_sampler"): get_weighted_sampler,
        (seam.DATALOADER, "get_sampler_from_params"): deepmd_sampler_from_params,
        (MAIN, "DpLoaderSet"): DeepmdDpLoaderSet,
        (MAIN, "process_systems"): defer_discovery,
        (MAIN, "dist"): trainer_dist(_original(mods, MAIN, "dist")),
        (MAIN, "is_lmdb"): not_lmdb,
        (MAIN, "get_data"): neighbour_stat_data,
        (MAIN, "normalize"): recording_normalize(_original(mods, MAIN, "normalize")),
        (MAIN, "preprocess_shared_params"): recording_shared_params(
            _original(mods, MAIN, "preprocess_shared_params")),
        (UPDATE_SEL, "BaseUpdateSel.get_nbor_stat"): mdloader_nbor_stat(
            _original(mods, UPDATE_SEL, "BaseUpdateSel.get_nbor_stat")),
        (TRAINING, "DpLoaderSet"): DeepmdDpLoaderSet,
        (TRAINING, "get_sampler_from_params"): deepmd_sampler_from_params,
        (TRAINING, "Trainer._run_stat_on_chief"): mdloader_run_stat_on_chief(
            _original(mods, TRAINING, "Trainer._run_stat_on_chief")),
        (TRAINING, "dp_random"): hooks.SCHEDULED_TASKS,
        (TRAINING, "Trainer.__init__"): hooks.trainer_init(
            _original(mods, TRAINING, "Trainer.__init__")),
        (TRAINING, "Trainer.run"): hooks.trainer_run(_original(mods, TRAINING, "Trainer.run")),
        (TRAINING, "Trainer._next_training_batch"): hooks.next_training_batch(
            _original(mods, TRAINING, "Trainer._next_training_batch")),
        (TRAINING, "Trainer.save_model"): hooks.saving_loader_state(
            _original(mods, TRAINING, "Trainer.save_model")),
        (TRAINING, "build_full_validators"): sharded_builds(
            _original(mods, TRAINING, "build_full_validators")),
    }
    import torch

    if not torch.cuda.is_available():  # DeePMD-kit's DDP set-up assumes a GPU per rank
        table[(TRAINING, "torch")] = trainer_torch(_original(mods, TRAINING, "torch"))
        table[(TRAINING, "DDP")] = cpu_ddp(_original(mods, TRAINING, "DDP"))
    return table


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


def install() -> None:
    """Make DeePMD-kit's PyTorch trainer load its data through mdloader (idempotent).

    Everything is checked before anything is patched: on an error nothing has changed.

    Raises
    ------
    UnsupportedDeepmdError
        The installed DeePMD-kit is outside the supported versions or lacks a seam name.
    ConfigError
        DeePMD-kit's PyTorch backend is not importable.
    """
    mods = seam.check()
    for (module, name), value in patches(mods).items():
        if (module, name) in _saved:  # installed already: what is bound now stays (a wrap
            continue                  # made after the first install keeps its place)
        owner, attr = owner_of(mods[module], name)
        _saved[(module, name)] = owner.__dict__[attr]
        setattr(owner, attr, value)
    if not _saved_logger:
        _route_logs_to_deepmd()
    log.debug("DeePMD-kit's trainer now loads data through mdloader")


def uninstall() -> None:
    """Restore DeePMD-kit's own names (for tests and interactive sessions)."""
    for (module, name), value in list(_saved.items()):
        owner, attr = owner_of(seam.deepmd_module(module), name)
        setattr(owner, attr, value)
        del _saved[(module, name)]
    forget_job()
    _restore_logs()


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_saved)


def refuse_before_setup(argv: Sequence[str]) -> None:
    """The input of ``dp train`` checked for what ``mdloader dp`` does not serve, before any
    set-up (:func:`~mdloader.config.unsupported.refuse_under_deepmd`); other commands, and
    arguments DeePMD-kit's parser refuses, are left to DeePMD-kit."""
    parser = seam.deepmd_module(seam.DP_MAIN).main_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = parser.parse_known_args(list(argv))
    except SystemExit:  # a usage error, or --help: DeePMD-kit says it
        return
    if getattr(args, "command", None) != "train" or not getattr(args, "INPUT", None):
        return
    try:
        data = seam.deepmd_module(seam.COMMON).j_loader(args.INPUT)
    except (OSError, TypeError, ValueError):  # DeePMD-kit says what is wrong with the file
        return
    refuse_under_deepmd(data)


def run_dp(argv: Sequence[str] | None = None) -> int:
    """``dp`` with mdloader underneath: ``run_dp(["--pt", "train", "input.json"])``.

    Works under ``torchrun`` like ``dp`` itself; SIGTERM and SIGUSR1 stop it after an agreed
    step with a checkpoint (:mod:`~mdloader.integrations.deepmd.stopping`). Returns the exit
    code (argparse exits of DeePMD-kit's parser become return values; other exceptions
    propagate, under a started group as the job's first failure on every rank:
    :func:`~mdloader.integrations.deepmd.failures.ending_together`).
    """
    install()
    dp_main = seam.deepmd_module(seam.DP_MAIN).main
    args = list(sys.argv[1:] if argv is None else argv)
    refuse_before_setup(args)
    try:
        with stop_signals():
            ending_together(lambda: dp_main(args))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
