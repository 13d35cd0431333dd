"""What an ``input.json`` may ask for that mdloader does not serve, refused in one line each.

DeePMD-kit's ``examples/`` hold inputs for its other backends and modes. Rather than failing
later on a symptom (an unknown batch rule, a type id beyond the type map, a folder without
systems), each is refused before anything is read, naming the feature and its JSON path.
"""

from __future__ import annotations

import copy
from typing import Any

from mdloader import settings
from mdloader.data.formats.lmdb.address import mixed_database
from mdloader.errors import ConfigError
from mdloader.sampling.batching import parse_rule
from mdloader.sampling.mixed import check_mixed_rule, is_mixed_rule

#: Keys of ``model.spin`` that only DeePMD-kit's TensorFlow spin model reads.
TF_SPIN_KEYS = ("spin_norm", "virtual_len")

#: Why one single-task configuration (``mdloader train``'s) cannot hold a multi-task input.
MULTITASK_REFUSED = ("a multi-task input: mdloader train trains one task; train it with "
                     "`mdloader dp --pt train` (mdloader check, stat, index and bench read "
                     "it per task)")


def refuse_unsupported(data: dict) -> None:
    """Raise one ConfigError naming the first feature of ``data`` that mdloader does not serve.

    Multi-task training (``model.model_dict``, ``training.data_dict``: one ``Config`` is one
    task; :mod:`mdloader.config.multitask` reads such an input as its tasks); a TensorFlow spin
    model (``model.spin`` with ``spin_norm``/``virtual_len``: its data put virtual spin atoms in
    ``type.raw``, while DeePMD-kit's PyTorch backend reads ``spin.npy``); the TensorFlow-only
    ``mixed:N`` batch rule.
    """
    model, training = _section(data, "model"), _section(data, "training")
    for path, section, key in (("model.model_dict", model, "model_dict"),
                               ("training.data_dict", training, "data_dict")):
        if key in section:
            raise ConfigError(MULTITASK_REFUSED, path=path)
    spin = _section(model, "spin")
    tf_keys = [k for k in TF_SPIN_KEYS if k in spin]
    if tf_keys:
        raise ConfigError("TensorFlow spin models (virtual spin atoms in type.raw) are not "
                          "supported by mdloader, which reads spin.npy as DeePMD-kit's PyTorch "
                          "backend does", path=f"model.spin.{tf_keys[0]}")
    for name in ("training_data", "validation_data"):
        _refuse_tensorflow_rule(_section(training, name).get("batch_size"),
                                f"training.{name}.batch_size")


def _refuse_tensorflow_rule(batch: Any, path: str) -> None:
    """The TensorFlow-only ``mixed:N`` batch rule at ``path``, refused in one line."""
    if isinstance(batch, str) and batch.strip().startswith("mixed"):
        raise ConfigError(f"the batch-size rule {batch!r} is TensorFlow-only (DeePMD-kit's "
                          "PyTorch backend refuses it too)", path=path)


#: Keys of a data section that mdloader reads in ``mdloader train`` and that DeePMD-kit's trainer
#: does not know: under ``mdloader dp`` they would be accepted and then ignored, or stop the run
#: in DeePMD-kit's strict check with a traceback that names neither mdloader nor what to do.
MDLOADER_DATA_KEYS = ("index_file",)

#: Keys of ``training_data`` that mdloader reads under both trainers (balanced steps): under
#: ``mdloader dp`` they are taken out of the input before DeePMD-kit's strict check
#: (:func:`take_mdloader_keys`) and act on mdloader's sampler.
BALANCE_KEYS = ("balance_window", "balance_cost")

#: What lets a multi-task job under ``mdloader dp`` balance its steps: every rank trains the same
#: task at each step (:mod:`mdloader.sampling.tasks`), so each task's streams advance in lockstep.
SAME_TASK_SETTING = "MDLOADER_TASK_DRAW=same"


def refuse_under_deepmd(data: dict, task_draw: str | None = None) -> None:
    """Raise one ConfigError naming the first thing in ``data`` that ``mdloader dp`` would not
    act on: a full validation DeePMD-kit itself refuses (:func:`refuse_full_validation`), a key
    only ``mdloader train`` reads (:data:`MDLOADER_DATA_KEYS`), a balance key
    (:data:`BALANCE_KEYS`) outside ``training_data`` or, in a multi-task input, under per-rank
    task draws (``task_draw``: the ``MDLOADER_TASK_DRAW`` setting, read when ``None``), or a
    batch-size rule mdloader does not serve (``mix:N`` on anything but one LMDB database, the
    TensorFlow-only ``mixed:N``, an unknown or malformed rule), in any data section of any task.

    The one place of these rules: ``mdloader dp`` calls it before any set-up, and
    ``mdloader check --for dp`` calls it, so both give the same line.
    """
    refuse_full_validation(data)
    multitask = "data_dict" in _section(data, "training")
    for path, section in data_sections(data):
        for key in MDLOADER_DATA_KEYS:
            if key in section:
                raise ConfigError(f"read by mdloader train only: mdloader dp runs "
                                  f"DeePMD-kit's trainer, which does not know {key}; "
                                  "remove it (docs/migrating.md)", path=f"{path}.{key}")
        _refuse_balance(section, path, multitask, task_draw)
        batch = section.get("batch_size")
        if isinstance(batch, str):
            _refuse_tensorflow_rule(batch, f"{path}.batch_size")
            if is_mixed_rule(batch):
                check_mixed_rule(batch, f"{path}.batch_size")
                _refuse_epochs_with_mix(data, f"{path}.batch_size")
                systems = section.get("systems")
                mixed_database([systems] if isinstance(systems, str) else list(systems or []),
                               f"{path}.batch_size")
            else:
                parse_rule(batch, key=f"{path}.batch_size")


