"""The weighted system sampler: which frames of which system make each batch of this rank.

The sampler yields :class:`BatchKey` ``(sid, fids, step)``. ``DataLoader(loader_set,
sampler=sampler, batch_size=None, num_workers=K, ...)`` hands each key to a worker that only
*reads* those frames, so the union of what the workers yield is exactly this rank's stream: no
batch twice, no frame skipped (DeePMD-kit's workers each advance a forked copy of per-system
iterators and repeat batches).

Resume state is a few integers; the per-system cursors are recomputed by replaying the system
stream (:func:`mdloader.sampling.order.stream_counts`). Workers prefetch, so the sampler's own
position runs ahead of what was consumed: save ``sampler.state_dict(consumed=k)``, or the state
of a :class:`~mdloader.sampling.stateful_loader.StatefulLoader`, or let torchdata's
``StatefulDataLoader`` save the state of the epoch iterator (:class:`EpochIterator`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Sampler

from mdloader.errors import ConfigError, StateDictError
from mdloader.sampling.order import (
    STREAM_CHUNK,
    FrameOrder,
    sizes_digest,
    stream_chunk,
    stream_counts,
    weights_to_cdf,
)
from mdloader.sampling.state import check_keys, check_same

STATE_VERSION = 1


class BatchKey(NamedTuple):
    """One batch: frames ``fids`` of system ``sid``; ``step`` is its index in the rank's stream."""

    sid: int
    fids: tuple[int, ...]
    step: int


class WeightedSystemSampler(Sampler[BatchKey]):
    """Draw a system by probability, then the next batch of that system's frames on this rank.

    Parameters
    ----------
    nframes, batch_sizes
        Frames and batch size of every system (after any ``filter:N``).
    probs
        System probabilities (:func:`mdloader.sampling.probability.system_probabilities`).
    seed
        The job seed, identical on every rank (frame permutations must agree across ranks).
    rank, world_size
        This rank among how many; values, not a process group, so tests can play any rank.
    num_samples
        Keys per epoch, i.e. per ``iter()`` (DeePMD-kit: ``total_batch * max(NUM_WORKERS, 1)``).
        Each ``iter()`` continues the stream where the previous one stopped: it never restarts.
    same_system_across_ranks
        All ranks draw the same system at each step (equal atom counts per step, no stragglers),
        still reading disjoint frames.
    adopt_seed
        The seed was not chosen by the user (``seed=None``): :meth:`load_state_dict` then takes
        the saved seed instead of rejecting it, so a run started without a seed can resume.
    """

    def __init__(self, nframes: Sequence[int] | np.ndarray, batch_sizes: Sequence[int] | np.ndarray,
                 probs: Sequence[float] | np.ndarray, *, seed: int, rank: int = 0,
                 world_size: int = 1, num_samples: int | None = None, shuffle: bool = True,
                 same_system_across_ranks: bool = False, adopt_seed: bool = False) -> None:
        self.order = FrameOrder(nframes, batch_sizes, seed=seed, rank=rank,
                                world_size=world_size, shuffle=shuffle)
        self.adopt_seed = bool(adopt_seed)
        p = np.asarray(probs, dtype=np.float64)
        if len(p) != len(self.order.nframes):
            raise ConfigError(f"{len(p)} probabilities for {len(self.order.nframes)} systems")
        self._cdf = weights_to_cdf(p)
        self.weights = torch.as_tensor(p, dtype=torch.double)
        self.same_system_across_ranks = bool(same_system_across_ranks)
        total = int(self.order.nbatches.sum())
        self.num_samples = total if num_samples is None else int(num_samples)
        if self.num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {self.num_samples}")
        self._digest = sizes_digest(self.order.nframes, self.order.batch_sizes)
        self._wdigest = sizes_digest(p)
        self._step = 0
        self._counts = np.zeros(len(p), dtype=np.int64)
        self._chunk_id = -1
        self._chunk = np.empty(0, dtype=np.int64)

    # -- the stream ----------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Keys handed out so far (the step of the next key)."""
        return self._step

    def _draw(self, step: int) -> int:
        c = step // STREAM_CHUNK
        if c != self._chunk_id:
            self._chunk = stream_chunk(self.order.seed, self.order.rank, c, self._cdf,
                                       self.same_system_across_ranks)
            self._chunk_id = c
        return int(self._chunk[step - c * STREAM_CHUNK])

    def next_key(self) -> BatchKey:
        """Hand out the next key and advance the stream."""
        step = self._step
        sid = self._draw(step)
        occ = int(self._counts[sid])
        self._counts[sid] = occ + 1
        self._step = step + 1
        return BatchKey(sid, self.order.fids(sid, occ), step)

    def __iter__(self) -> EpochIterator:
        """The rest of the current epoch: steps up to the next multiple of ``num_samples``.

        From a fresh or epoch-aligned position that is ``num_samples`` keys; after a resume in
        the middle of an epoch it is the rest of that epoch, as torchdata's loaders do.
        """
        return EpochIterator(self)

    def epoch_end(self) -> int:
        """The step at which the current epoch (one ``iter()``) ends."""
        return (self._step // self.num_samples + 1) * self.num_samples

    def __len__(self) -> int:
        return self.num_samples

    def seek(self, step: int) -> None:
        """Move the stream to ``step`` (forward or back) by replaying only the difference."""
        step = int(step)
        if step < 0:
            raise StateDictError(f"cannot seek to a negative step ({step})")
        args = (self.order.seed, self.order.rank)
        if step >= self._step:
            self._counts += stream_counts(*args, self._step, step, self._cdf,
                                          self.same_system_across_ranks)
        else:
            self._counts -= stream_counts(*args, step, self._step, self._cdf,
                                          self.same_system_across_ranks)
        self._step = step

    # -- state -----------------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, int]:
        """A versioned dict of integers; ``consumed`` overrides the position (see module doc)."""
        steps = self._step if consumed is None else int(consumed)
        if steps < 0:
            raise StateDictError(f"consumed must be >= 0, got {steps}")
        return {
            "version": STATE_VERSION, "seed": self.order.seed, "rank": self.order.rank,
            "world_size": self.order.world_size, "nsys": len(self.order.nframes),
            "sizes_digest": self._digest, "weights_digest": self._wdigest,
            "shuffle": int(self.order.shuffle),
            "same_system_across_ranks": int(self.same_system_across_ranks), "steps": steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; another job's state is rejected quoting both values."""
        mine = self.state_dict()
        check_keys(state, kind="sampler", version=STATE_VERSION, keys=mine)
        labels = {"seed": "seed", "rank": "rank", "world_size": "world size",
                  "nsys": "number of systems", "sizes_digest": "system sizes/batch sizes digest",
                  "weights_digest": "system probabilities digest", "shuffle": "shuffle",
                  "same_system_across_ranks": "same_system_across_ranks"}
        if self.adopt_seed and int(state["seed"]) != mine["seed"]:
            self._reseed(int(state["seed"]))
            mine["seed"] = self.order.seed
        for key, label in labels.items():
            check_same("sampler", label, int(state[key]), mine[key])
        self.seek(int(state["steps"]))

    def _reseed(self, seed: int) -> None:
        o = self.order
        self.order = FrameOrder(o.nframes, o.batch_sizes, seed=seed, rank=o.rank,
                                world_size=o.world_size, shuffle=o.shuffle)
        self._step, self._chunk_id = 0, -1
        self._counts[:] = 0


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
