"""Read a DeePMD-kit ``input.json`` into a small frozen configuration.

The file goes through the dargs schema of :mod:`mdloader.config.argcheck` (aliases, defaults, types,
value rules), then into frozen dataclasses with relative system paths resolved against the
folder of the JSON file, as ``dp`` resolves them when run from that folder. Every problem is
one :class:`~mdloader.errors.ConfigError` whose ``path`` is the dotted JSON path of the key
(``training.training_data.batch_size``), whatever dargs called it.

As in DeePMD-kit, every key starting with ``_`` (``_comment``, ...) is dropped before checking.
A multi-task input is read per task by :mod:`mdloader.config.multitask`; here (one
``Config``) it is refused, as are TensorFlow-only spin models and batch rules, by
:func:`~mdloader.config.unsupported.refuse_unsupported` with one line naming the feature and
its JSON path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dargs import Argument
from dargs.dargs import ArgumentError, ArgumentKeyError, ArgumentTypeError, ArgumentValueError

from mdloader.config.argcheck import input_schema, schema_markdown
from mdloader.config.unsupported import refuse_unsupported
from mdloader.data.formats.lmdb.address import mixed_database
from mdloader.errors import ConfigError
from mdloader.sampling.batching import parse_rule
from mdloader.sampling.mixed import check_mixed_rule, is_mixed_rule
from mdloader.sampling.probability import check_style
from mdloader.sampling.spec import SamplingSpec

if TYPE_CHECKING:
    from mdloader.loading.feed import StreamSpec

__all__ = ["Config", "DataConfig", "LearningRateConfig", "LossConfig", "load_config",
           "parse_config", "read_input_json", "sampling_spec", "schema_markdown"]

_KEY_RE = re.compile(r"key `([^`]+)`")


@dataclass(frozen=True)
class DataConfig:
    """One of ``training.training_data`` / ``training.validation_data``, normalised: where its
    systems are, how it samples (one :class:`~mdloader.sampling.spec.SamplingSpec`), and how
    many batches a display validates."""

    systems: tuple[str, ...]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    rglob_patterns: tuple[str, ...] | None = None
    numb_btch: int = 1
    index_file: str | None = None

    @property
    def json_path(self) -> str:
        """Where the section sits in ``input.json``."""
        return self.sampling.json_path or "training.training_data"

    def stream(self, role: str, type_map: Sequence[str] | None, *,
               seed_offset: int = 0) -> StreamSpec:
        """The stream a feed builds from this section in ``role`` (``training``,
        ``validation``) under the job seed plus ``seed_offset``."""
        from mdloader.loading.build import Section  # torch: when a job is built, not parsed
        from mdloader.loading.feed import StreamSpec

        section = Section.of(None, role, self.systems, self.rglob_patterns, type_map,
                             index_file=self.index_file, key=f"{self.json_path}.systems")
        return StreamSpec(section, self.sampling, seed_offset=seed_offset)


@dataclass(frozen=True)
class LearningRateConfig:
    """DeePMD-kit's exponential decay: ``start_lr * rate ** (step // decay_steps)``."""

    type: str = "exp"
    start_lr: float = 1e-3
    stop_lr: float = 1e-8
    decay_steps: int = 5000


@dataclass(frozen=True)
class LossConfig:
    """Energy/force prefactors, interpolated with ``lr / start_lr`` as DeePMD-kit does."""

    type: str = "ener"
    start_pref_e: float = 0.02
    limit_pref_e: float = 1.0
    start_pref_f: float = 1000.0
    limit_pref_f: float = 1.0


