"""Frame permutations, sharding across ranks and the per-rank system stream (pure).

Everything here is a function of integers (seed, system index, pass, rank, world size, sizes)
returning numpy arrays, so a whole rank grid is a one-process unit test and a resumed run
recomputes the order from a handful of integers instead of saving it.

Seeding. Every random array is drawn from its own ``numpy.random.Generator`` built from
``SeedSequence(seed, spawn_key=(TAG, ...))``. ``SeedSequence`` hashes all the words together, so
neighbouring seeds, systems, passes or ranks give unrelated streams (unlike ``seed + rank``), and
two systems of the same size never share a permutation (DeePMD-kit's ``DistributedSampler`` with
the default ``seed=0`` gives them the same one, and the same again on every pass).

Frames of one system. Pass ``p`` through system ``sid`` uses the permutation
:func:`frame_permutation` ``(seed, sid, p)``, identical on every rank. Like
``torch.utils.data.DistributedSampler``, the permutation is padded by wrapping around to
``ceil(F / W) * W`` frames and rank ``r`` takes positions ``r, r + W, r + 2W, ...``
(:func:`shard_frames`). Across ranks, pass ``p`` therefore covers every frame once, plus
``ceil(F/W)*W - F`` repeated frames (the first ones of the permutation) when W does not divide F;
with F < W some ranks repeat frames of the pass. Batches are consecutive slices of B of the shard;
the last may be short (``drop_last=False``). A rank has ``nb = ceil(ceil(F/W)/B)`` batches per pass.

System stream. Step ``k`` of rank ``r`` draws a system index with probabilities ``p`` by
inverse CDF from uniforms of chunk ``k // STREAM_CHUNK``, seeded from ``(seed, r, chunk)``; in
``same_system_across_ranks`` mode the rank is left out so that all ranks draw the same system at
each step (and still read disjoint frames, because their per-system counters agree). After an
elastic resume (:mod:`mdloader.sampling.elastic`) generation ``g >= 1`` of the job draws its
systems and the permutations of its fresh passes (numbered from 0) from keys that also hold ``g``,
so the new ranks never replay the draws or the passes of an earlier generation.
"""

from __future__ import annotations

import numbers
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from mdloader.errors import ConfigError
from mdloader.sampling.batching import batches_per_rank

TAG_FRAMES = 0x4652414D   # "FRAM": per-system frame permutations
TAG_STREAM = 0x5354524D   # "STRM": per-rank system stream
TAG_SHARED = 0x53484152   # "SHAR": system stream shared by all ranks
TAG_ELASTIC = 0x454C5354  # "ELST": per-rank system stream of generation g >= 1
TAG_ELASTIC_SHARED = 0x454C5348  # "ELSH": shared system stream of generation g >= 1
TAG_ELASTIC_FRAMES = 0x454C4652  # "ELFR": frame permutations of generation g >= 1
STREAM_CHUNK = 4096
"""Draws per stream chunk: each chunk has its own generator, so draw k is random access."""
SEED_MOD = 2**64


class AgreedSeed(NamedTuple):
    """A job seed every rank holds, and whether the user gave it (a saved state with another
    seed is then refused) or it was drawn at random (a saved state's seed is adopted)."""

    value: int
    given: bool


def normalize_seed(seed: int | Sequence[int] | None, rank: int = 0) -> int | None:
    """Reduce a user seed to one non-negative int shared by all ranks (or None).

    DeePMD-kit's ``main`` passes ``[rank, seed % 2**32]`` to ``DpLoaderSet``; frame permutations
    must be identical on every rank, so a two-element list whose first element is this rank is read
    as that convention and its second element is the job seed. Any other list is hashed into one
    int with ``SeedSequence`` (it must then be the same on every rank).
    """
    if seed is None:
        return None
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        return int(seed) % SEED_MOD
    if isinstance(seed, (list, tuple, np.ndarray)) and all(
            isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in seed) and seed:
        words = [int(s) % SEED_MOD for s in seed]
        if len(words) == 2 and words[0] == rank:
            return words[1]
        return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])
    raise ConfigError(f"seed must be an int, a list of ints or None, got {seed!r}", path="seed")


