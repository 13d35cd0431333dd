"""A multi-task ``input.json`` (``model.model_dict``, ``training.data_dict``) read as its tasks.

Each task is one head of the model: its data sections become a single-task
:class:`~mdloader.config.input_json.Config` (checked by the same schema, with the JSON paths of
the multi-task file in its errors), so that every command that reads one ``Config`` reads a
task unchanged. The model section of each task has DeePMD-kit's ``shared_dict`` references
(``"type_map": "type_map_all"``, ``"descriptor": "dpa2_descriptor:1"``) replaced by what they
name, as DeePMD-kit's ``preprocess_shared_params`` does before it builds the model. The job's
task weights follow DeePMD-kit's rule: ``model_prob``, else ``num_epoch_dict`` (in proportion
to each task's batches times its epochs), else the number of systems per task.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mdloader.config.input_json import Config, DataConfig, parse_config
from mdloader.errors import ConfigError
from mdloader.sampling import tasks

__all__ = ["JobConfig", "Task", "is_multitask", "load_job", "parse_multitask", "task_weights",
           "weights_rule"]

#: Keys of ``training`` that belong to the multi-task job, not to any one task.
JOB_TRAINING_KEYS = ("data_dict", "model_prob", "num_epoch_dict")

#: Model items that DeePMD-kit lets a task take from ``model.shared_dict`` by name.
SHARED_ITEMS = ("type_map", "descriptor", "fitting_net")


@dataclass(frozen=True)
class Task:
    """One head: its name, its data as a single-task ``Config``, its resolved model section,
    and which ``shared_dict`` entries it uses (``{"descriptor": "dpa2_descriptor"}``)."""

    name: str
    config: Config
    model: Mapping[str, Any]
    shared: Mapping[str, str]

    @property
    def descriptor(self) -> Mapping[str, Any] | None:
        """The task's descriptor section (``None`` when its model has none)."""
        value = self.model.get("descriptor")
        return value if isinstance(value, Mapping) else None

    def sections(self) -> list[DataConfig]:
        """The task's training and validation data sections, in that order."""
        return [d for d in (self.config.training_data, self.config.validation_data)
                if d is not None]


@dataclass(frozen=True)
class JobConfig:
    """A multi-task job: its tasks in ``model_dict`` order and the job-level weights' inputs."""

    tasks: tuple[Task, ...]
    model_prob: Mapping[str, float] | None = None
    num_epoch_dict: Mapping[str, float] | None = None
    source: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tasks)

    def shared_descriptors(self) -> dict[str, tuple[str, ...]]:
        """Each ``shared_dict`` descriptor (or hybrid item) and the tasks that share it (two
        or more)."""
        users: dict[str, list[str]] = {}
        for task in self.tasks:
            for item, key in task.shared.items():
                if item.split(".", 1)[0] == "descriptor" and task.name not in users.get(key, []):
                    users.setdefault(key, []).append(task.name)
        return {k: tuple(v) for k, v in users.items() if len(v) > 1}

    def weights(self, *, nsystems: Mapping[str, int] | None = None,
                nbatches: Mapping[str, int] | None = None) -> dict[str, float]:
        """The probability of each task per step, by DeePMD-kit's rule (see
        :func:`task_weights`)."""
        return task_weights(self.names, model_prob=self.model_prob,
                            num_epoch_dict=self.num_epoch_dict, nsystems=nsystems,
                            nbatches=nbatches)

    def data_sections(self) -> list[tuple[DataConfig, tuple[str, ...] | None]]:
        """Every data section of every task with the task's type map, each distinct section
        (same systems, patterns, index file and type map) once, in task order."""
        seen: dict[tuple[Any, ...], tuple[DataConfig, tuple[str, ...] | None]] = {}
        for task in self.tasks:
            for data in task.sections():
                key = (data.systems, data.rglob_patterns, data.index_file,
                       task.config.type_map)
                seen.setdefault(key, (data, task.config.type_map))
        return list(seen.values())


