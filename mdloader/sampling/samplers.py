"""The weighted system sampler: which frames of which system make each batch of this rank.

The sampler yields :class:`BatchKey` ``(sid, fids, step)``. ``DataLoader(loader_set,
sampler=sampler, batch_size=None, num_workers=K, ...)`` hands each key to a worker that only
*reads* those frames, so the union of what the workers yield is exactly this rank's stream: no
batch twice, no frame skipped (DeePMD-kit's workers each advance a forked copy of per-system
iterators and repeat batches). The keys come from a system stream
(:mod:`mdloader.sampling.streams`: independent or balanced, chosen once from the plan); the
sampler holds what identifies the job and its generations, and makes a new stream when the job
enters another generation or a loaded state brings another seed.

Resume state is a few integers; the per-system cursors are recomputed by replaying the system
stream (:func:`mdloader.sampling.order.stream_counts`). The state of every rank merged
(:func:`mdloader.sampling.elastic.merge_rank_states`) also resumes on another number of ranks
(:mod:`mdloader.sampling.elastic`). Workers prefetch, so the sampler's own
position runs ahead of what was consumed: save ``sampler.state_dict(consumed=k)``, or the state
of a :class:`~mdloader.loading.stateful_loader.StatefulLoader`, or let torchdata's
``StatefulDataLoader`` save the state of the epoch iterator (:class:`EpochIterator`).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.elastic import (
    BALANCE_IDENTITY,
    IDENTITY,
    JOB_KEYS,
    RANK_KEYS,
    Generation,
    continuation,
    generation_rows,
    parse_generations,
    resume_point,
)
from mdloader.sampling.order import Continuation, FrameOrder, sizes_digest
from mdloader.sampling.plan import LoaderPlan
from mdloader.sampling.probability import ProbabilityRule, as_rule
from mdloader.sampling.spec import SamplingSpec
from mdloader.sampling.streams import BatchKey, SystemStream, stream_type
from mdloader.state import check_keys, check_same

log = logging.getLogger(__name__)

STATE_VERSION = 2


def type_map_digest(type_map: Sequence[str] | None) -> int:
    """A 32-bit CRC of the type map (0 without one): a state of another type map is refused."""
    return 0 if not type_map else zlib.crc32("\0".join(type_map).encode())


class WeightedSystemSampler(Sampler[BatchKey]):
    """Draw a system by probability, then the next batch of that system's frames on this rank.

    Parameters
    ----------
    nframes, batch_sizes
        Frames and batch size of every system (after any ``filter:N``).
    probs
        System probabilities (:func:`mdloader.sampling.probability.system_probabilities`), or a
        :class:`~mdloader.sampling.probability.ProbabilityRule` that computes them from the
        batch counts of any world size (what an elastic resume needs when they depend on it).
    seed
        The job seed, identical on every rank (frame permutations must agree across ranks).
    rank, world_size
        This rank among how many; values, not a process group, so tests can play any rank.
    num_samples
        Keys per epoch, i.e. per ``iter()`` (DeePMD-kit: ``total_batch * max(NUM_WORKERS, 1)``).
        Each ``iter()`` continues the stream where the previous one stopped: it never restarts.
    same_system_across_ranks
        All ranks draw the same system at each step (equal atom counts per step, no stragglers),
        still reading disjoint frames; after an elastic resume, not until the leftover is served
        (``docs/sampling.md``, the limits of elastic resume).
    adopt_seed
        The seed was not chosen by the user (``seed=None``): :meth:`load_state_dict` then takes
        the saved seed instead of rejecting it, so a run started without a seed can resume.
    type_map
        The model's type map, part of the job's identity: a state saved with another one is
        refused.
    balance_window, balance_cost, natoms, neighbours
        Balanced steps (``docs/sampling.md``): windows of ``balance_window`` steps (0: off) whose
        batches are dealt so each step's ranks cost about the same under the cost model
        ``balance_cost`` (``"atoms"``: ``natoms`` per frame times the batch size;
        ``"neighbours"``: that times ``neighbours``, the mean neighbours within rcut).
    """

    def __init__(self, nframes: Sequence[int] | np.ndarray, batch_sizes: Sequence[int] | np.ndarray,
                 probs: Sequence[float] | np.ndarray | ProbabilityRule, *, seed: int,
                 rank: int = 0, world_size: int = 1, num_samples: int | None = None,
                 shuffle: bool = True, same_system_across_ranks: bool = False,
                 adopt_seed: bool = False, type_map: Sequence[str] | None = None,
                 balance_window: int = 0, balance_cost: str = "atoms",
                 natoms: Sequence[int] | np.ndarray | None = None,
                 neighbours: Sequence[float] | np.ndarray | None = None) -> None:
        spec = SamplingSpec(shuffle=shuffle, same_system_across_ranks=same_system_across_ranks,
                            balance_window=balance_window, balance_cost=balance_cost)
        plan = LoaderPlan.of_sizes(nframes, batch_sizes, seed=seed, seed_given=not adopt_seed,
                                   world_size=world_size, spec=spec, natoms=natoms,
                                   neighbours=neighbours)
        self._start(plan, as_rule(probs), rank, num_samples, type_map)

    @classmethod
    def of_plan(cls, plan: LoaderPlan, probs: Sequence[float] | np.ndarray | ProbabilityRule,
                *, rank: int = 0, num_samples: int | None = None,
                type_map: Sequence[str] | None = None) -> WeightedSystemSampler:
        """A sampler over ``plan`` (a loader set's): sizes, flags and the seed come from it.
        The sampler keeps its own copy: a seed it adopts from a loaded state is its own."""
        sampler = cls.__new__(cls)
        sampler._start(plan, as_rule(probs), rank, num_samples, type_map)
        return sampler

    def _start(self, plan: LoaderPlan, rule: ProbabilityRule, rank: int,
               num_samples: int | None, type_map: Sequence[str] | None) -> None:
        self.rule, self.rank = rule, int(rank)
        self.plan = plan.with_rule(rule)
        """The plan this sampler draws from, with this sampler's probabilities."""
        self.weights = torch.tensor(self.plan.probabilities, dtype=torch.double, device="cpu")
        self.num_samples = self.plan.total_batches if num_samples is None else int(num_samples)
        if self.num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {self.num_samples}")
        self._job = {
            "nsys": self.plan.nsys,
            "sizes_digest": sizes_digest(self.plan.nframes, self.plan.batch_sizes),
            "probs_digest": self.rule.digest, "type_map_digest": type_map_digest(type_map),
            "shuffle": int(self.plan.shuffle),
            "same_system_across_ranks": int(self.plan.same_system_across_ranks)}
        self._type_map = list(type_map) if type_map else None
        self._stream_type = stream_type(self.plan)
        self._restart()

    def _restart(self, history: tuple[Generation, ...] = (),
                 cont: Continuation | None = None) -> None:
        """Start generation ``len(history)`` at step 0 (``cont``: where this rank continues)."""
        self._history = history
        self._stream: SystemStream = self._stream_type(
            self.plan, self.plan.frame_order(self.rank, cont), len(history))

    def _adopt(self, plan: LoaderPlan) -> None:
        """Draw under ``plan`` (a loaded state's seed): the stream starts again under it."""
        if plan is not self.plan:
            self.plan = plan
            self._restart()

    @property
    def order(self) -> FrameOrder:
        """Which frames each batch of each system holds on this rank."""
        return self._stream.order

    @property
    def balance_window(self) -> int:
        """Steps per balanced window (0: every rank trains its own draws)."""
        return self.plan.balance_window

    @property
    def same_system_across_ranks(self) -> bool:
        return self.plan.same_system_across_ranks

    @property
    def adopt_seed(self) -> bool:
        """The seed was not chosen by the user: a loaded state's seed is adopted."""
        return not self.plan.seed_given

    @property
    def _identity(self) -> dict[str, int]:
        """What a state must share with this sampler to belong to the same job."""
        return {"seed": self.plan.seed, **self._job}

    # -- the stream ----------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Keys handed out so far in this generation (the step of the next key)."""
        return self._stream.step

    @property
    def generation(self) -> int:
        """How many times the job changed its number of ranks (0: never)."""
        return len(self._history)

    def next_key(self) -> BatchKey:
        """Hand out the next key and advance the stream."""
        return self._stream.next_key()

    def __iter__(self) -> EpochIterator:
        """The rest of the current epoch: steps up to the next multiple of ``num_samples``.

        From a fresh or epoch-aligned position that is ``num_samples`` keys; after a resume in
        the middle of an epoch it is the rest of that epoch, as torchdata's loaders do.
        """
        return EpochIterator(self)

    def epoch_end(self) -> int:
        """The step at which the current epoch (one ``iter()``) ends."""
        return (self._stream.step // self.num_samples + 1) * self.num_samples

    def __len__(self) -> int:
        return self.num_samples

    def seek(self, step: int) -> None:
        """Move the stream to ``step`` (forward or back) by replaying only the difference."""
        step = int(step)
        if step < 0:
            raise StateDictError(f"cannot seek to a negative step ({step})")
        self._stream.seek(step)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The rank's state (:mod:`mdloader.sampling.elastic`); ``consumed`` overrides the
        position (see the module doc)."""
        steps = self._stream.step if consumed is None else int(consumed)
        if steps < 0:
            raise StateDictError(f"consumed must be >= 0, got {steps}")
        return {"version": STATE_VERSION, **self._identity, **self._stream.identity(),
                "history": generation_rows(self._history), "rank": self.order.rank,
                "world_size": self.order.world_size, "steps": steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from this rank's state, or from the job state of every rank merged
        (:func:`~mdloader.sampling.elastic.merge_rank_states`), saved on any number of
        ranks; another job's state is rejected quoting both values."""
        merged = isinstance(state, Mapping) and "generations" in state
        balanced = isinstance(state, Mapping) and "balance_window" in state
        check_keys(state, kind="sampler", version=STATE_VERSION,
                   keys=(*(JOB_KEYS if merged else RANK_KEYS),
                         *(BALANCE_IDENTITY if balanced else ())))
        # Checks come first: the plan under the saved seed is only looked at here (a refused
        # seed raises), and put in force once every other check passed.
        adopted = self.plan.adopt_seed(state["seed"], "sampler")
        seed = adopted.seed
        for key, words in IDENTITY.items():
            mine = seed if key == "seed" else self._identity[key]
            check_same("sampler", words, int(state[key]), mine, self._hint(key))
        self._stream.check_identity(state)
        rank, world = self.order.rank, self.order.world_size
        if merged:
            history, steps = resume_point(parse_generations(state["generations"]), rank, world)
        else:
            check_same("sampler", "world size", int(state["world_size"]), world,
                       "; to resume on another number of ranks, load the state of every rank "
                       "merged with mdloader.merge_rank_states")
            check_same("sampler", "rank", int(state["rank"]), rank)
            history, steps = parse_generations(state["history"]), int(state["steps"])
        self._stream.check_generations(history)
        self._adopt(adopted)
        self._set_history(history)
        self.seek(steps)

    def _hint(self, key: str) -> str:
        """What stands behind a digest that differs, in words."""
        if key == "type_map_digest":
            return f" (this loader's type_map is {self._type_map})"
        if key == "probs_digest":
            return f" (this loader's probabilities: {self.rule.describe()})"
        return ""

    def _set_history(self, history: tuple[Generation, ...]) -> None:
        """Enter the generation after ``history``: recompute where every system continues."""
        if history == self._history:
            return
        started = time.perf_counter()
        cont = continuation(self.plan, history, self.rank, self.plan.world_size)
        self._restart(history, cont)
        if cont is not None:
            log.info("sampler: generation %d on %d rank(s) after %s; this rank first serves %d "
                     "leftover frame(s) (computed in %.2f s)", len(history), self.plan.world_size,
                     " -> ".join(f"{g.world_size} rank(s)" for g in history), cont.total,
                     time.perf_counter() - started)


class EpochIterator(Iterator[BatchKey]):
    """The keys of one epoch of a :class:`WeightedSystemSampler`, with a state of its own.

    Its state is the sampler's position when it is asked, plus where the epoch ends, so
    ``torchdata.stateful_dataloader.StatefulDataLoader`` (which saves the iterator's state at
    each delivered batch) resumes exactly, whatever its number of workers.
    """

    def __init__(self, sampler: WeightedSystemSampler) -> None:
        self.sampler = sampler
        self.stop = sampler.epoch_end()

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> BatchKey:
        if self.sampler.position >= self.stop:
            raise StopIteration
        return self.sampler.next_key()

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "sampler": self.sampler.state_dict(), "stop": self.stop}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_keys(state, kind="sampler iterator", version=STATE_VERSION,
                   keys=("sampler", "stop"))
        self.sampler.load_state_dict(state["sampler"])
        self.stop = int(state["stop"])


__all__ = ["BatchKey", "WeightedSystemSampler", "EpochIterator", "STATE_VERSION",
           "type_map_digest"]
