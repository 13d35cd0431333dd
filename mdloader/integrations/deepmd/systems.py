"""The trainer's training systems under mdloader: found and read only by mdloader's build.

``main``'s ``process_systems`` becomes :func:`defer_discovery` (no rank walks the data tree
before the build), its ``is_lmdb`` :func:`not_lmdb` (an LMDB path is a ``systems`` entry like any
other) and its ``get_data`` :func:`neighbour_stat_data`: data that reads nothing, whose neighbour
statistics (``sel: "auto"``, ``min_nbor_dist``) :func:`mdloader_nbor_stat` computes with
mdloader, in shares over the ranks, with DeePMD-kit's values.

``main``'s ``normalize`` and ``preprocess_shared_params`` are wrapped to record the job
(:class:`JobRecord`): every task's ``systems`` lists, built once for all of them by
:func:`mdloader.loading.job.build_job` when first needed, and the heads that share a
descriptor, whose neighbour statistics are taken over the union of their training systems.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mdloader.errors import ConfigError
from mdloader.integrations.deepmd.seam import MAIN
from mdloader.loading.build import build_systems
from mdloader.loading.job import JobSection, JobSystems, build_job
from mdloader.loading.loader import DpLoaderSet, LazySystemBatches
from mdloader.loading.statistics import neighbour_statistics
from mdloader.sampling.tasks import task_stream_seed


class DeferredSystems(list):
    """The user's ``systems`` entries, not yet discovered, plus the ``rglob_patterns``.

    Returned in place of DeePMD-kit's ``process_systems`` result so that no rank walks the tree
    before the build; :class:`DeepmdDpLoaderSet` hands both to mdloader's rank-0 discovery.
    """

    def __init__(self, entries: Sequence[str], patterns: Sequence[str] | None = None,
                 task: str | None = None, role: str | None = None) -> None:
        super().__init__(entries)
        self.patterns = list(patterns) if patterns else None
        self.task = task
        self.role = role


def defer_discovery(systems: str | Sequence[str],
                    patterns: Sequence[str] | None = None) -> DeferredSystems:
    """Replacement for ``deepmd.utils.data_system.process_systems``: no file-system access.

    The result names the multi-task task whose input section holds ``systems`` (else ``None``).
    """
    task, role = _JOB.task_of_systems(systems), _JOB.role_of_systems(systems)
    if isinstance(systems, str):
        return DeferredSystems([systems], patterns, task, role)
    if isinstance(systems, (list, tuple)):
        return DeferredSystems(list(systems), patterns, task, role)
    raise ConfigError(f"systems must be a path or a list of paths, got {type(systems).__name__}",
                      path="training.training_data.systems")


class LoaderSetBatches(LazySystemBatches):
    """``dataloaders`` that name their loader set: what DeePMD-kit's ``make_stat_input`` is
    handed, so the input statistics find the set it reads from."""

    def __init__(self, owner: DpLoaderSet) -> None:
        super().__init__(owner)
        self.loader_set = owner


class DeepmdDpLoaderSet(DpLoaderSet):
    """mdloader's ``DpLoaderSet`` with DeePMD-kit's positional signature.

    Accepts a :class:`DeferredSystems` (from :func:`defer_discovery`) and forwards its
    ``rglob_patterns``; DeePMD-kit's ``[rank, seed]`` convention is understood by the base class.
    A multi-task task's set folds the task key into the seed
    (:func:`~mdloader.sampling.tasks.task_stream_seed`): a stream per task.
    """

    def __init__(self, systems: Any, batch_size: Any, type_map: Sequence[str] | None,
                 seed: int | Sequence[int] | None = None, shuffle: bool = True,
                 modifier: Any = None) -> None:
        patterns = getattr(systems, "patterns", None)
        task = getattr(systems, "task", None)
        role = getattr(systems, "role", None)
        if task is not None:
            seed = task_seed(seed, task)
        if isinstance(systems, DeferredSystems):
            view = _JOB.datasets(systems, patterns, type_map)
            systems = list(systems) if view is None else view
        super().__init__(systems, batch_size, type_map, seed, shuffle, modifier,
                         rglob_patterns=patterns)
        self.dataloaders = LoaderSetBatches(self)
        if role is not None:
            _JOB.loader_sets[(task, role)] = self


def task_seed(seed: int | Sequence[int] | None, task: str) -> int | list[int] | None:
    """DeePMD-kit's loader-set ``seed`` (an int, or ``[rank, seed]``) with ``task`` folded in."""
    if seed is None:
        return None
    if isinstance(seed, (list, tuple)) and len(seed) == 2:
        return [int(seed[0]), task_stream_seed(int(seed[1]), task)]
    if isinstance(seed, (list, tuple)):
        raise ConfigError(f"a multi-task loader seed must be an int or [rank, seed], got {seed!r}",
                          path="training.seed")
    return task_stream_seed(int(seed), task)


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
            self._datasets = _JOB.datasets(self.systems, self.patterns, self.type_map)
            if self._datasets is None:
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
    dist_module = sys.modules[MAIN].dist
    data = NeighbourStatData(jdata["systems"], jdata.get("rglob_patterns"), type_map,
                             dist_module)
    data.task = _JOB.task_of(jdata)
    return data


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
        own = train_data.datasets()  # creates the process group under torchrun first
        shared = _JOB.sharing_datasets(train_data)
        datasets = shared or own
        # heads sharing a descriptor ask for the same union: one pass for all of them (every
        # rank decides alike, the key is a function of the input)
        key = (id(shared), float(rcut), bool(mixed_type), tuple(type_map or ()))
        if shared is None or key not in _JOB.neighbour_results:
            stats = neighbour_statistics(datasets, rcut, type_map=type_map,
                                         mixed_type=mixed_type)
            found = (min_nbor_dist(stats), tuple(int(n) for n in stats.max_neighbours))
            if shared is None:
                return found[0], np.asarray(found[1], dtype=int)
            _JOB.neighbour_results[key] = (shared, found)  # the list kept: its id stays unique
        found = _JOB.neighbour_results[key][1]
        return found[0], np.asarray(found[1], dtype=int)

    return get_nbor_stat


