"""Stateful samplers over :mod:`mdloader.sampling`: they decide batch composition in the main process.

The sampler yields :class:`BatchKey` ``(sid, fids, step)``: which frames of which system make the
next batch. ``DataLoader(loader_set, sampler=sampler, batch_size=None, num_workers=K, ...)`` hands
each key to a worker that only *reads* those frames (``DpLoaderSet.__getitem__(key)``), so the
union of what the workers yield is exactly this rank's stream: no batch twice, no frame skipped.
(DeePMD-kit's workers each advance a forked copy of per-system iterators and repeat batches.)

Resume state is a few integers (:meth:`WeightedSystemSampler.state_dict`); the per-system
cursors are recomputed by replaying the system stream, which is cheap because draws are
generated in vectorised chunks (:func:`mdloader.sampling.stream_counts`).

Prefetching. A DataLoader with workers pulls keys ahead of what the training loop has consumed,
so the sampler's own position is *ahead*. Two exact ways to save after k consumed batches:

- ``sampler.state_dict(consumed=k)``: k = keys consumed since the stream start (e.g. the trainer's
  step counter when the sampler started at 0). Exact for any ``num_workers``.
- :class:`StatefulLoader`, a thin DataLoader wrapper that counts what it yielded (torchdata's
  approach); its ``state_dict()`` is exact for any ``num_workers``, and a new ``iter()`` first
  rewinds the sampler to what was consumed, so prefetched-but-unused keys are not lost.

With ``num_workers=0`` the DataLoader pulls one key per batch, so ``sampler.state_dict()``
alone is exact too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .batching import batches_per_rank
from .errors import ConfigError, StateDictError
from .packets import tensor_as_numpy
from .sampling import (
    batch_of_shard, occurrence_to_batch, rank_frames, sizes_digest, stream_chunk,
    stream_counts, weights_to_cdf, STREAM_CHUNK,
)

STATE_VERSION = 1


class BatchKey(NamedTuple):
    """One batch: frames ``fids`` of system ``sid``; ``step`` is its index in the rank's stream."""

    sid: int
    fids: tuple[int, ...]
    step: int


class FrameOrder:
    """Which frames the n-th batch of system ``sid`` holds on this rank.

    The n-th draw of a system reads batch ``n % nb`` of pass ``n // nb``; a pass is a fresh
    permutation shared by all ranks and sharded across them. Shards of recently used
    (system, pass) pairs are kept in a small LRU cache bounded by ``cache_frames`` frame ids and
    ``cache_entries`` shards, so memory does not grow with the number of systems; a miss costs
    one permutation (about 30 us for 100 frames).
    """

    def __init__(self, nframes: Sequence[int] | np.ndarray, batch_sizes: Sequence[int] | np.ndarray,
                 *, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True,
                 cache_frames: int = 1 << 20, cache_entries: int = 4096) -> None:
        self.nframes = np.asarray(nframes, dtype=np.int64)
        self.batch_sizes = np.asarray(batch_sizes, dtype=np.int64)
        if len(self.nframes) != len(self.batch_sizes):
            raise ConfigError(f"{len(self.batch_sizes)} batch sizes for {len(self.nframes)} systems")
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, world_size), got rank {self.rank} of "
                              f"{self.world_size}")
        self.shuffle = bool(shuffle)
        self.nbatches = batches_per_rank(self.nframes, self.batch_sizes, self.world_size)
        self._cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._cached = 0
        self._budget = int(cache_frames)
        self._max_entries = max(1, int(cache_entries))

    def shard(self, sid: int, pass_: int) -> np.ndarray:
        """This rank's frames of system ``sid`` for pass ``pass_`` (cached)."""
        k = (sid, pass_)
        hit = self._cache.get(k)
        if hit is not None:
            self._cache.move_to_end(k)
            return hit
        shard = rank_frames(self.seed, sid, pass_, int(self.nframes[sid]), self.rank,
                            self.world_size, self.shuffle)
        self._cache[k] = shard
        self._cached += len(shard)
        while len(self._cache) > 1 and (self._cached > self._budget
                                        or len(self._cache) > self._max_entries):
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)
        return shard

    def fids(self, sid: int, occurrence: int) -> tuple[int, ...]:
        """Frame ids of the ``occurrence``-th batch drawn from system ``sid``."""
        pass_, j = occurrence_to_batch(occurrence, int(self.nbatches[sid]))
        return tuple(batch_of_shard(self.shard(sid, pass_), j, int(self.batch_sizes[sid])).tolist())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"], state["_cached"] = OrderedDict(), 0
        return state

    def clear(self) -> None:
        self._cache.clear()
        self._cached = 0


