"""What an ``input.json`` may ask for that mdloader does not serve, refused in one line each.

DeePMD-kit's ``examples/`` hold inputs for its other backends and modes. Rather than failing
later on a symptom (an unknown batch rule, a type id beyond the type map, a folder without
systems), each is refused before anything is read, naming the feature and its JSON path.
"""

from __future__ import annotations

from typing import Any

from mdloader.errors import ConfigError

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
        section = _section(training, name)
        batch = section.get("batch_size")
        if isinstance(batch, str) and batch.strip().startswith("mixed"):
            raise ConfigError(f"the batch-size rule {batch!r} is TensorFlow-only (DeePMD-kit's "
                              "PyTorch backend refuses it too)",
                              path=f"training.{name}.batch_size")


def _section(data: Any, key: str) -> dict:
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}
