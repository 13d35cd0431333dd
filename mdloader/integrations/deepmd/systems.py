"""The trainer's systems under mdloader: found and read only by mdloader's one build.

``main``'s ``normalize`` is wrapped to record the job (:class:`DeepmdJob`): every ``systems``
value of the normalized input is replaced by a copy that knows its place (its task and role,
:class:`Place`), so that what DeePMD-kit later builds from it is recognised without keeping
track of objects; every section is built by one :func:`mdloader.loading.build.build_job` when
first needed. ``preprocess_shared_params`` is wrapped to note the heads that share a descriptor,
whose neighbour statistics are taken over the union of their training systems.

``main``'s ``process_systems`` becomes :func:`defer_discovery` (no rank walks the data tree
before the build), its ``DpLoaderSet`` :class:`DeepmdDpLoaderSet` (a view of the job's build;
a task's streams fold the task key into the seed), its ``is_lmdb`` :func:`not_lmdb` (an LMDB
path is a ``systems`` entry like any other) and its ``get_data`` :func:`neighbour_stat_data`:
data that reads nothing, whose neighbour statistics (``sel: "auto"``, ``min_nbor_dist``)
:func:`mdloader_nbor_stat` computes with mdloader, in shares over the ranks, with DeePMD-kit's
values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mdloader.config.input_json import sampling_spec
from mdloader.config.unsupported import take_mdloader_keys
from mdloader.data.formats.lmdb.address import mixed_database
from mdloader.distributed.group import current_world
from mdloader.errors import ConfigError
from mdloader.integrations.deepmd import seam
from mdloader.loading.build import JobSystems, Section, build_job, build_systems
from mdloader.loading.loader import (
    DpLoaderSet,
    LazySystemBatches,
    agree_seed,
    get_sampler_from_params,
)
from mdloader.loading.mixed_stream import MixedLmdbBatches
from mdloader.loading.statistics import neighbour_statistics
from mdloader.loading.system_list import SystemDatasets
from mdloader.sampling.mixed import check_mixed_rule, is_mixed_rule
from mdloader.sampling.order import AgreedSeed, normalize_seed
from mdloader.sampling.spec import SamplingSpec
from mdloader.sampling.tasks import task_stream_seed


@dataclass(frozen=True)
class Place:
    """Where a ``systems`` value sits in the input: its task (``None`` single-task) and role."""

    task: str | None
    role: str


class PlacedSystems(list):
    """A ``systems`` list of the normalized input that knows its :class:`Place`."""

    def __init__(self, entries: Sequence[str], place: Place) -> None:
        super().__init__(entries)
        self.place = place


class PlacedPath(str):
    """A ``systems`` path (a single entry) of the normalized input that knows its
    :class:`Place`."""

    place: Place

    def __new__(cls, path: str, place: Place) -> PlacedPath:
        made = super().__new__(cls, path)
        made.place = place
        return made


def place_of(systems: Any) -> Place | None:
    """The place of a ``systems`` value recorded by :class:`DeepmdJob`, else ``None``."""
    return getattr(systems, "place", None)


class DeferredSystems(list):
    """The user's ``systems`` entries, not yet discovered, plus the ``rglob_patterns`` and
    their place in the input (``None``: not a recorded job's).

    Returned in place of DeePMD-kit's ``process_systems`` result so that no rank walks the tree
    before the build; :class:`DeepmdDpLoaderSet` takes the job's build of them.
    """

    def __init__(self, entries: Sequence[str], patterns: Sequence[str] | None = None,
                 place: Place | None = None) -> None:
        super().__init__(entries)
        self.patterns = list(patterns) if patterns else None
        self.place = place


def defer_discovery(systems: str | Sequence[str],
                    patterns: Sequence[str] | None = None) -> DeferredSystems:
    """Replacement for ``deepmd.utils.data_system.process_systems``: no file-system access."""
    if isinstance(systems, str):
        return DeferredSystems([str(systems)], patterns, place_of(systems))
    if isinstance(systems, (list, tuple)):
        return DeferredSystems(list(systems), patterns, place_of(systems))
    raise ConfigError(f"systems must be a path or a list of paths, got {type(systems).__name__}",
                      path="training.training_data.systems")


class DeepmdJob:
    """The job ``main.train`` runs, recorded from its normalized input (no I/O): its sections,
    the heads sharing a descriptor, the job seed, and what is computed once for all tasks.

    Parameters
    ----------
    config
        The normalized input; its ``systems`` values are replaced by placed copies.
    shared
        For each task whose descriptor is shared whole, the tasks sharing it.
    mdloader_keys
        The keys mdloader took out of the input before DeePMD-kit's strict check (balanced
        steps), by the JSON path of their data section
        (:func:`~mdloader.config.unsupported.take_mdloader_keys`).
    """

    def __init__(self, config: dict[str, Any], shared: Mapping[str, tuple[str, ...]],
                 mdloader_keys: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.config = config
        self.shared = dict(shared)
        self.mdloader_keys = {path: dict(keys) for path, keys in (mdloader_keys or {}).items()}
        self.sections: dict[Place, Section] = {}
        self.data: dict[Place, dict[str, Any]] = {}
        model, training = config.get("model", {}), config.get("training", {})
        if "model_dict" in model:
            tasks = [(t, model["model_dict"][t], training["data_dict"][t],
                      f"training.data_dict.{t}") for t in model["model_dict"]]
        else:
            tasks = [(None, model, training, "training")]
        for task, params, data, path in tasks:
            for role in ("training", "validation"):
                part = data.get(f"{role}_data")
                if not part or not part.get("systems"):
                    continue
                place = Place(task, role)
                systems = part["systems"]
                part["systems"] = (PlacedPath(systems, place) if isinstance(systems, str)
                                   else PlacedSystems(systems, place))
                self.data[place] = part
                self.sections[place] = Section.of(
                    task, role, systems, part.get("rglob_patterns"), params.get("type_map"),
                    key=f"{path}.{role}_data.systems")
        self.seed = normalize_seed(training.get("seed"))
        """The job seed given by ``training.seed`` (``None``: drawn when first needed)."""
        self.built: JobSystems | None = None
        self.loader_sets: dict[Place, DpLoaderSet] = {}
        self.unions: dict[tuple[str, ...], list[Any]] = {}
        self.neighbour_results: dict[tuple[Any, ...], tuple[float, tuple[int, ...]]] = {}
        self.input_statistics: list[tuple[Any, Any]] | None = None
        self._agreed: AgreedSeed | None = None

    def job_seed(self) -> AgreedSeed:
        """The job seed every rank holds (a collective the first time, when it was not given):
        the task schedule's, and every stream's when ``training.seed`` is unset."""
        if self._agreed is None:
            self._agreed = agree_seed(self.seed, current_world())
        return self._agreed

    def datasets(self, place: Place) -> SystemDatasets:
        """The datasets of the section at ``place`` (the whole job built on first use)."""
        if self.built is None:
            self.built = build_job(list(self.sections.values()))
        return self.built.view(self.sections[place])

    def stream_seed(self, place: Place, seed: Any) -> AgreedSeed:
        """The seed of the streams at ``place``: DeePMD-kit's ``seed`` argument (else the job
        seed) with the task folded in."""
        given = normalize_seed(seed, current_world().rank)
        agreed = self.job_seed() if given is None else AgreedSeed(given, True)
        if place.task is None:
            return agreed
        return AgreedSeed(task_stream_seed(agreed.value, place.task), agreed.given)

    def sampling(self, place: Place, shuffle: bool) -> SamplingSpec:
        """How the section at ``place`` samples, read from the input (``shuffle``:
        DeePMD-kit's argument)."""
        path = self.sections[place].key.rsplit(".", 1)[0]
        spec = sampling_spec({**self.data[place], **self.mdloader_keys.get(path, {})}, path,
                             mixed=True)
        return dataclasses.replace(spec, shuffle=bool(shuffle))

    def training_set(self, task: str | None) -> DpLoaderSet | None:
        """The training ``DpLoaderSet`` built for ``task`` (``None`` single-task), if any."""
        return self.loader_sets.get(Place(task, "training"))

    def task_settings(self, task: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model section and the training data section of ``task``."""
        model, training = self.config.get("model", {}), self.config.get("training", {})
        if task is not None:
            model = model.get("model_dict", {}).get(task, {})
            training = training.get("data_dict", {}).get(task, {})
        return model, training.get("training_data", {}) or {}

    def sharing_datasets(self, task: str | None) -> list[Any] | None:
        """The union of the training systems of every task sharing ``task``'s descriptor (one
        list per group of tasks), or ``None`` when its descriptor is its own."""
        group = self.shared.get(task) if task is not None else None
        if not group or len(group) < 2:
            return None
        if group in self.unions:
            return self.unions[group]
        union: list[Any] = []
        seen: set[int] = set()
        mine = self.sections.get(Place(task, "training"))
        for member in group:
            section = self.sections.get(Place(member, "training"))
            if section is None or mine is None or section.type_map != mine.type_map:
                return None  # different type maps: per-task statistics, as DeePMD-kit
            view = self.datasets(Place(member, "training"))
            if id(view) in seen:  # sections with equal requests share one list
                continue
            seen.add(id(view))
            union.extend(view)
        self.unions[group] = union
        return union


_JOB: DeepmdJob | None = None
_SHARED: dict[str, tuple[str, ...]] = {}


def current_job() -> DeepmdJob | None:
    """The job the last ``main.normalize`` recorded (``None``: DeePMD-kit's API used directly,
    each loader set builds its own systems)."""
    return _JOB


def forget_job() -> None:
    """Drop the recorded job: a later loader set builds its own systems."""
    global _JOB
    _JOB = None
    _SHARED.clear()


def recording_normalize(original: Callable[..., Any]) -> Callable[..., Any]:
    """``main.normalize``: DeePMD-kit's on the input without the keys only mdloader reads
    (balanced steps, which DeePMD-kit's strict check does not know), then the job recorded for
    one build, with those keys."""

    def normalize(data: Any, *args: Any, **kwargs: Any) -> Any:
        global _JOB
        stripped, taken = take_mdloader_keys(data) if isinstance(data, dict) else (data, {})
        config = original(stripped, *args, **kwargs)
        _JOB = DeepmdJob(config, _SHARED, taken)
        return config

    return normalize


def recording_shared_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """``main.preprocess_shared_params``: DeePMD-kit's, then the heads whose descriptor is
    shared whole (``shared_level`` 0) noted for the job ``normalize`` records next."""

    def preprocess_shared_params(model_config: Any, *args: Any, **kwargs: Any) -> Any:
        model, links = original(model_config, *args, **kwargs)
        _SHARED.clear()
        for item in (links or {}).values():
            tasks = tuple(link["model_key"] for link in item["links"]
                          if str(link.get("shared_type", "")).startswith("descriptor")
                          and link.get("shared_level", 0) == 0)
            for task in tasks:
                _SHARED[task] = tasks
        return model, links

    return preprocess_shared_params


class LoaderSetBatches(LazySystemBatches):
    """``dataloaders`` that name their loader set: what DeePMD-kit's ``make_stat_input`` is
    handed, so the input statistics find the set it reads from."""

    def __init__(self, owner: DpLoaderSet) -> None:
        super().__init__(owner)
        self.loader_set = owner


class DeepmdDpLoaderSet(DpLoaderSet):
    """mdloader's ``DpLoaderSet`` with DeePMD-kit's positional signature.

    A :class:`DeferredSystems` of a recorded job makes the loader set of its place over the
    job's one build (a multi-task task's streams fold the task key into the seed,
    :func:`~mdloader.sampling.tasks.task_stream_seed`); any other value builds its own systems
    (with the ``rglob_patterns`` it carries). DeePMD-kit's ``[rank, seed]`` convention is
    understood by the base class.

    Under ``mix:N`` (one LMDB database) the trainer's batches come from :attr:`mixed`
    (:class:`~mdloader.loading.mixed_stream.MixedLmdbBatches`, its sampler from
    :func:`deepmd_sampler_from_params`); the loader set's own systems, one per LMDB group,
    serve the statistics with ``max:N``'s batch sizes, DeePMD-kit's per-atom-count sizes
    under ``mix:N``.
    """

    def __init__(self, systems: Any, batch_size: Any, type_map: Sequence[str] | None,
                 seed: Any = None, shuffle: bool = True, modifier: Any = None) -> None:
        job, place = current_job(), place_of(systems)
        self.mixed: MixedLmdbBatches | None = None
        if job is not None and place in job.sections:
            if modifier is not None:
                raise ConfigError("data modifiers are not supported by mdloader",
                                  path="model.modifier")
            spec = job.sampling(place, shuffle)
            mixed = is_mixed_rule(spec.batch_size)
            if mixed:
                key = spec.key("batch_size")
                database = mixed_database(job.sections[place].systems, key)
                rule = check_mixed_rule(str(spec.batch_size), key)
                spec = dataclasses.replace(spec, batch_size=f"max:{rule.value}")
                batch_size = spec.batch_size
            super().__init__(job.datasets(place), batch_size, type_map,
                             job.stream_seed(place, seed), shuffle, spec=spec)
            if mixed:
                self.mixed = MixedLmdbBatches(database, type_map, str(rule))
            job.loader_sets[place] = self
        else:
            if is_mixed_rule(batch_size):
                raise ConfigError("mix:N is read from the input of a run of mdloader dp; "
                                  "outside one, use mdloader.LmdbDataset", path="batch_size")
            super().__init__(list(systems) if isinstance(systems, DeferredSystems) else systems,
                             batch_size, type_map, seed, shuffle, modifier,
                             rglob_patterns=getattr(systems, "patterns", None))
        self.dataloaders = LoaderSetBatches(self)

    def add_data_requirement(self, data_requirement: Sequence[Any]) -> None:
        super().add_data_requirement(data_requirement)
        if self.mixed is not None:
            self.mixed.add_data_requirement(data_requirement)


def deepmd_sampler_from_params(data: Any, params: Mapping[str, Any], **kwargs: Any) -> Any:
    """DeePMD-kit's ``get_sampler_from_params``: a ``mix:N`` loader set's key source
    (:class:`~mdloader.sampling.mixed.MixedBatchSampler`, pass ``e`` drawn from the stream
    seed plus ``e`` as DeePMD-kit's LMDB sampler draws it), else mdloader's stateful sampler."""
    mixed = getattr(data, "mixed", None)
    if mixed is not None:
        sampler = mixed.sampler(seed=data.seed, world=data.world, shuffle=data.plan.spec.shuffle)
        # what DeePMD-kit's summary prints per system (LMDB group): its share of the frames
        sampler.weights = torch.tensor(data.probabilities("prob_sys_size"), device="cpu")
        return sampler
    return get_sampler_from_params(data, params, **kwargs)


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
        self.place = place_of(systems)
        self.patterns = list(patterns) if patterns else None
        self.type_map = list(type_map) if type_map else None
        self._dist = dist_module
        self._datasets: Any = None

    def datasets(self) -> Any:
        """The training systems, built (once) as the trainer's ``DpLoaderSet`` will build them."""
        if self._datasets is None:
            if os.environ.get("LOCAL_RANK") is not None and not self._dist.is_initialized():
                self._dist.init_process_group(backend="cuda:nccl,cpu:gloo")  # DeePMD-kit's
            job = current_job()
            if job is not None and self.place in job.sections:
                self._datasets = job.datasets(self.place)
            else:
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
    return NeighbourStatData(jdata["systems"], jdata.get("rglob_patterns"), type_map,
                             seam.deepmd_module(seam.MAIN).dist)


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
        job = current_job()
        task = train_data.place.task if train_data.place is not None else None
        shared = job.sharing_datasets(task) if job is not None else None
        if shared is None:
            stats = neighbour_statistics(own, rcut, type_map=type_map, mixed_type=mixed_type)
            return min_nbor_dist(stats), np.asarray(stats.max_neighbours, dtype=int)
        # heads sharing a descriptor ask for the same union: one pass for all of them (every
        # rank decides alike, the key is a function of the input)
        key = (job.shared[task], float(rcut), bool(mixed_type), tuple(type_map or ()))
        if key not in job.neighbour_results:
            stats = neighbour_statistics(shared, rcut, type_map=type_map, mixed_type=mixed_type)
            job.neighbour_results[key] = (min_nbor_dist(stats),
                                          tuple(int(n) for n in stats.max_neighbours))
        found = job.neighbour_results[key]
        return found[0], np.asarray(found[1], dtype=int)

    return get_nbor_stat


def planned_task_input(task: str | None) -> tuple[DpLoaderSet, int, float] | None:
    """What ``task``'s statistics initialization will pass, read from the recorded job: its
    training ``DpLoaderSet``, ``data_stat_nbatch`` and ``min_pair_dist`` (``None``: unknown)."""
    job = current_job()
    data = job.training_set(task) if job is not None else None
    if data is None:
        return None
    model, training_data = job.task_settings(task)  # type: ignore[union-attr]
    return (data, model.get("data_stat_nbatch", 10),
            float(training_data.get("min_pair_dist", 0.0)))