def task_weights(names: Sequence[str], *, model_prob: Mapping[str, float] | None = None,
                 num_epoch_dict: Mapping[str, float] | None = None,
                 nsystems: Mapping[str, int] | None = None,
                 nbatches: Mapping[str, int] | None = None) -> dict[str, float]:
    """Normalised task weights by DeePMD-kit's rule (:mod:`mdloader.sampling.tasks`, which the
    task schedule uses too): ``model_prob`` if given; else ``num_epoch_dict`` times each
    task's batches per epoch (``nbatches``); else the systems per task (``nsystems``).

    Raises
    ------
    ConfigError
        A weight missing for a task, negative or not finite, all zero, or the counts the rule
        needs not given.
    """
    if model_prob:
        model_prob = _per_task(names, model_prob, "training.model_prob")
    if not model_prob and num_epoch_dict:
        num_epoch_dict = _per_task(names, num_epoch_dict, "training.num_epoch_dict")
        if nbatches is None:
            raise ConfigError("the batches per epoch of each task are needed",
                              path="training.num_epoch_dict")
        probs, _ = tasks.epoch_steps(names, num_epoch_dict, nbatches)
    else:
        probs = tasks.task_weights(names, model_prob=model_prob or None, nsystems=nsystems)
    return {n: float(p) for n, p in zip(names, probs)}


def _per_task(names: Sequence[str], given: Mapping[str, Any], path: str) -> dict[str, float]:
    missing = [n for n in names if n not in given]
    if missing:
        raise ConfigError(f"no value for task {missing[0]!r} (every task needs one)",
                          path=path)
    unknown = [k for k in given if k not in names]
    if unknown:
        raise ConfigError(f"{unknown[0]!r} is not a task of model.model_dict", path=path)
    try:
        return {n: float(given[n]) for n in names}
    except (TypeError, ValueError):
        raise ConfigError("every value must be a number", path=path) from None


def is_multitask(data: Any) -> bool:
    """Whether a parsed ``input.json`` is a multi-task one (``model.model_dict`` or
    ``training.data_dict``)."""
    if not isinstance(data, dict):
        return False
    model, training = data.get("model"), data.get("training")
    return ((isinstance(model, dict) and "model_dict" in model)
            or (isinstance(training, dict) and "data_dict" in training))


def load_job(path: str | os.PathLike[str], *, mixed: bool = False) -> Config | JobConfig:
    """Read an ``input.json``: a :class:`Config` for a single-task one, a :class:`JobConfig`
    for a multi-task one (``mixed``: ``mix:N`` is read, as ``mdloader dp`` reads it)."""
    from mdloader.config.input_json import load_config, read_input_json

    path = os.fspath(path)
    data = read_input_json(path)
    if not is_multitask(data):
        return load_config(path, mixed=mixed)
    return parse_multitask(data, base_dir=os.path.dirname(os.path.abspath(path)),
                           source=os.path.abspath(path), mixed=mixed)


def parse_multitask(data: Mapping[str, Any], *, base_dir: str = ".",
                    source: str | None = None, mixed: bool = False) -> JobConfig:
    """Check a parsed multi-task ``input.json`` and build its :class:`JobConfig`."""
    model = _dict_at(data, "model")
    training = _dict_at(data, "training")
    model_dict = _dict_at(model, "model_dict", "model")
    data_dict = _dict_at(training, "data_dict", "training")
    if not model_dict:
        raise ConfigError("a multi-task input needs at least one task", path="model.model_dict")
    extra = [k for k in data_dict if k not in model_dict]
    if extra:
        raise ConfigError(f"{extra[0]!r} has data but no model in model.model_dict",
                          path=f"training.data_dict.{extra[0]}")
    shared = model.get("shared_dict", {})
    if not isinstance(shared, dict):
        raise ConfigError("must be a dict", path="model.shared_dict")
    defaults = {k: v for k, v in model.items() if k not in ("model_dict", "shared_dict")}
    for key in ("model_prob", "num_epoch_dict"):
        if training.get(key) and not isinstance(training[key], dict):
            raise ConfigError("must be a dict of task names to numbers",
                              path=f"training.{key}")
    if training.get("model_prob") and training.get("num_epoch_dict"):
        raise ConfigError("model_prob and num_epoch_dict are mutually exclusive; give one",
                          path="training.num_epoch_dict")
    tasks = []
    for name, branch in model_dict.items():
        if not isinstance(branch, dict):
            raise ConfigError("must be a dict", path=f"model.model_dict.{name}")
        if name not in data_dict:
            raise ConfigError("the task has no data", path=f"training.data_dict.{name}")
        resolved, uses = _resolve_shared({**copy.deepcopy(defaults), **branch}, shared, name)
        config = _task_config(data, name, resolved, base_dir, source, mixed)
        tasks.append(Task(name, config, resolved, uses))
    return JobConfig(tuple(tasks), model_prob=training.get("model_prob") or None,
                     num_epoch_dict=training.get("num_epoch_dict") or None, source=source)