@dataclass(frozen=True)
class Config:
    """What mdloader takes from an ``input.json``; ``source`` is the file it came from."""

    training_data: DataConfig
    validation_data: DataConfig | None = None
    type_map: tuple[str, ...] | None = None
    seed: int | None = None
    numb_steps: int | None = None
    numb_epoch: float | None = None
    disp_freq: int = 1000
    save_freq: int = 1000
    disp_file: str = "lcurve.out"
    save_ckpt: str = "model.ckpt"
    learning_rate: LearningRateConfig = field(default_factory=LearningRateConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data_stat_nbatch: int = 10
    source: str | None = None


def load_config(path: str | os.PathLike[str], *, mixed: bool = False) -> Config:
    """Read, check and normalise ``input.json``; relative systems resolve against its folder
    (``mixed``: as :func:`parse_config`)."""
    path = os.fspath(path)
    data = read_input_json(path)
    base = os.path.dirname(os.path.abspath(path))
    return parse_config(data, base_dir=base, source=os.path.abspath(path), mixed=mixed)


def read_input_json(path: str) -> Any:
    """The parsed JSON of ``path``; a ConfigError naming the file when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the input file {path}: {exc.strerror}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from exc


def parse_config(data: Any, *, base_dir: str = ".", source: str | None = None,
                 mixed: bool = False) -> Config:
    """Check a parsed ``input.json`` (a dict) and build the frozen :class:`Config`; ``mixed``:
    a ``mix:N`` batch size is read (``mdloader dp`` serves it), else refused."""
    if not isinstance(data, dict):
        raise ConfigError(f"the input must be a JSON object, found {type(data).__name__}")
    refuse_unsupported(data)
    schema = input_schema()
    _reject_alias_clashes(schema, data, "")
    normed = _run_dargs(schema, data)
    return _frozen_config(normed, base_dir=base_dir, source=source, mixed=mixed)


def _run_dargs(schema: Argument, data: dict) -> dict:
    """Drop ``_*`` keys, normalise, then check strictly, as ``dp`` does: an unknown key in a
    section mdloader reads is an error (DeePMD-kit's own keys are declared in the schema)."""
    try:
        normed = schema.normalize_value(data, trim_pattern="_*")
    except ArgumentError as exc:
        raise _to_config_error(exc, data, None) from exc
    try:
        schema.check_value(normed, strict=True)
    except ArgumentError as exc:
        raise _to_config_error(exc, normed, None) from exc
    return normed


def _lookup(data: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        if not isinstance(data, dict) or name not in data:
            return None
        data = data[name]
    return data


def _to_config_error(exc: ArgumentError, data: dict, prefix: str | None) -> ConfigError:
    """Turn a dargs error into a ConfigError with a dotted path and a plain message."""
    parts = [p for p in exc.path.split("/") if p]
    if prefix:
        parts = prefix.split(".") + parts
    match = _KEY_RE.search(exc.message or "")
    key = match.group(1) if match else None
    path = ".".join(parts + ([key] if key else [])) or None
    if isinstance(exc, ArgumentKeyError):
        if "strict mode" in (exc.message or ""):
            hint = (exc.message or "").split("strict mode.", 1)[-1].strip()
            hint = hint.replace("Did you mean", "did you mean")
            return ConfigError(f"unknown key{(' (' + hint + ')') if hint else ''}", path=path)
        return ConfigError("required key is missing", path=path)
    value = _lookup(data, path) if path else None
    if isinstance(exc, ArgumentTypeError):
        expected = re.search(r"requires <([^>]*)>", exc.message or "")
        # dargs keeps the types in a set: sort them so that the message is stable.
        want = (" | ".join(sorted(t.replace("NoneType", "null")
                                  for t in expected.group(1).split("|")))
                if expected else "another type")
        return ConfigError(f"wrong type: expected {want}, found "
                           f"{type(value).__name__} {_short(value)}", path=path)
    if isinstance(exc, ArgumentValueError):
        want = (exc.message or "").split("extra checking.", 1)[-1].strip()
        return ConfigError(f"bad value {_short(value)}: expected {want}", path=path)
    return ConfigError(exc.message or str(exc), path=path)


def _short(value: Any) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _reject_alias_clashes(arg: Argument, data: Any, prefix: str) -> None:
    """``numb_steps`` and ``stop_batch`` both given: dargs would silently keep one."""
    if not isinstance(data, dict):
        return
    for sub in arg.sub_fields.values():
        path = f"{prefix}.{sub.name}" if prefix else sub.name
        given = [n for n in (sub.name, *sub.alias) if n in data]
        if len(given) > 1:
            raise ConfigError(f"given more than once, as {' and '.join(given)}", path=path)
        if given:
            _reject_alias_clashes(sub, data[given[0]], path)


def _resolve_system(entry: str, base_dir: str) -> str:
    """Make one system path absolute; ``file.h5#/grp`` keeps its in-file part untouched."""
    head, sep, tail = entry.partition("#")
    head = os.path.expanduser(head)
    if not os.path.isabs(head):
        head = os.path.join(base_dir, head)
    return os.path.normpath(head) + sep + tail


def sampling_spec(raw: Mapping[str, Any], json_path: str, *,
                  mixed: bool = False) -> SamplingSpec:
    """The sampling keys of a data section of ``input.json`` (``raw``, at ``json_path``) as one
    :class:`~mdloader.sampling.spec.SamplingSpec`, its rules checked; ``mixed``: ``mix:N`` is
    served (``mdloader dp``'s feed reads it from an LMDB database), else it is refused."""
    batch = raw.get("batch_size", "auto")
    if isinstance(batch, str) and mixed and is_mixed_rule(batch):
        check_mixed_rule(batch, f"{json_path}.batch_size")
    elif isinstance(batch, str):
        parse_rule(batch, key=f"{json_path}.batch_size")
    style = raw.get("auto_prob", "prob_sys_size")
    check_style(style, key=f"{json_path}.auto_prob")
    probs = raw.get("sys_probs")
    return SamplingSpec(
        batch_size=tuple(batch) if isinstance(batch, list) else batch, auto_prob=style,
        sys_probs=tuple(float(p) for p in probs) if probs is not None else None,
        balance_window=int(raw.get("balance_window", 0)),
        balance_cost=raw.get("balance_cost", "atoms"), json_path=json_path)


def _data_config(raw: Mapping[str, Any], base_dir: str, json_path: str,
                 mixed: bool = False) -> DataConfig:
    systems = raw["systems"]
    entries = [systems] if isinstance(systems, str) else list(systems)
    patterns = raw.get("rglob_patterns")
    index = raw.get("index_file")
    resolved = tuple(_resolve_system(s, base_dir) for s in entries)
    batch = raw.get("batch_size")
    if mixed and isinstance(batch, str) and is_mixed_rule(batch):  # one LMDB database only
        mixed_database(resolved, f"{json_path}.batch_size")
    return DataConfig(
        systems=resolved,
        sampling=sampling_spec(raw, json_path, mixed=mixed),
        rglob_patterns=tuple(patterns) if patterns is not None else None,
        numb_btch=int(raw.get("numb_btch", 1)),
        index_file=(os.path.normpath(os.path.join(base_dir, os.path.expanduser(index)))
                    if index is not None else None),
    )


def _sub_config(cls: type, raw: Mapping[str, Any]) -> Any:
    # dargs does not fill the sub-defaults of a section that was absent ({} default).
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{k: raw[k] for k in names if k in raw})


def _frozen_config(normed: dict, *, base_dir: str, source: str | None,
                   mixed: bool = False) -> Config:
    training = normed["training"]
    if training.get("numb_steps") is not None and training.get("numb_epoch") is not None:
        raise ConfigError("numb_steps and numb_epoch are mutually exclusive; give one",
                          path="training.numb_steps")
    valid = training.get("validation_data")
    model = normed.get("model", {})
    type_map = model.get("type_map")
    lr = normed.get("learning_rate", {})
    loss = normed.get("loss", {})
    return Config(
        training_data=_data_config(training["training_data"], base_dir,
                                   "training.training_data", mixed),
        validation_data=(_data_config(valid, base_dir, "training.validation_data", mixed)
                         if valid is not None else None),
        type_map=tuple(type_map) if type_map is not None else None,
        seed=training.get("seed"),
        numb_steps=training.get("numb_steps"),
        numb_epoch=training.get("numb_epoch"),
        disp_freq=training["disp_freq"],
        save_freq=training["save_freq"],
        disp_file=training["disp_file"],
        save_ckpt=training["save_ckpt"],
        learning_rate=_sub_config(LearningRateConfig, lr),
        loss=_sub_config(LossConfig, loss),
        data_stat_nbatch=model.get("data_stat_nbatch", 10),
        source=source,
    )