def _refuse_epochs_with_mix(data: dict, key: str) -> None:
    """``num_epoch``/``num_epoch_dict`` beside a ``mix:N`` section, refused in one line: the
    steps of an epoch would be counted from per-system batches, not from the mix:N passes."""
    training = _section(data, "training")
    for name in ("num_epoch", "num_epoch_dict"):
        if training.get(name) is not None:
            raise ConfigError(f"training.{name} with a mix:N batch size is not supported by "
                              "mdloader dp (its epoch would not be a mix:N pass); give "
                              "training.numb_steps instead", path=key)


def full_validation_runs(data: dict) -> bool:
    """Whether DeePMD-kit 3.2 would run a full validation for ``data``: ``full_validation``, or
    ``ema_full_validation`` with ``training.enable_ema``, unless ``full_val_start`` is 1 (its
    ``validate_full_validation_config``)."""
    validating, training = _section(data, "validating"), _section(data, "training")
    wanted = bool(validating.get("full_validation", False)) or (
        bool(validating.get("ema_full_validation", False))
        and bool(training.get("enable_ema", False)))
    return wanted and float(validating.get("full_val_start", 0.0)) != 1.0


def refuse_full_validation(data: dict) -> None:
    """DeePMD-kit 3.2's own refusals of a full validation, in its words, before any set-up: a
    multi-task input, a loss other than ``ener``/``ener_spin``, no ``training.validation_data``,
    ``training.zero_stage`` 2 or more (its ``validate_full_validation_config``, which it runs
    after reading the input; its metric checks stay its own). Under ``mdloader dp`` the full
    validation it accepts is sharded over the ranks
    (:mod:`mdloader.integrations.deepmd.full_validation`)."""
    if not full_validation_runs(data):
        return
    training = _section(data, "training")
    if "model_dict" in _section(data, "model") or "data_dict" in training:
        raise ConfigError("validating.full_validation only supports single-task energy "
                          "training; multi-task training is not supported.")
    loss_type = _section(data, "loss").get("type", "ener")
    if loss_type not in ("ener", "ener_spin"):
        raise ConfigError("validating.full_validation only supports single-task energy or "
                          f"spin-energy training; got loss.type={loss_type!r}.")
    if not training.get("validation_data"):
        raise ConfigError("full validation requires `training.validation_data`. It is only "
                          "supported for single-task energy or spin-energy training.")
    if int(training.get("zero_stage", 0)) >= 2:
        raise ConfigError("validating.full_validation only supports single-task energy "
                          "training with training.zero_stage < 2.")
    batch = _section(training, "validation_data").get("batch_size")
    if isinstance(batch, str) and is_mixed_rule(batch):
        raise ConfigError("a full validation reads the validation systems frame by frame, "
                          "not in mix:N batches: give the validation data a batch size of its "
                          "own (e.g. 1, or 'auto'), or set validating.full_validation to false",
                          path="training.validation_data.batch_size")


def _refuse_balance(section: dict, path: str, multitask: bool, task_draw: str | None) -> None:
    """Balance keys where ``mdloader dp`` cannot act on them, refused in one line."""
    given = [key for key in BALANCE_KEYS if key in section]
    if not given:
        return
    if not path.endswith(".training_data"):
        raise ConfigError("balanced steps apply to training data: move it to training_data "
                          "(docs/sampling.md#balanced-steps)", path=f"{path}.{given[0]}")
    cost = section.get("balance_cost", "atoms")
    if cost != "atoms":
        raise ConfigError(f"mdloader dp balances the atoms of a batch ('atoms'); {cost!r} needs "
                          "the mean neighbours of every system, which mdloader dp does not give "
                          "its sampler", path=f"{path}.balance_cost")
    if not multitask or not section.get("balance_window"):
        return
    if task_draw is None:
        task_draw = str(settings.resolve("task_draw"))
    if task_draw != "same":
        raise ConfigError("balanced steps of a multi-task job need the same task on every rank "
                          f"at each step; set {SAME_TASK_SETTING} (by default each rank draws "
                          "its own task, DeePMD-kit's rule, and a task's steps do not line up "
                          "across the ranks)", path=f"{path}.balance_window")


def take_mdloader_keys(data: dict) -> tuple[dict, dict[str, dict[str, Any]]]:
    """``data`` without the balance keys of its training data sections (a copy; ``data`` is
    left alone), and those keys by the JSON path of their section.

    What ``mdloader dp`` does before DeePMD-kit's strict check, which does not know them; the
    recorded job keeps them, and each section's sampler reads them from there.
    """
    taken: dict[str, dict[str, Any]] = {}
    for path, section in data_sections(data):
        keys = {key: section[key] for key in BALANCE_KEYS if key in section}
        if keys and path.endswith(".training_data"):
            taken[path] = keys
    if not taken:
        return data, taken
    stripped = copy.deepcopy(data)
    for path, section in data_sections(stripped):
        for key in taken.get(path, {}):
            del section[key]
    return stripped, taken


def data_sections(data: dict) -> list[tuple[str, dict]]:
    """(JSON path, section) of every data section of ``data``: ``training.training_data`` and
    ``training.validation_data``, or those of each task of ``training.data_dict``."""
    training = _section(data, "training")
    tasks = _section(training, "data_dict")
    holders = ([(f"training.data_dict.{t}", _section(tasks, t)) for t in tasks] if tasks
               else [("training", training)])
    return [(f"{prefix}.{name}", _section(holder, name)) for prefix, holder in holders
            for name in ("training_data", "validation_data") if name in holder]


def _section(data: Any, key: str) -> dict:
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}