class JobRecord:
    """The job ``main.train`` runs: its ``systems`` sections (from the normalized input) and
    which tasks share a descriptor (from ``preprocess_shared_params``), built once when first
    needed, by every rank at the same point (the first statistics or loader set)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.sections: list[JobSection] = []
        self.tasks_of_data: dict[int, str | None] = {}
        self.shared: dict[str, tuple[str, ...]] = {}
        self.section_of_task: dict[str | None, JobSection] = {}
        self.task_of_list: dict[int, str | None] = {}
        self.role_of_list: dict[int, str | None] = {}
        self.loader_sets: dict[tuple[str | None, str], DpLoaderSet] = {}
        self.config: Any = None
        self.unions: dict[tuple[str, ...], list[Any]] = {}
        self.neighbour_results: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.built: JobSystems | None = None

    def record_links(self, shared_links: Any) -> None:
        """The tasks whose descriptors are one (``shared_links`` of type descriptor)."""
        self.shared = {}
        for item in (shared_links or {}).values():
            tasks = tuple(link["model_key"] for link in item["links"]
                          if str(link.get("shared_type", "")).startswith("descriptor")
                          and link.get("shared_level", 0) == 0)  # whole descriptor shared
            for task in tasks:
                self.shared[task] = tasks

    def record_config(self, config: Any) -> None:
        """Every ``systems`` list of the normalized input; no I/O."""
        self.sections, self.tasks_of_data, self.section_of_task = [], {}, {}
        self.task_of_list, self.role_of_list, self.loader_sets = {}, {}, {}
        self.config = config
        self.unions, self.neighbour_results = {}, {}
        self.built = None
        model, training = config.get("model", {}), config.get("training", {})
        if "model_dict" in model:
            tasks = [(t, model["model_dict"][t], training["data_dict"][t],
                      f"training.data_dict.{t}") for t in model["model_dict"]]
        else:
            self.shared = {}
            tasks = [(None, model, training, "training")]
        for task, params, data, path in tasks:
            for role in ("training", "validation"):
                part = data.get(f"{role}_data")
                if not part or not part.get("systems"):
                    continue
                section = JobSection.of(task, role, part["systems"], part.get("rglob_patterns"),
                                        params.get("type_map"),
                                        key=f"{path}.{role}_data.systems")
                self.sections.append(section)
                owner_role = self.role_of_list.setdefault(id(part["systems"]), role)
                if owner_role != role:  # one object for two roles: no role of its own
                    self.role_of_list[id(part["systems"])] = None
                if task is not None:  # one object held by two tasks: no task of its own
                    owner = self.task_of_list.setdefault(id(part["systems"]), task)
                    if owner != task:
                        self.task_of_list[id(part["systems"])] = None
                if role == "training":
                    self.tasks_of_data[id(part)] = task
                    self.section_of_task[task] = section

    def task_of(self, jdata: Any) -> str | None:
        return self.tasks_of_data.get(id(jdata))

    def task_of_systems(self, systems: Any) -> str | None:
        """The multi-task task whose input section holds this ``systems`` object."""
        return self.task_of_list.get(id(systems))

    def role_of_systems(self, systems: Any) -> str | None:
        """``"training"`` or ``"validation"``: the role of this ``systems`` object."""
        return self.role_of_list.get(id(systems))

    def training_set(self, task: str | None) -> DpLoaderSet | None:
        """The training ``DpLoaderSet`` built for ``task`` (``None`` single-task), if any."""
        return self.loader_sets.get((task, "training"))

    def task_settings(self, task: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model section and the training data section of ``task`` in the recorded input
        (``({}, {})`` when none was recorded)."""
        config = self.config or {}
        model, training = config.get("model", {}), config.get("training", {})
        if task is not None:
            model = model.get("model_dict", {}).get(task, {})
            training = training.get("data_dict", {}).get(task, {})
        return model, training.get("training_data", {}) or {}

    def datasets(self, systems: Any, patterns: Any, type_map: Any) -> Any:
        """The job's datasets for these values (the job built on first use), else ``None``."""
        if not self.sections:
            return None
        entries = systems if isinstance(systems, str) else list(systems)  # a path is one entry
        probe = JobSection.of(None, "", entries, patterns, type_map)
        if all(s.request != probe.request for s in self.sections):
            return None
        if self.built is None:
            self.built = build_job(self.sections)
        return self.built.find(entries, patterns, type_map)

    def sharing_datasets(self, data: NeighbourStatData) -> list[Any] | None:
        """The union of the training systems of every task sharing ``data``'s descriptor (one
        list per group of tasks), or ``None`` when its descriptor is its own."""
        task = getattr(data, "task", None)
        group = self.shared.get(task) if task is not None else None
        if not group or len(group) < 2:
            return None
        if group in self.unions:
            return self.unions[group]
        union: list[Any] = []
        seen: set[int] = set()
        for member in group:
            section = self.section_of_task.get(member)
            if section is None or section.type_map != self.section_of_task[task].type_map:
                return None  # different type maps: per-task statistics, as DeePMD-kit
            view = self.datasets(list(section.systems), section.rglob_patterns,
                                 section.type_map)
            if view is None or id(view) in seen:
                continue
            seen.add(id(view))
            union.extend(view)
        self.unions[group] = union
        return union