def _generator(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def frame_key(sid: int, pass_: int, generation: int = 0) -> tuple[int, ...]:
    """The ``SeedSequence`` spawn key of the permutation of pass ``pass_`` of system ``sid``.

    Generation 0 keeps the keys of a job that never changed its number of ranks; generation
    ``g >= 1`` (after an elastic resume) numbers its passes from 0 under keys that hold ``g``.
    """
    if generation == 0:
        return (TAG_FRAMES, sid, pass_)
    return (TAG_ELASTIC_FRAMES, generation, sid, pass_)


def frame_permutation(seed: int, sid: int, pass_: int, nframes: int,
                      shuffle: bool = True, generation: int = 0) -> np.ndarray:
    """The order of the frames of system ``sid`` in pass ``pass_`` of generation ``generation``
    (same on every rank)."""
    if not shuffle:
        return np.arange(nframes, dtype=np.int64)
    key = frame_key(sid, pass_, generation)
    return _generator(seed, *key).permutation(nframes).astype(np.int64)


def shard_frames(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s part of ``order``, padded by wrapping like ``DistributedSampler``.

    Every rank gets ``ceil(len(order) / world_size)`` entries, in an array of its own (a copy,
    so holding a shard does not keep the whole padded permutation alive).
    """
    n = len(order)
    per_rank = -(-n // world_size)
    total = per_rank * world_size
    if total > n:
        order = np.resize(order, total)   # repeats from the start: DistributedSampler's padding
    return order[rank:total:world_size].copy()


def rank_frames(seed: int, sid: int, pass_: int, nframes: int, rank: int, world_size: int,
                shuffle: bool = True, generation: int = 0) -> np.ndarray:
    """The frames rank ``rank`` reads from system ``sid`` during pass ``pass_`` (of generation
    ``generation``), in order."""
    return shard_frames(frame_permutation(seed, sid, pass_, nframes, shuffle, generation), rank,
                        world_size)


def statistics_frame_counts(nframes: np.ndarray | Sequence[int],
                            batch_sizes: np.ndarray | Sequence[int], nbatch: int) -> np.ndarray:
    """How many frames each system gives the input statistics (:func:`statistics_frames`'s
    lengths, without drawing them): ``min(nbatch, batches) x batch size``, at most its frames."""
    nframes = np.asarray(nframes, dtype=np.int64)
    sizes = np.asarray(batch_sizes, dtype=np.int64)
    return np.minimum(np.minimum(-(-nframes // sizes), int(nbatch)) * sizes, nframes)


def statistics_frames(seed: int, sid: int, nframes: int, batch_size: int, nbatch: int,
                      shuffle: bool = True) -> np.ndarray:
    """The frames system ``sid`` gives the input statistics: its first ``nbatch`` batches of pass
    0 on one rank (DeePMD-kit's ``make_stat_input`` on a one-rank job), whatever the world size,
    so the statistics are the same on every rank count."""
    keep = int(statistics_frame_counts([nframes], [batch_size], nbatch)[0])
    return rank_frames(seed, sid, 0, nframes, 0, 1, shuffle)[:keep]


def batch_of_shard(shard: np.ndarray, batch_index: int, batch_size: int) -> np.ndarray:
    """Batch ``batch_index`` of a shard: a slice of ``batch_size`` (the last may be short)."""
    return shard[batch_index * batch_size:(batch_index + 1) * batch_size]


def occurrence_to_batch(occurrence: int, nbatches: int) -> tuple[int, int]:
    """The ``occurrence``-th draw of a system reads batch ``j`` of pass ``p``: (p, j)."""
    return divmod(int(occurrence), int(nbatches))


def weights_to_cdf(probs: np.ndarray) -> np.ndarray:
    """Cumulative distribution for inverse-CDF draws; zero-probability systems are never drawn.

    Entries from the last positive probability on are set to exactly 1.0, so rounding in the
    cumulative sum cannot make a trailing zero-probability system reachable.
    """
    p = np.asarray(probs, dtype=np.float64)
    if len(p) == 0 or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise ConfigError(f"system probabilities must be finite, >= 0 and not all 0, got {p}")
    cdf = np.cumsum(p)
    last = int(np.flatnonzero(p > 0)[-1])
    cdf /= cdf[last]
    cdf[last:] = 1.0
    return cdf


def stream_key(rank: int, chunk: int, same_system_across_ranks: bool = False,
               generation: int = 0) -> tuple[int, ...]:
    """The ``SeedSequence`` spawn key of one chunk of a system stream.

    Generation 0 keeps the keys of a job that never changed its number of ranks.
    """
    if generation == 0:
        return (TAG_SHARED, chunk) if same_system_across_ranks else (TAG_STREAM, rank, chunk)
    if same_system_across_ranks:
        return (TAG_ELASTIC_SHARED, generation, chunk)
    return (TAG_ELASTIC, generation, rank, chunk)


def stream_chunk(seed: int, rank: int, chunk: int, cdf: np.ndarray,
                 same_system_across_ranks: bool = False, generation: int = 0) -> np.ndarray:
    """System indices drawn at steps ``[chunk * STREAM_CHUNK, (chunk + 1) * STREAM_CHUNK)``."""
    key = stream_key(rank, chunk, same_system_across_ranks, generation)
    u = _generator(seed, *key).random(STREAM_CHUNK)
    return np.searchsorted(cdf, u, side="right").astype(np.int64)


def stream_draws(seed: int, rank: int, start: int, stop: int, cdf: np.ndarray,
                 same_system_across_ranks: bool = False, generation: int = 0) -> np.ndarray:
    """System indices of steps ``[start, stop)`` of rank ``rank``'s stream."""
    if stop <= start:
        return np.empty(0, dtype=np.int64)
    first, last = start // STREAM_CHUNK, (stop - 1) // STREAM_CHUNK
    parts = [stream_chunk(seed, rank, c, cdf, same_system_across_ranks, generation)
             for c in range(first, last + 1)]
    joined = np.concatenate(parts)
    offset = first * STREAM_CHUNK
    return joined[start - offset:stop - offset]


def stream_counts(seed: int, rank: int, start: int, stop: int, cdf: np.ndarray,
                  same_system_across_ranks: bool = False, generation: int = 0) -> np.ndarray:
    """How often each system is drawn in steps ``[start, stop)``: the per-system cursors.

    Computed chunk by chunk, with one ``bincount`` per batch of chunks holding at least as many
    draws as there are systems, so replaying a million steps costs a few hundred small arrays.
    """
    counts = np.zeros(len(cdf), dtype=np.int64)
    pending: list[np.ndarray] = []
    held = 0
    pos = start
    while pos < stop:
        end = min(stop, (pos // STREAM_CHUNK + 1) * STREAM_CHUNK)
        pending.append(stream_draws(seed, rank, pos, end, cdf, same_system_across_ranks,
                                    generation))
        held += end - pos
        pos = end
        if held >= len(cdf) or pos >= stop:
            counts += np.bincount(np.concatenate(pending), minlength=len(cdf))
            pending, held = [], 0
    return counts


def sizes_digest(*arrays: np.ndarray | Sequence[int] | Sequence[float]) -> int:
    """A 32-bit CRC of integer/float arrays: detects a different system list on resume."""
    crc = 0
    for arr in arrays:
        a = np.ascontiguousarray(arr)
        a = a.astype(np.float64 if a.dtype.kind == "f" else np.int64)
        crc = zlib.crc32(np.int64(len(a)).tobytes(), crc)
        crc = zlib.crc32(a.tobytes(), crc)
    return int(crc)


PIECE = np.dtype([("sid", np.int64), ("generation", np.int64), ("world", np.int64),
                  ("rank", np.int64), ("pass_", np.int64), ("start", np.int64),
                  ("stop", np.int64)])
"""One piece of a leftover: entries ``[start, stop)`` of rank ``rank``'s shard (of ``world``
ranks) of pass ``pass_`` of generation ``generation`` of system ``sid``; ``stop`` never reaches
the shard's wrap-around padding, so a piece holds real frames only."""


def real_shard_lengths(nframes: np.ndarray | int, rank: int,
                       world_size: int) -> np.ndarray:
    """How many entries of rank ``rank``'s shard are real frames, not the wrap-around padding:
    the positions ``rank, rank + W, ...`` below the number of frames."""
    n = np.asarray(nframes, dtype=np.int64)
    return np.maximum(0, -(-(n - rank) // world_size))


@dataclass(frozen=True, eq=False)
class Continuation:
    """Where one rank continues in generation ``generation`` after an elastic resume.

    The first draws of system ``sid`` read its leftover -- the frames of :attr:`pieces` of that
    system, in order -- in batches; the draws after them read the fresh passes of
    ``generation``, numbered from 0. The pieces are a flat array sorted by system
    (:attr:`offsets`); lengths are arithmetic, and a system's frames are drawn only when asked
    for (:meth:`frames`). Built by :mod:`mdloader.sampling.elastic`.
    """

    generation: int
    nsys: int
    pieces: np.ndarray
    offsets: np.ndarray = field(init=False, repr=False)
    lengths: np.ndarray = field(init=False, repr=False)
    """Leftover frames of every system: ``[nsys]``."""

    def __post_init__(self) -> None:
        sid = self.pieces["sid"]
        if len(sid) and np.any(np.diff(sid) < 0):
            raise ValueError("the pieces of a continuation must be sorted by system")
        object.__setattr__(self, "offsets",
                           np.searchsorted(sid, np.arange(self.nsys + 1)).astype(np.int64))
        sizes = self.pieces["stop"] - self.pieces["start"]
        object.__setattr__(self, "lengths", np.bincount(sid, weights=sizes, minlength=self.nsys)
                           .astype(np.int64))

    @classmethod
    def of_pieces(cls, generation: int, nsys: int, pieces: np.ndarray) -> Continuation:
        """The continuation of ``pieces`` in any order of systems (kept in order within one)."""
        pieces = pieces[np.argsort(pieces["sid"], kind="stable")]
        return cls(int(generation), int(nsys), pieces[pieces["stop"] > pieces["start"]])

    @property
    def total(self) -> int:
        """Leftover frames of all systems."""
        return int(self.lengths.sum())

    def system(self, sid: int) -> np.ndarray:
        """The pieces of system ``sid``, in the order they are served."""
        return self.pieces[self.offsets[sid]:self.offsets[sid + 1]]

    def rest(self, served: np.ndarray) -> np.ndarray:
        """The pieces left once the first ``served[sid]`` frames of every system were served
        (arithmetic: the pieces served whole are dropped, the one served in part starts later)."""
        p = self.pieces
        size = p["stop"] - p["start"]
        before = np.cumsum(size) - size   # frames of the pieces before, all systems
        before -= np.concatenate(([0], np.cumsum(self.lengths)))[p["sid"]]
        skip = np.clip(np.asarray(served, dtype=np.int64)[p["sid"]] - before, 0, size)
        out = p.copy()
        out["start"] += skip
        return out[out["start"] < out["stop"]]

    def frames(self, sid: int, seed: int, nframes: int, shuffle: bool = True) -> np.ndarray:
        """The leftover frames of system ``sid``: one permutation per (generation, pass) among
        its pieces."""
        parts, perms = [], {}
        for piece in self.system(sid).tolist():
            _, gen, world, rank, pass_, start, stop = piece
            perm = perms.get((gen, pass_))
            if perm is None:
                perm = perms[gen, pass_] = frame_permutation(seed, sid, pass_, nframes, shuffle,
                                                             gen)
            parts.append(perm[rank + world * start:rank + world * (stop - 1) + 1:world])
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class FrameOrder:
    """Which frames the n-th batch of system ``sid`` holds on this rank.

    The n-th draw of a system reads batch ``n % nb`` of pass ``n // nb``; a pass is a fresh
    permutation shared by all ranks and sharded across them. With a :class:`Continuation` of
    generation ``g``, the draws first read this rank's leftover of the system, then the passes of
    generation ``g`` from pass 0. Shards of recently used (system, pass) pairs and the leftovers
    of recently drawn systems are kept in one LRU cache of at most ``cache_frames`` frame ids
    (8 bytes each: 8 MiB by default) in at most ``cache_entries`` arrays (one array larger than
    ``cache_frames`` is kept alone), so memory does not grow with the number of systems; each
    cached array owns its frames (no view of a permutation), and a miss costs one permutation
    (a leftover: one per pass among its pieces).
    """

    def __init__(self, nframes: Sequence[int] | np.ndarray, batch_sizes: Sequence[int] | np.ndarray,
                 *, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True,
                 continuation: Continuation | None = None,
                 cache_frames: int = 1 << 20, cache_entries: int = 4096) -> None:
        self.nframes = np.asarray(nframes, dtype=np.int64)
        self.batch_sizes = np.asarray(batch_sizes, dtype=np.int64)
        if len(self.nframes) != len(self.batch_sizes):
            raise ConfigError(f"{len(self.batch_sizes)} batch sizes for {len(self.nframes)} "
                              "systems")
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, world_size), got rank {self.rank} of "
                              f"{self.world_size}")
        self.shuffle = bool(shuffle)
        self.nbatches = batches_per_rank(self.nframes, self.batch_sizes, self.world_size)
        self.continuation = continuation
        self.generation = 0 if continuation is None else continuation.generation
        """The generation whose fresh passes this rank reads (0: the job never changed size)."""
        self._cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._cached = 0
        self._budget = int(cache_frames)
        self._max_entries = max(1, int(cache_entries))

    def _cached_array(self, key: tuple[int, int], make: Callable[[], np.ndarray]) -> np.ndarray:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        made = make()
        self._cache[key] = made
        self._cached += len(made)
        while len(self._cache) > 1 and (self._cached > self._budget
                                        or len(self._cache) > self._max_entries):
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)
        return made

    def shard(self, sid: int, pass_: int) -> np.ndarray:
        """The calling rank's frames of system ``sid`` for pass ``pass_`` of its generation
        (cached)."""
        return self._cached_array((sid, pass_), lambda: rank_frames(
            self.seed, sid, pass_, int(self.nframes[sid]), self.rank, self.world_size,
            self.shuffle, self.generation))

    def leftover(self, sid: int) -> np.ndarray:
        """The leftover frames of system ``sid`` on this rank (cached; empty without one)."""
        if self.continuation is None:
            return np.empty(0, dtype=np.int64)
        cont = self.continuation
        return self._cached_array((sid, -1), lambda: cont.frames(
            sid, self.seed, int(self.nframes[sid]), self.shuffle))

    def fids(self, sid: int, occurrence: int) -> tuple[int, ...]:
        """Frame ids of the ``occurrence``-th batch drawn from system ``sid``."""
        size = int(self.batch_sizes[sid])
        if self.continuation is not None:
            leftover_batches = -(-int(self.continuation.lengths[sid]) // size)
            if occurrence < leftover_batches:
                return tuple(batch_of_shard(self.leftover(sid), occurrence, size).tolist())
            occurrence -= leftover_batches
        pass_, j = occurrence_to_batch(occurrence, int(self.nbatches[sid]))
        return tuple(batch_of_shard(self.shard(sid, pass_), j, size).tolist())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"], state["_cached"] = OrderedDict(), 0
        return state

    def clear(self) -> None:
        self._cache.clear()
        self._cached = 0


__all__ = [
    "STREAM_CHUNK", "PIECE", "Continuation", "FrameOrder", "normalize_seed", "frame_key",
    "frame_permutation", "shard_frames", "real_shard_lengths", "rank_frames",
    "statistics_frame_counts", "statistics_frames", "batch_of_shard", "occurrence_to_batch",
    "weights_to_cdf",
    "stream_key", "stream_chunk", "stream_draws", "stream_counts", "sizes_digest",
]