def _dict_at(data: Mapping[str, Any], key: str, where: str = "") -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError("must be a dict", path=f"{where}.{key}" if where else key)
    return value


def _resolve_shared(branch: dict, shared: Mapping[str, Any], task: str
                    ) -> tuple[dict, dict[str, str]]:
    """The task's model with each ``shared_dict`` name (``key`` or ``key:level``) replaced by a
    copy of its entry; also which entry each item came from."""
    uses: dict[str, str] = {}

    def lookup(ref: str, path: str) -> tuple[Any, str]:
        key = ref.split(":", 1)[0]
        if key not in shared:
            raise ConfigError(f"names {ref!r}, which model.shared_dict does not hold", path=path)
        return copy.deepcopy(shared[key]), key

    for item in SHARED_ITEMS:
        value = branch.get(item)
        path = f"model.model_dict.{task}.{item}"
        if isinstance(value, str):
            branch[item], uses[item] = lookup(value, path)
        elif isinstance(value, dict) and value.get("type") == "hybrid":
            for i, sub in enumerate(value.get("list", [])):
                if isinstance(sub, str):
                    value["list"][i], uses[f"{item}.list[{i}]"] = lookup(
                        sub, f"{path}.list[{i}]")
    return branch, uses


def _task_config(data: Mapping[str, Any], name: str, model: Mapping[str, Any], base_dir: str,
                 source: str | None, mixed: bool = False) -> Config:
    """The task as a single-task input, checked by the same schema; errors keep the paths of
    the multi-task file."""
    training = {k: v for k, v in data["training"].items() if k not in JOB_TRAINING_KEYS}
    sections = data["training"]["data_dict"][name]
    if not isinstance(sections, dict):
        raise ConfigError("must be a dict", path=f"training.data_dict.{name}")
    training.update(sections)
    single: dict[str, Any] = {k: v for k, v in data.items()
                              if k not in ("model", "training", "loss", "loss_dict")}
    single["model"] = {k: model[k] for k in ("type_map", "data_stat_nbatch") if k in model}
    single["training"] = training
    loss = (data.get("loss_dict") or {}).get(name)
    if isinstance(loss, dict):
        single["loss"] = loss
    try:
        config = parse_config(single, base_dir=base_dir, source=source, mixed=mixed)
    except ConfigError as exc:
        raise ConfigError(exc.message, path=_task_path(exc.path, name)) from None
    prefix = f"training.data_dict.{name}."
    return dataclasses.replace(
        config, training_data=_placed(config.training_data, prefix + "training_data"),
        validation_data=None if config.validation_data is None
        else _placed(config.validation_data, prefix + "validation_data"))


def _placed(data: DataConfig, json_path: str) -> DataConfig:
    """``data`` as it sits at ``json_path`` of the multi-task file."""
    return dataclasses.replace(data, sampling=dataclasses.replace(data.sampling,
                                                                  json_path=json_path))


def _task_path(path: str | None, name: str) -> str | None:
    """A single-task JSON path as it is in the multi-task file."""
    if path is None:
        return None
    for section in ("training.training_data", "training.validation_data"):
        if path == section or path.startswith(section + "."):
            return f"training.data_dict.{name}." + path[len("training."):]
    if path == "loss" or path.startswith("loss."):
        return f"loss_dict.{name}" + path[len("loss"):]
    if path == "model.type_map" or path.startswith("model.type_map"):
        return f"model.model_dict.{name}.type_map"
    if path.startswith("model."):
        return f"model.model_dict.{name}." + path[len("model."):]
    return path


def weights_rule(job: JobConfig) -> str:
    """Which rule gave the weights, in words (for reports)."""
    if job.model_prob:
        return "training.model_prob"
    if job.num_epoch_dict:
        return ("training.num_epoch_dict x batches per epoch ("
                + json.dumps(dict(job.num_epoch_dict)) + ")")
    return "systems per task (no training.model_prob)"
