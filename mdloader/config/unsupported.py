"""What an ``input.json`` may ask for that mdloader does not serve, refused in one line each.

DeePMD-kit's ``examples/`` hold inputs for its other backends and modes. Rather than failing
later on a symptom (an unknown batch rule, a type id beyond the type map, a folder without
systems), each is refused before anything is read, naming the feature and its JSON path.
"""

from __future__ import annotations

from typing import Any

from mdloader.errors import ConfigError
from mdloader.loading.mixed_stream import mixed_database
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
MDLOADER_DATA_KEYS = ("index_file", "balance_window", "balance_cost")


def refuse_under_deepmd(data: dict) -> None:
    """Raise one ConfigError naming the first key of ``data`` that ``mdloader dp`` would not act
    on: DeePMD-kit's ``validating.full_validation`` (it reads every system whole on rank 0
    through DeePMD-kit's own reader), a key only ``mdloader train`` reads
    (:data:`MDLOADER_DATA_KEYS`), or a batch-size rule mdloader does not serve (``mix:N`` on
    anything but one LMDB database, the TensorFlow-only ``mixed:N``, an unknown or malformed
    rule), in any data section of any task.

    The one place of these rules: ``mdloader dp`` calls it before any set-up, and
    ``mdloader check --for dp`` calls it, so both give the same line.
    """
    validating = _section(data, "validating")
    if validating.get("full_validation"):
        raise ConfigError("DeePMD-kit's full validation is not supported under mdloader dp (it "
                          "reads each system whole on rank 0 through DeePMD-kit's own reader); "
                          "set it to false, or use mdloader train --full-validation: every "
                          "validation frame once, sharded over the ranks",
                          path="validating.full_validation")
    for path, section in data_sections(data):
        for key in MDLOADER_DATA_KEYS:
            if key in section:
                raise ConfigError(f"read by mdloader train only: mdloader dp runs "
                                  f"DeePMD-kit's trainer, which does not know {key}; "
                                  "remove it (docs/migrating.md)", path=f"{path}.{key}")
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
