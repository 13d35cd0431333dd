"""The feed: one holder of a job's streams, used by both trainers.

A job trains from several streams: the training and validation data of every task, and in a
multi-task job the display-time batches of every task (a display evaluates one training batch
of each task the step did not train; they come from a stream of their own, so that logging
never changes what is trained). A :class:`Feed` holds them all, with what they share:

* **one build** of every data section (:func:`mdloader.loading.build.build_job`: rank 0 reads
  the tree, one broadcast), in :meth:`Feed.build`;
* **one seed**, the job's, agreed by the ranks once; each stream's seed derives from it;
* **one task schedule** (multi-task), a pure function of (seed, step, rank);
* **one pool** of DataLoader workers reading every stream ahead in the trainer's own order
  (:class:`~mdloader.loading.pool.WorkerPool`, :func:`mdloader.sampling.loop.requests`);
* **one state**, every stream's consumed position and the seed, in one document
  (:mod:`mdloader.loading.feed_state`) that both trainers save and restore;
* **one account of data stalls** (:mod:`mdloader.loading.stalls`): what the trainer waits for
  its batches on every rank, reported by rank 0 every few steps.

:meth:`Feed.start` puts it in motion, in this order and nowhere else: the saved state is
restored, the task schedule set at the step the run continues at, and the pool started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mdloader.data.formats.lmdb.address import mixed_database
from mdloader.distributed.collectives import gather_to_main
from mdloader.errors import ConfigError, MdloaderError, StateDictError
from mdloader.loading import feed_state
from mdloader.loading.build import BuildReport, Section, build_job
from mdloader.loading.loader import (
    DpLoaderSet,
    agree_seed,
    get_sampler_from_params,
    get_validation_sampler,
)
from mdloader.loading.mixed_stream import MixedLmdbBatches
from mdloader.loading.pool import WorkerPool
from mdloader.loading.stalls import StallMeter
from mdloader.sampling.elastic import merge_rank_states
from mdloader.sampling.loop import TrainingLoop, requests
from mdloader.sampling.mixed import (
    MixedBatchSampler,
    check_mixed_rule,
    is_mixed_rule,
    is_mixed_state,
    merge_mixed_states,
)
from mdloader.sampling.order import SEED_MOD, AgreedSeed
from mdloader.sampling.samplers import WeightedSystemSampler
from mdloader.sampling.spec import SamplingSpec
from mdloader.sampling.tasks import TaskCursor, TaskSchedule, display_stream_seed
from mdloader.settings import resolve
from mdloader.state import check_same
from mdloader.world import World

log = logging.getLogger(__name__)

ROLES = ("training", "validation", "display")

BatchCheck = Callable[["Stream", Mapping[str, Any]], None]
"""A check of each batch a stream hands out: ``check(stream, batch)`` raises to refuse it."""


def stream_name(task: str | None, role: str) -> str:
    """``training``, ``validation`` or ``display``, then ``.<task>`` for a multi-task head."""
    return role if task is None else f"{role}.{task}"


class Stream:
    """One stream of a feed: a loader set, its sampler, the batches it handed out, and an
    optional check of each batch (:data:`BatchCheck`). A ``mix:N`` stream's loader set is a
    :class:`~mdloader.loading.mixed_stream.MixedLmdbBatches` and its sampler a
    :class:`~mdloader.sampling.mixed.MixedBatchSampler`; its :attr:`systems_view`, when the
    feed was built with ``systems_views``, the same systems as a ``max:N`` loader set (one
    system per LMDB group): what a trainer's statistics, summaries and checks read.

    An endless iterator once its feed has started. ``consumed`` is the position of the next
    batch in the sampler's stream: what a checkpoint saves, since workers read ahead.
    """

    def __init__(self, task: str | None, role: str, dataset: DpLoaderSet | MixedLmdbBatches,
                 sampler: WeightedSystemSampler | MixedBatchSampler) -> None:
        if role not in ROLES:
            raise ConfigError(f"a stream's role is one of {', '.join(ROLES)}, got {role!r}")
        self.task, self.role = task, role
        self.name = stream_name(task, role)
        self.dataset, self.sampler = dataset, sampler
        self.consumed = sampler.position
        self.check: BatchCheck | None = None
        self.systems_view: DpLoaderSet | None = None
        self.meter: StallMeter | None = None
        self._pool: WorkerPool | None = None
        self._index = -1

    def systems(self) -> tuple[DpLoaderSet, list[float]]:
        """The loader set of the stream's systems (a ``mix:N`` stream's :attr:`systems_view`)
        and the probability of each (under ``mix:N`` its share of the frames, as DeePMD-kit's
        summary prints it)."""
        if self.systems_view is not None:
            view = self.systems_view
            return view, [float(p) for p in view.probabilities("prob_sys_size")]
        if not isinstance(self.dataset, DpLoaderSet):
            raise ConfigError(f"the mix:N stream {self.name} was built without its systems "
                              "(Feed.build(..., systems_views=True))")
        return self.dataset, self.sampler.weights.tolist()

    def attach(self, pool: WorkerPool | None, index: int = -1) -> None:
        """Read through ``pool``, as its stream ``index`` (``None``: not read any more)."""
        self._pool, self._index = pool, int(index)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        if self._pool is None:
            raise MdloaderError(f"the stream {self.name} is read once its feed has started "
                                "(Feed.start)")
        started = self.meter.start_wait() if self.meter is not None else None
        batch = self._pool.next_batch(self._index)
        if self.check is not None:
            self.check(self, batch)
        if started is not None:
            self.meter.end_wait(started)  # type: ignore[union-attr]
        self.consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The stream's state on this rank, at the batches handed out."""
        return self.sampler.state_dict(consumed=self.consumed)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved state (this rank's, or the merged state of every rank)."""
        self.sampler.load_state_dict(state)
        self.consumed = self.sampler.position


class PassKeys:
    """The keys of one pass at a time (a full validation pass), handed out in order."""

    def __init__(self) -> None:
        self._keys: Iterator[Any] = iter(())

    def start(self, keys: Sequence[Any]) -> int:
        """Hand out ``keys`` next; returns how many."""
        self._keys = iter(keys)
        return len(keys)

    def next_key(self) -> Any:
        return next(self._keys)


class TrainingDraws:
    """A task's training data as a trainer's loop draws it: within a training step
    (:meth:`Feed.training_step`) its training stream, outside one (a display-time draw) its
    display stream when it has one."""

    def __init__(self, feed: Feed, task: str | None) -> None:
        self.feed = feed
        self.training = feed.stream(task, "training")
        self.display = feed.streams.get((task, "display"))

    def __iter__(self) -> TrainingDraws:
        return self

    def __next__(self) -> Any:
        if self.feed.in_step or self.display is None:
            return next(self.training)
        return next(self.display)


@dataclass(frozen=True)
class StreamSpec:
    """A stream :meth:`Feed.build` makes: its ``systems`` section, how it samples, and its seed
    (the job seed plus ``seed_offset``)."""

    section: Section
    sampling: SamplingSpec
    seed_offset: int = 0


class Feed:
    """Every stream of a job, their seed, schedule, worker pool and state.

    Parameters
    ----------
    streams
        The job's streams (at most one per task and role).
    seed
        The job seed, agreed by the ranks (:func:`agree_seed`).
    world
        This rank.
    num_workers, pin_memory
        The worker pool's processes (0: read in this process) and whether it pins batches.
    separate_pools
        A pool of ``num_workers`` per task and kind of data instead of one for all
        (DeePMD-kit's arrangement of a DataLoader per task and role).
    report
        What the build did (``None`` for streams built elsewhere).

    Examples
    --------
    >>> from mdloader.loading.build import Section
    >>> from mdloader.loading.feed import Feed, StreamSpec
    >>> from mdloader.sampling.loop import TrainingLoop
    >>> from mdloader.sampling.spec import SamplingSpec
    >>> from mdloader.testing import make_dataset
    >>> from mdloader.world import World
    >>> paths = make_dataset("data", 2, nframes=4, seed=1)
    >>> spec = StreamSpec(Section.of(None, "training", paths), SamplingSpec(batch_size=2))
    >>> feed = Feed.build([spec], seed=7, world=World(), labels=[], num_workers=0)
    >>> feed.start(0, TrainingLoop(displays=False))     # resume (nothing), schedule, pool
    >>> with feed.training_step():
    ...     batch = next(feed.stream(None, "training"))
    >>> state = feed.gather_state()                    # rank 0's document of the job
    >>> state["next_step"], state["streams"]["training"]["generations"]
    (1, [[1, 1]])
    >>> feed.close()
    """

    def __init__(self, streams: Sequence[Stream], *, seed: AgreedSeed, world: World,
                 num_workers: int, pin_memory: bool = False, separate_pools: bool = False,
                 report: BuildReport | None = None) -> None:
        self.streams: dict[tuple[str | None, str], Stream] = {}
        for stream in streams:
            if (stream.task, stream.role) in self.streams:
                raise ConfigError(f"two streams named {stream.name}")
            self.streams[(stream.task, stream.role)] = stream
        self.seed, self.world, self.report = seed, world, report
        self.num_workers, self.pin_memory = int(num_workers), bool(pin_memory)
        self.separate_pools = bool(separate_pools)
        self.schedule: TaskCursor | None = None
        self.pools: list[WorkerPool] = []
        self.start_step = self.step = 0
        self.in_step = False
        self.stalls: StallMeter | None = None
        self._passes: dict[str | None, tuple[PassKeys, Any]] = {}

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def build(cls, specs: Sequence[StreamSpec], *, seed: int | Sequence[int] | None,
              world: World, labels: Sequence[Any], num_workers: int,
              pin_memory: bool = False, type_map: Sequence[str] | None = None,
              systems_views: bool = False) -> Feed:
        """The feed of ``specs``: every section in one build and one broadcast, a loader set
        reading ``labels`` and a sampler per stream (a collective); ``systems_views``: a
        ``mix:N`` stream also gets its systems as a ``max:N`` loader set
        (:attr:`Stream.systems_view`), as ``mdloader dp`` keeps them for the statistics."""
        job_seed = agree_seed(seed, world)
        job = build_job([s.section for s in specs])
        streams = []
        for spec in specs:
            offset = AgreedSeed((job_seed.value + spec.seed_offset) % SEED_MOD, job_seed.given)
            if is_mixed_rule(spec.sampling.batch_size):
                stream = mixed_stream(spec, offset.value, world, labels, type_map)
                if systems_views:
                    rule = check_mixed_rule(str(spec.sampling.batch_size),
                                            spec.sampling.key("batch_size"))
                    view = dataclasses.replace(spec.sampling, batch_size=f"max:{rule.value}")
                    stream.systems_view = DpLoaderSet(job.view(spec.section),
                                                      type_map=type_map, seed=offset,
                                                      spec=view, world=world)
                    stream.systems_view.add_data_requirement(labels)
                streams.append(stream)
                continue
            data = DpLoaderSet(job.view(spec.section), type_map=type_map, seed=offset,
                               spec=spec.sampling, world=world)
            data.add_data_requirement(labels)
            sampler = get_sampler_from_params(data, spec.sampling.sampler_params(),
                                              num_workers=num_workers)
            streams.append(Stream(spec.section.task, spec.section.role, data, sampler))
        return cls(streams, seed=job_seed, world=world, num_workers=num_workers,
                   pin_memory=pin_memory, report=job.report)

    def stream(self, task: str | None, role: str) -> Stream:
        """The stream of ``task`` (``None``: single-task) and ``role``."""
        try:
            return self.streams[(task, role)]
        except KeyError:
            raise ConfigError(f"this job has no {stream_name(task, role)} stream (it has "
                              f"{', '.join(s.name for s in self.streams.values())})") from None

    def add_display_streams(self) -> None:
        """A display stream for every task's training stream that has none: its training
        systems, under a seed of their own
        (:func:`~mdloader.sampling.tasks.display_stream_seed`)."""
        for (task, role), training in list(self.streams.items()):
            if role != "training" or (task, "display") in self.streams:
                continue
            sampler = training.sampler
            if isinstance(sampler, MixedBatchSampler):
                self.streams[(task, "display")] = Stream(
                    task, "display", training.dataset,
                    sampler.with_seed(display_stream_seed(sampler.seed)))
                continue
            plan = dataclasses.replace(sampler.plan, seed=display_stream_seed(sampler.plan.seed))
            display = WeightedSystemSampler.of_plan(plan, sampler.rule, rank=sampler.rank,
                                                    num_samples=sampler.num_samples,
                                                    type_map=training.dataset.type_map)
            self.streams[(task, "display")] = Stream(task, "display", training.dataset,
                                                     display)

    # -- in motion -----------------------------------------------------------------------------
    def start(self, step: int, loop: TrainingLoop, state: Mapping[str, Any] | None = None, *,
              stall_dir: str | None = None) -> None:
        """Continue at ``step`` (the steps done): restore ``state`` (a document of
        :mod:`~mdloader.loading.feed_state`), set the task schedule at ``step``, start the
        pool reading ahead in ``loop``'s order. Resume, schedule, pool: in this order only (the
        pool draws keys from restored streams, in the order of the restored schedule). With a
        ``stall_dir``, the ranks report their data stalls every ``$MDLOADER_STALL_REPORT``
        steps, else every ``loop.disp_freq`` (a gather to rank 0, which writes there)."""
        if state is not None:
            self._restore(state, step)
        self.start_step = self.step = int(step)
        if loop.multi_task:
            if loop.probs is None or len(loop.probs) != len(loop.tasks):
                raise ConfigError(f"a multi-task loop needs one probability per task, got "
                                  f"{loop.probs} for {loop.tasks}")
            schedule = TaskSchedule(seed=self.seed.value, probs=loop.probs, window=loop.window,
                                    same_task_across_ranks=loop.same_task_across_ranks)
            self.schedule = TaskCursor(schedule, rank=self.world.rank, step=self.step)
        self._start_pool(loop)
        if stall_dir is not None:  # a trainer's run (a feed read by other code reports nothing)
            every = int(resolve("stall_report")) or loop.disp_freq
            self.stalls = StallMeter(every, stall_dir, is_main=self.world.is_main,
                                     workers=[pool.io for pool in self.pools])
        for stream in self.streams.values():
            stream.meter = self.stalls

    def _restore(self, state: Mapping[str, Any], step: int) -> None:
        """Every stream, and the seed, as ``state`` saved them (its step, its streams and its
        seed are checked before any stream is changed; each stream checks its own state)."""
        doc = feed_state.read(state)
        if int(doc["next_step"]) != int(step):
            raise StateDictError(f"the loader state continues at step {doc['next_step']} but "
                                 f"the checkpoint at step {step}: they are not one "
                                 "checkpoint's")
        saved = doc["streams"]
        fresh = sorted(s.name for s in self.streams.values()
                       if s.role == "display" and s.name not in saved)
        missing = sorted({s.name for s in self.streams.values()} - set(saved) - set(fresh))
        if missing:
            raise StateDictError(f"the loader state has no state for the stream(s) "
                                 f"{', '.join(missing)} (it has {', '.join(sorted(saved))}): "
                                 "the input's tasks or validation data changed since the "
                                 "checkpoint")
        if doc["seed"] is not None and doc["seed"] != self.seed.value:
            if self.seed.given:
                check_same("loader", "seed", doc["seed"], self.seed.value,
                           " (training.seed): not this job's checkpoint")
            self.seed = AgreedSeed(int(doc["seed"]), False)
        for stream in self.streams.values():
            if stream.name in saved:
                stream.load_state_dict(saved[stream.name])
        if fresh:  # a state of an mdloader without display streams: only log lines differ
            log.info("the loader state has no display stream for %s: they start over",
                     ", ".join(fresh))

    def _start_pool(self, loop: TrainingLoop) -> None:
        """One pool reading every stream ahead in ``loop``'s order, and a full validation pass
        per task with validation data, read when asked for. With ``separate_pools``, a pool
        per task and kind of data instead: its training stream (and display stream: DeePMD-kit
        draws both from one DataLoader), its validation stream (and full passes)."""
        order = list(self.streams.values())
        readers = [(s.name, s.dataset, s.sampler, s.task, s.role) for s in order]
        for task in loop.tasks:
            validation = self.streams.get((task, "validation"))
            if validation is not None:
                self._passes[task] = (PassKeys(), len(readers))
                readers.append((stream_name(task, "full validation"), validation.dataset,
                                self._passes[task][0], task, "validation"))
        groups: dict[Any, list[int]] = {}
        for i, (_, _, _, task, role) in enumerate(readers):
            kind = "validation" if role == "validation" else "training"
            groups.setdefault((task, kind) if self.separate_pools else None, []).append(i)
        where: dict[int, tuple[WorkerPool, int]] = {}
        self.pools = []
        for members in groups.values():
            local = {stream: j for j, stream in enumerate(members)}
            forecast = _among(self._forecast(loop, order, self.step), local)
            pool = WorkerPool([readers[i][1] for i in members], [readers[i][2] for i in members],
                              [readers[i][0] for i in members], forecast,
                              num_workers=self.num_workers, pin_memory=self.pin_memory)
            self.pools.append(pool)
            where.update((i, (pool, local[i])) for i in members)
        for i, stream in enumerate(order):
            stream.attach(*where[i])
        self._passes = {task: (keys, where[i]) for task, (keys, i) in self._passes.items()}
        if self.world.is_main:
            log.info("DataLoader workers: %s of %d for %d stream(s) (%s)",
                     f"{len(self.pools)} pools" if self.separate_pools else "one pool",
                     self.num_workers, len(order), ", ".join(s.name for s in order))

    def _forecast(self, loop: TrainingLoop, order: Sequence[Stream],
                  start: int) -> Iterator[int]:
        """The streams of ``order`` in the order ``loop`` asks for them, from step ``start``."""
        index = {(s.task, s.role): i for i, s in enumerate(order)}
        wanted = [[index.get((task, role)) for role in ROLES] for task in loop.tasks]
        schedule = self.schedule.schedule if self.schedule is not None else None
        rank = self.world.rank

        def tasks_of(first: int, stop: int) -> Any:
            return schedule.tasks(rank, first, stop)  # type: ignore[union-attr]

        for task, role in requests(loop, start, tasks_of if schedule else None):
            stream = wanted[task][ROLES.index(role)]
            if stream is not None:
                yield stream

    @contextlib.contextmanager
    def training_step(self) -> Iterator[int]:
        """Within, the trainer draws the training batch of step :attr:`step` (its training
        streams serve it: :class:`TrainingDraws`); the step is done when the block is."""
        if self.stalls is not None:
            self.stalls.step(self.step)
        self.in_step = True
        try:
            yield self.step
        finally:
            self.in_step = False
        self.step += 1

    def next_task(self) -> int:
        """The task of the step now starting (the schedule moves to the next step)."""
        if self.schedule is None:
            raise MdloaderError("a multi-task step was drawn before the feed started its "
                                "schedule (Feed.start)")
        return self.schedule.choice()

    def draws(self, task: str | None) -> TrainingDraws:
        """The training data of ``task`` as a trainer's loop draws it (:class:`TrainingDraws`)."""
        return TrainingDraws(self, task)

    def full_pass(self, task: str | None = None) -> Iterator[Any]:
        """The batches of one full validation pass of ``task``: every validation frame once
        over the ranks (:class:`~mdloader.sampling.validation.ShardedValidationSampler`), read
        by the pool. Leaving the iterator early cuts the pass."""
        if task not in self._passes:
            raise ConfigError(f"no full validation pass of {stream_name(task, 'validation')} "
                              "(the feed has not started, or the task has no validation data)")
        keys, (pool, index) = self._passes[task]
        data = self.stream(task, "validation").dataset
        if isinstance(data, MixedLmdbBatches):
            raise ConfigError(f"a full validation pass of {stream_name(task, 'validation')} "
                              "reads its systems frame by frame; its batch_size mix:N is not "
                              "supported there")
        count = keys.start(list(get_validation_sampler(data)))
        pool.ask(index, count)
        done = 0
        try:
            while done < count:
                batch = pool.next_batch(index)
                done += 1
                yield batch
        finally:
            if done < count:
                pool.cancel(index)

    # -- state ----------------------------------------------------------------------------------
    def gather_state(self) -> dict[str, Any] | None:
        """The loader state of the whole job at :attr:`step`, on rank 0 (``None`` on the other
        ranks): every rank's stream states merged. A collective: every rank calls it."""
        mine = {s.name: s.state_dict() for s in self.streams.values()}
        states = gather_to_main(mine, context="gathering the loader states")
        if states is None:
            return None
        merged = {name: merge_stream_states([s[name] for s in states]) for name in mine}
        return feed_state.document(merged, next_step=self.step,
                                   world_size=self.world.world_size, seed=self.seed.value)

    @property
    def started(self) -> bool:
        """Whether the feed is in motion (started, not closed)."""
        return bool(self.pools)

    def finish(self) -> None:
        """The run ended on every rank together (a collective): the last stall report and the
        run's summary. A run that fails only closes (:meth:`close`)."""
        if self.stalls is not None:
            self.stalls.finish()

    def close(self) -> None:
        """End the pools' workers (the feed can start again); rank 0 logs the stall summary of
        what was reported."""
        if self.stalls is not None:
            self.stalls.close()
            self.stalls = None
        for pool in self.pools:
            pool.close()
            if self.world.is_main:
                log.info("DataLoader worker pool: %s", pool.summary())
        self.pools = []
        self._passes = {}
        for stream in self.streams.values():
            stream.attach(None)
            stream.meter = None

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def mixed_stream(spec: StreamSpec, seed: int, world: World, labels: Sequence[Any],
                 type_map: Sequence[str] | None) -> Stream:
    """The ``mix:N`` stream of ``spec``: its one LMDB database's batches as DeePMD-kit 3.2's
    trainer receives them, keys drawn from ``seed``."""
    key = spec.sampling.key("batch_size")
    data = MixedLmdbBatches(mixed_database(spec.section.systems, key), type_map,
                            str(spec.sampling.batch_size))
    data.add_data_requirement(labels)
    sampler = data.sampler(seed=seed, world=world, shuffle=spec.sampling.shuffle)
    return Stream(spec.section.task, spec.section.role, data, sampler)


def merge_stream_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The job state of one stream from every rank's: a ``mix:N`` stream's
    (:func:`~mdloader.sampling.mixed.merge_mixed_states`) or any other
    (:func:`~mdloader.sampling.elastic.merge_rank_states`)."""
    if states and all(is_mixed_state(s) for s in states):
        return merge_mixed_states(states)
    return merge_rank_states(states)


def _among(forecast: Iterator[int], local: Mapping[int, int]) -> Iterator[int]:
    """The streams of ``forecast`` that are in ``local``, as ``local`` numbers them."""
    for stream in forecast:
        if stream in local:
            yield local[stream]


__all__ = ["Feed", "PassKeys", "ROLES", "Stream", "StreamSpec", "TrainingDraws",
           "merge_stream_states", "mixed_stream", "stream_name"]
