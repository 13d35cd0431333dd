"""``DpLoaderSet``, ``get_weighted_sampler``, ``get_sampler_from_params``: DeePMD-kit's names.

What changes under the same names (``docs/migrating.md`` lists every difference):

- Systems come from :func:`mdloader.loading.build.build_systems` (rank 0 discovers and reads
  headers, every rank receives small metadata); the set-up keeps a few integers per system and
  no per-system ``DataLoader`` or iterator.
- The sampler (:class:`~mdloader.sampling.samplers.WeightedSystemSampler`) yields batch
  *keys*; the outer ``DataLoader(loader_set, sampler=..., batch_size=None, num_workers=K,
  collate_fn=lambda b: b)`` calls ``loader_set[key]``, which only reads. Workers therefore never
  repeat a batch.
- Frames are reshuffled on every pass, seeded from the user's seed; the system stream of each
  rank comes from ``(seed, rank)``. Probability and batch-size inputs are checked up front.
- No global side effects: no global reseeding, no sharing-strategy change, no start-method change.

``loader_set[sid]`` (an int) keeps DeePMD-kit's meaning -- the next batch of system ``sid``,
with its cursor in *this* process: use it in the main process (tests, statistics), as each
DataLoader worker would advance its own copy (hence the sampler's keys)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats import backend_of
from mdloader.data.formats.base import SystemMeta
from mdloader.data.schema import as_requirement
from mdloader.distributed.collectives import agreed_seed
from mdloader.distributed.group import current_world
from mdloader.errors import ConfigError, StateDictError
from mdloader.loading.build import build_systems
from mdloader.loading.system_list import SystemDatasets, kept_systems, natoms_of, nframes_of
from mdloader.loading.worker_lifetime import bind_to_rank
from mdloader.loading.worker_memory import settle_worker, share_heap_with_forks
from mdloader.sampling.order import AgreedSeed, FrameOrder, normalize_seed
from mdloader.sampling.plan import LoaderPlan
from mdloader.sampling.probability import StyleRule, select_prob_source
from mdloader.sampling.samplers import WeightedSystemSampler
from mdloader.sampling.spec import SamplingSpec
from mdloader.sampling.streams import BatchKey
from mdloader.sampling.validation import ShardedValidationSampler
from mdloader.settings import resolve
from mdloader.state import check_keys, check_same
from mdloader.transport import TransportBatch
from mdloader.world import World

log = logging.getLogger(__name__)

STATE_VERSION = 3


def default_num_workers(value: int | None = None, argument: str = "num_workers") -> int:
    """``value`` if given (checked), else DeePMD-kit's ``NUM_WORKERS``, else ``min(4, cpus)``."""
    return int(resolve("num_workers", value, argument=argument))


def _spec_of(spec: SamplingSpec | None, batch_size: Any, shuffle: bool) -> SamplingSpec:
    """The loader set's sampling keys: ``spec``, else DeePMD-kit's ``batch_size``/``shuffle``."""
    if spec is None:
        return SamplingSpec(batch_size="auto" if batch_size is None else batch_size,
                            shuffle=shuffle)
    if batch_size is not None and SamplingSpec(batch_size=batch_size).batch_size \
            != spec.batch_size:
        raise ConfigError(f"batch_size {batch_size!r} differs from the spec's "
                          f"{spec.batch_size!r}: give it once", path=spec.key("batch_size"))
    return spec


def agree_seed(seed: int | Sequence[int] | None, world: World) -> AgreedSeed:
    """A seed as DeePMD-kit passes it (an int, ``[rank, seed]`` or ``None``) as the job seed
    on every rank: the user's, or rank 0's random one (a collective)."""
    given = normalize_seed(seed, world.rank)
    return AgreedSeed(agreed_seed(given, world), given is not None)