_JOB = JobRecord()


def forget_job() -> None:
    """Drop the recorded job (its sections and built systems): a later set builds its own."""
    _JOB.clear()


def recording_normalize(original: Callable[..., Any]) -> Callable[..., Any]:
    """``main.normalize``: DeePMD-kit's, then the job's sections are recorded for one build."""

    def normalize(data: Any, *args: Any, **kwargs: Any) -> Any:
        config = original(data, *args, **kwargs)
        _JOB.record_config(config)
        return config

    return normalize


def recording_shared_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """``main.preprocess_shared_params``: DeePMD-kit's, then the shared descriptors noted."""

    def preprocess_shared_params(model_config: Any, *args: Any, **kwargs: Any) -> Any:
        model, links = original(model_config, *args, **kwargs)
        _JOB.record_links(links)
        return model, links

    return preprocess_shared_params


def planned_task_input(task: str | None) -> tuple[DpLoaderSet, int, float] | None:
    """What ``task``'s statistics initialization will pass, read from the recorded job: its
    training ``DpLoaderSet``, ``data_stat_nbatch`` and ``min_pair_dist`` (``None``: unknown)."""
    data = _JOB.training_set(task)
    if data is None:
        return None
    model, training_data = _JOB.task_settings(task)
    return (data, model.get("data_stat_nbatch", 10),
            float(training_data.get("min_pair_dist", 0.0)))