class WeightedSystemSampler(Sampler[BatchKey]):
    """Draw a system by probability, then the next batch of that system's frames on this rank.

    Parameters
    ----------
    nframes, batch_sizes
        Frames and batch size of every system (after any ``filter:N``).
    probs
        System probabilities (:func:`mdloader.probability.system_probabilities`).
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

    def __iter__(self) -> Iterator[BatchKey]:
        """The rest of the current epoch: steps up to the next multiple of ``num_samples``.

        From a fresh or epoch-aligned position that is ``num_samples`` keys; after a resume in
        the middle of an epoch it is the rest of that epoch, as torchdata's loaders do.
        """
        stop = (self._step // self.num_samples + 1) * self.num_samples
        while self._step < stop:
            yield self.next_key()

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
        """Restore from :meth:`state_dict`; a state of another job is rejected, quoting both values."""
        mine = self.state_dict()
        unknown = sorted(set(state) - set(mine))
        missing = sorted(set(mine) - set(state))
        if unknown or missing:
            raise StateDictError(f"sampler state has unknown keys {unknown} / lacks keys {missing}")
        if state["version"] != STATE_VERSION:
            raise StateDictError(f"sampler state version {state['version']} is not supported "
                                 f"(this mdloader writes version {STATE_VERSION})")
        labels = {"seed": "seed", "rank": "rank", "world_size": "world size",
                  "nsys": "number of systems", "sizes_digest": "system sizes/batch sizes digest",
                  "weights_digest": "system probabilities digest", "shuffle": "shuffle",
                  "same_system_across_ranks": "same_system_across_ranks"}
        if self.adopt_seed and int(state["seed"]) != mine["seed"]:
            self._reseed(int(state["seed"]))
            mine["seed"] = self.order.seed
        for key, label in labels.items():
            if int(state[key]) != mine[key]:
                raise StateDictError(f"cannot resume: the saved state has {label} "
                                     f"{state[key]} but this loader has {mine[key]}")
        self.seek(int(state["steps"]))

    def _reseed(self, seed: int) -> None:
        o = self.order
        self.order = FrameOrder(o.nframes, o.batch_sizes, seed=seed, rank=o.rank,
                                world_size=o.world_size, shuffle=o.shuffle)
        self._step, self._chunk_id = 0, -1
        self._counts[:] = 0


def _identity(batch: Any) -> Any:
    return batch


def _rebuild_batch(batch: dict, tensor_keys: tuple[Any, ...]) -> dict:
    """Unpickling side of :class:`TransportBatch`: a plain ``dict``, arrays back to tensors."""
    for k in tensor_keys:
        batch[k] = torch.from_numpy(batch[k])
    return batch


class TransportBatch(dict):
    """A batch ``dict`` that leaves a DataLoader worker with its tensors as numpy arrays.

    torch moves every tensor from a worker through its own shared-memory segment, about 0.5 ms
    per tensor here, i.e. ~150-200 batches/s for a 10-tensor DeePMD batch; pickled numpy arrays
    travel through the worker's pipe in microseconds. Unpickling (in the main process) rebuilds
    a plain ``dict`` with ``torch.from_numpy`` (zero copy), so the training loop sees the same
    keys, dtypes, shapes and values as without workers, whatever ``collate_fn`` passed it on.
    Only top-level CPU tensors are converted; anything else is pickled as usual.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[dict, tuple[Any, ...]]]:
        plain, keys = dict(self), []
        for k, v in plain.items():
            array = tensor_as_numpy(v)
            if array is not None:
                plain[k] = array
                keys.append(k)
        return _rebuild_batch, (plain, tuple(keys))


class NumpyTransport:
    """Worker side: wrap ``collate_fn``; a plain dict result becomes a :class:`TransportBatch`."""

    def __init__(self, collate_fn: Any = _identity) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: Any) -> Any:
        out = self.collate_fn(batch)
        return TransportBatch(out) if type(out) is dict else out


class StatefulLoader:
    """``DataLoader(dataset, sampler=sampler, batch_size=None, ...)`` that knows what it yielded.

    DataLoader delivers batches in sampler order, so counting yielded batches gives the exact
    stream position whatever ``num_workers`` and ``prefetch_factor`` are. ``state_dict()`` saves
    that position; a new ``iter()`` rewinds the sampler to it, so keys a previous iterator
    prefetched but never delivered are read again rather than skipped.

    With workers, batches cross the process boundary as numpy arrays (:class:`NumpyTransport`,
    ``numpy_transport=True``), which is an order of magnitude faster than torch's per-tensor
    shared memory for DeePMD's many small tensors; the yielded batches are the same.
    (:class:`~mdloader.loader.DpLoaderSet` already returns a :class:`TransportBatch` inside
    workers, so for it ``numpy_transport=False`` changes nothing.)
    """

    def __init__(self, dataset: Any, sampler: WeightedSystemSampler, *, num_workers: int = 0,
                 numpy_transport: bool = True, **dataloader_kwargs: Any) -> None:
        collate_fn = dataloader_kwargs.pop("collate_fn", _identity)
        if num_workers > 0 and numpy_transport:
            collate_fn = NumpyTransport(collate_fn)
        dataloader_kwargs["collate_fn"] = collate_fn
        self.sampler = sampler
        self.dataloader = DataLoader(dataset, sampler=sampler, batch_size=None,
                                     num_workers=num_workers, **dataloader_kwargs)
        self._consumed = sampler.position

    def __iter__(self) -> Iterator[Any]:
        if self.sampler.position != self._consumed:
            self.sampler.seek(self._consumed)
        for batch in self.dataloader:
            self._consumed += 1
            yield batch

    def __len__(self) -> int:
        return len(self.dataloader)

    @property
    def consumed(self) -> int:
        """Batches delivered since the stream start (the resume position)."""
        return self._consumed

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION,
                "sampler": self.sampler.state_dict(consumed=self._consumed)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) != {"version", "sampler"}:
            raise StateDictError(f"loader state must have keys ['sampler', 'version'], "
                                 f"got {sorted(state)}")
        if state["version"] != STATE_VERSION:
            raise StateDictError(f"loader state version {state['version']} is not supported "
                                 f"(this mdloader writes version {STATE_VERSION})")
        self.sampler.load_state_dict(state["sampler"])
        self._consumed = self.sampler.position