def _build(systems: Any, type_map: Sequence[str] | None, rglob_patterns: Sequence[str] | None,
           index_file: Any, index_mode: str | None) -> Sequence[DeepmdDataSetForLoader]:
    """Built datasets for ``systems``: prebuilt objects pass through, paths go to the build."""
    if isinstance(systems, SystemDatasets):
        return systems
    if isinstance(systems, (list, tuple)) and systems and all(
            isinstance(s, (DeepmdDataSetForLoader, SystemMeta)) for s in systems):
        return [s if isinstance(s, DeepmdDataSetForLoader) else DeepmdDataSetForLoader(s)
                for s in systems]
    return build_systems(systems, type_map, rglob_patterns=rglob_patterns,
                         index_file=index_file, index_mode=index_mode)


class DpLoaderSet(Dataset):
    """All training systems of this rank, with DeePMD-kit's attributes.

    Parameters
    ----------
    systems
        Paths (directories, roots, globs, HDF5 files, ``file.h5#/grp``) or prebuilt
        :class:`DeepmdDataSetForLoader`/:class:`SystemMeta` objects.
    batch_size
        ``int | list[int] | "auto" | "auto:N" | "max:N" | "filter:N"``
        (:mod:`mdloader.sampling.batching`); default ``"auto"``. Give it here or in ``spec``.
    type_map
        The model's type map.
    seed
        Job seed (int), DeePMD-kit's ``[rank, seed]``, or None for a fresh seed agreed by all
        ranks (a state loaded later then brings its own seed); an
        :class:`~mdloader.sampling.order.AgreedSeed` is taken as it is (no collective).
    shuffle
        Shuffle frames within each pass (always on in DeePMD-kit's distributed mode).
    modifier
        DeePMD-kit's data modifier; not supported (must be None).
    spec
        The data section's sampling keys as one value
        (:class:`~mdloader.sampling.spec.SamplingSpec`: batch size, probabilities, shuffling,
        one system stream for all ranks, balanced steps, the JSON path errors name); without it,
        ``batch_size`` and ``shuffle`` make one.
    rglob_patterns
        Passed to discovery.
    world
        Rank and size; default: the initialised process group, else a single process.
    index_file, index_mode
        The system index file and what to do with it (``check``, ``refresh``, ``trust``,
        ``off``); see :func:`mdloader.loading.build.build_systems`.
    neighbours
        The mean neighbours within rcut of every system of the list, for balanced steps under
        the ``neighbours`` cost model.

    Examples
    --------
    >>> from mdloader import DpLoaderSet
    >>> from mdloader.testing import make_dataset
    >>> paths = make_dataset("data", 2, nframes=4, seed=1)       # two systems of 4 frames
    >>> ls = DpLoaderSet(paths, batch_size=2, type_map=["O", "H"], seed=7)
    >>> len(ls), ls.index, ls.batch_sizes.tolist()                # batches per system
    (2, [2, 2], [2, 2])
    >>> batch = ls[0]                                             # the next batch of system 0
    >>> batch["sid"], len(batch["fid"]), tuple(batch["coord"].shape[:1])
    (0, 2, (2,))
    """

    def __init__(self, systems: Any, batch_size: int | Sequence[int] | str | None = None,
                 type_map: Sequence[str] | None = None,
                 seed: int | Sequence[int] | AgreedSeed | None = None, shuffle: bool = True,
                 modifier: Any = None, *, spec: SamplingSpec | None = None,
                 rglob_patterns: Sequence[str] | None = None, world: World | None = None,
                 index_file: str | None = None, index_mode: str | None = None,
                 neighbours: Sequence[float] | np.ndarray | None = None) -> None:
        if modifier is not None:
            raise ConfigError("data modifiers are not supported by mdloader", path="modifier")
        spec = _spec_of(spec, batch_size, shuffle)
        if world is None:
            world = current_world()
        self.world = world
        self.type_map = list(type_map) if type_map else None
        agreed = seed if isinstance(seed, AgreedSeed) else agree_seed(seed, world)
        built = _build(systems, type_map, rglob_patterns, index_file, index_mode)
        self.plan: LoaderPlan = LoaderPlan.build(
            natoms_of(built), nframes_of(built), spec, seed=agreed.value,
            seed_given=agreed.given, world_size=world.world_size, neighbours=neighbours)
        """The loader plan in force (:mod:`mdloader.sampling.plan`): read its values there."""
        plan = self.plan
        self.systems: Sequence[DeepmdDataSetForLoader] = kept_systems(built, plan.kept)
        # DeePMD-kit's names: batches of every system on this rank, their sum, batch sizes.
        self.index: list[int] = plan.nbatches.tolist()
        self.total_batch = plan.total_batches
        self.batch_sizes: np.ndarray = plan.batch_sizes
        """Batch size of every system (read-only), DeePMD-kit's ``batch_sizes``."""
        self._order: FrameOrder | None = None
        self._cursor = np.zeros(len(self.systems), dtype=np.int64)
        self.dataloaders = LazySystemBatches(self)
        self.sampler: WeightedSystemSampler | None = None
        self._warned_worker = False
        share_heap_with_forks()  # DataLoader workers fork from this process

    # -- the plan: sizes, batch counts and the seed, read from one place ----------------------
    @property
    def seed(self) -> int:
        """The job seed (DeePMD-kit's ``seed`` argument); a loaded state's once adopted."""
        return self.plan.seed  # type: ignore[return-value]

    @property
    def nframes(self) -> np.ndarray:
        """Frames of every system (read-only), beside DeePMD-kit's ``batch_sizes``."""
        return self.plan.nframes

    @property
    def frame_order(self) -> FrameOrder:
        """Which frames the n-th batch of each system holds on this rank, under the plan's
        current seed."""
        if self._order is None:
            self._order = self.plan.frame_order(self.world.rank)
        return self._order

    def __getstate__(self) -> dict[str, Any]:
        # What DataLoader workers receive (spawn/forkserver): no sampler, they only read.
        state = self.__dict__.copy()
        state["sampler"] = None
        return state

    # -- DeePMD-kit's Dataset protocol -----------------------------------------------------
    def __len__(self) -> int:
        return len(self.systems)

    def __getitem__(self, idx: int | BatchKey | tuple) -> dict[str, Any]:
        """A key from the sampler: read it. An int ``sid``: the next batch of that system.

        Inside a DataLoader worker the batch is a :class:`~mdloader.transport.TransportBatch`:
        its tensors cross to the main process as numpy arrays (an order of magnitude cheaper than
        torch's per-tensor shared memory for small tensors) and arrive as the same plain dict.
        """
        in_worker = get_worker_info() is not None
        if in_worker:
            settle_worker()
            bind_to_rank()
        if isinstance(idx, tuple):
            batch = self.read(int(idx[0]), idx[1])
        else:
            batch = self._next_batch(int(idx), in_worker)
        return TransportBatch(batch) if in_worker else batch

    def _next_batch(self, sid: int, in_worker: bool) -> dict[str, Any]:
        """``ls[sid]``: advance this process's cursor of system ``sid`` and read that batch."""
        if in_worker and not self._warned_worker:
            self._warned_worker = True
            log.warning("DpLoaderSet[int] inside a DataLoader worker advances that worker's own "
                        "copy of the system cursor; use the sampler from get_weighted_sampler, "
                        "whose keys make workers read disjoint batches")
        occ = int(self._cursor[sid])
        self._cursor[sid] = occ + 1
        return self.read(sid, self.frame_order.fids(sid, occ))

    def read(self, sid: int, fids: Sequence[int]) -> dict[str, Any]:
        """The collated batch of frames ``fids`` of system ``sid`` (with ``sid`` set)."""
        batch = self.systems[sid].get_batch(list(fids))
        batch["sid"] = sid
        return batch

    def add_data_requirement(self, data_requirement: Sequence[Any]) -> None:
        # Convert once, so every system shares the same requirement objects.
        items = [as_requirement(item) for item in data_requirement]
        for system in self.systems:
            system.add_data_requirement(items)

    def preload_and_modify_all_data_torch(self) -> None:
        """DeePMD-kit compatibility: nothing to do without a modifier."""

    def print_summary(self, name: str, prob: Sequence[float]) -> None:
        """Rank 0 logs system, natoms, batch size, batches on this rank, probability, pbc."""
        if self.world.rank != 0:
            return
        width = max([len(s.system) for s in self.systems] + [6])
        log.info("---Summary of DataSystem: %s (%d systems, W=%d)---", name, len(self.systems),
                 self.world.world_size)
        log.info("%-*s  %6s  %6s  %6s  %9s  %3s", width, "system", "natoms", "bch_sz", "n_bch",
                 "prob", "pbc")
        for i, s in enumerate(self.systems):
            log.info("%-*s  %6d  %6d  %6d  %9.3e  %3s", width, s.system, s.meta.natoms,
                     self.batch_sizes[i], self.index[i], prob[i],
                     "?" if backend_of(s.meta.location).pbc_per_frame  # known per frame
                     else "TF"[not s.meta.pbc])

    # -- probabilities and state -----------------------------------------------------------
    def probability_rule(self, prob_style: str | Sequence[float], sys_prob: bool = False,
                         key: str | None = None) -> StyleRule:
        """The probability rule of ``prob_style``, written against the unfiltered system list;
        it gives the probabilities of any world size (:mod:`mdloader.sampling.probability`)."""
        return self.plan.rule_of(prob_style, sys_prob, key)

    def probabilities(self, prob_style: str | Sequence[float], sys_prob: bool = False,
                      key: str | None = None) -> np.ndarray:
        """System probabilities from ``index``; inputs written against the unfiltered list."""
        return self.plan.with_probabilities(prob_style, sys_prob, key).probabilities

    def state_dict(self) -> dict[str, Any]:
        """The seed and the ``ls[int]`` cursors in use (the sampler saves its own state).

        The cursors walk this rank's shards, so they resume on the same rank and world size only
        (the sampler's state is the one that resumes on another number of ranks).
        """
        used = np.flatnonzero(self._cursor)
        return {"version": STATE_VERSION, "seed": self.seed, "rank": self.world.rank,
                "world_size": self.world.world_size, "cursor_sids": used.tolist(),
                "cursor_counts": self._cursor[used].tolist()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_keys(state, kind="DpLoaderSet", version=STATE_VERSION,
                   keys=("seed", "rank", "world_size", "cursor_sids", "cursor_counts"))
        check_same("DpLoaderSet", "world size", int(state["world_size"]), self.world.world_size)
        check_same("DpLoaderSet", "rank", int(state["rank"]), self.world.rank)
        sids = np.asarray(state["cursor_sids"], dtype=np.int64)
        if len(sids) and (sids.min() < 0 or sids.max() >= len(self.systems)):
            raise StateDictError(f"cursor system index out of range for {len(self.systems)} "
                                 "systems")
        counts = np.asarray(state["cursor_counts"], dtype=np.int64)
        if counts.shape != sids.shape:
            raise StateDictError(f"{len(counts)} cursor counts for {len(sids)} cursor systems")
        # Every other check passed: the saved seed (refused if the user gave another one) becomes
        # this set's (its samplers keep their own states, seeds included).
        plan = self.plan.adopt_seed(state["seed"], "DpLoaderSet")
        if plan is not self.plan:
            self.plan, self._order = plan, None
        self._cursor[:] = 0
        self._cursor[sids] = counts


def get_weighted_sampler(training_data: DpLoaderSet, prob_style: str | Sequence[float],
                         sys_prob: bool = False, *, num_samples: int | None = None,
                         num_workers: int | None = None, key: str | None = None
                         ) -> WeightedSystemSampler:
    """DeePMD-kit's ``get_weighted_sampler``, yielding batch keys; attached to ``training_data``.

    One ``iter()`` yields ``total_batch * max(num_workers, 1)`` keys unless ``num_samples`` is
    given; ``num_workers`` defaults to ``NUM_WORKERS`` as in DeePMD-kit. ``key`` is the JSON path
    of ``prob_style``, named in its errors.
    """
    rule = training_data.probability_rule(prob_style, sys_prob, key)
    if num_samples is None:
        workers = default_num_workers(num_workers)
        num_samples = training_data.total_batch * max(workers, 1)
    sampler = WeightedSystemSampler.of_plan(
        training_data.plan, rule, rank=training_data.world.rank, num_samples=num_samples,
        type_map=training_data.type_map)
    log.debug("Generated weighted sampler with prob array: %s", sampler.weights.numpy())
    training_data.sampler = sampler
    return sampler


def get_validation_sampler(data: DpLoaderSet) -> ShardedValidationSampler:
    """Keys of one full validation pass on this rank: every frame of ``data`` once over the ranks,
    without padding (:mod:`mdloader.sampling.validation`)."""
    return ShardedValidationSampler.of_plan(data.plan, rank=data.world.rank)


def get_sampler_from_params(data: DpLoaderSet, params: Mapping[str, Any], *,
                            json_path: str | None = None, **kwargs: Any
                            ) -> WeightedSystemSampler:
    """``sys_probs`` if set, else ``auto_prob``, else ``prob_sys_size``; errors name the key
    under ``json_path`` (where ``params`` sit in ``input.json``, ``training.training_data``;
    default: the loader set's).

    Examples
    --------
    >>> from mdloader import DpLoaderSet, get_sampler_from_params
    >>> from mdloader.testing import make_dataset
    >>> ls = DpLoaderSet(make_dataset("data", 2, nframes=4, seed=1), batch_size=2,
    ...                  type_map=["O", "H"], seed=7)
    >>> sampler = get_sampler_from_params(ls, {"sys_probs": [0.25, 0.75]}, num_workers=0)
    >>> sampler.weights.tolist()
    [0.25, 0.75]
    >>> key = sampler.next_key()              # which frames of which system, for this rank
    >>> ls[key]["fid"] == list(key.fids)
    True
    """
    value, is_sys_probs, name = select_prob_source(params)
    json_path = json_path if json_path is not None else data.plan.json_path
    key = f"{json_path}.{name}" if json_path else None
    return get_weighted_sampler(data, value, sys_prob=is_sys_probs, key=key, **kwargs)


__all__ = ["DpLoaderSet", "agree_seed", "get_weighted_sampler", "get_validation_sampler",
           "get_sampler_from_params", "default_num_workers"]


class SystemBatches:
    """The batches of one system on this rank, for statistics: DeePMD-kit's per-system loader.

    ``len()`` is the batch count the sampler uses; every ``iter()`` starts again at the first
    batch of the rank's shard of pass 0. No torch ``DataLoader``, no state: creating one is free.
    """

    def __init__(self, owner: DpLoaderSet, sid: int) -> None:
        self._owner, self.sid = owner, sid
        self.dataset = owner.systems[sid]
        self.batch_size = int(owner.batch_sizes[sid])

    def __len__(self) -> int:
        return int(self._owner.plan.nbatches[self.sid])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for j in range(len(self)):
            yield self._owner.read(self.sid, self._owner.frame_order.fids(self.sid, j))


class WholeSystemBatches(SystemBatches):
    """Every frame of one system once, in file order, in batches of its batch size (the last may
    be short): DeePMD-kit's per-system loader for statistics on every frame, whatever the rank
    (``MDLOADER_STAT_FRAMES=all``)."""

    def __len__(self) -> int:
        return -(-int(self._owner.nframes[self.sid]) // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        nframes = int(self._owner.nframes[self.sid])
        for lo in range(0, nframes, self.batch_size):
            yield self._owner.read(self.sid, range(lo, min(lo + self.batch_size, nframes)))


class LazySystemBatches(Sequence):
    """``dataloaders``: one :class:`SystemBatches` per system, created when indexed."""

    def __init__(self, owner: DpLoaderSet) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return len(self._owner.systems)

    #: What one system's loader is: this rank's batches of pass 0.
    batches = SystemBatches

    def __getitem__(self, sid: int) -> SystemBatches:  # type: ignore[override]
        n = len(self)
        if not isinstance(sid, (int, np.integer)) or not -n <= sid < n:
            raise IndexError(f"system index {sid!r} out of range for {n} systems")
        return self.batches(self._owner, int(sid) % n)


class WholeSystemLoaders(LazySystemBatches):
    """``dataloaders`` whose system loaders give every frame once (:class:`WholeSystemBatches`)."""

    batches = WholeSystemBatches
