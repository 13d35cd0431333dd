"""Pure sampling: rank grids W = 1..8 in one process (coverage, padding, reshuffle, determinism)."""
from __future__ import annotations

import numpy as np
import pytest

from mdloader.errors import ConfigError
from mdloader.sampling.batching import batches_per_rank
from mdloader.sampling.order import (
    STREAM_CHUNK,
    batch_of_shard,
    frame_permutation,
    normalize_seed,
    occurrence_to_batch,
    rank_frames,
    shard_frames,
    sizes_digest,
    statistics_frames,
    stream_counts,
    stream_draws,
    weights_to_cdf,
)

WORLDS = range(1, 9)
FRAMES = [1, 2, 3, 7, 8, 13, 80]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("nframes", FRAMES)
def test_pass_covers_every_frame_once_apart_from_padding(world, nframes):
    for pass_ in range(3):
        shards = [rank_frames(7, 2, pass_, nframes, r, world) for r in range(world)]
        per_rank = -(-nframes // world)
        assert all(len(s) == per_rank for s in shards)
        allf = np.concatenate(shards)
        counts = np.bincount(allf, minlength=nframes)
        assert counts.min() >= 1, "a frame was skipped"
        assert counts.sum() - nframes == per_rank * world - nframes, "unexpected padding"
        # padding repeats the first frames of the permutation (DistributedSampler's rule)
        perm = frame_permutation(7, 2, pass_, nframes)
        pad = per_rank * world - nframes
        expected = np.ones(nframes, dtype=int)
        np.add.at(expected, np.resize(perm, pad) if pad else np.empty(0, int), 1)
        np.testing.assert_array_equal(counts, expected)


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_disjoint_when_world_divides(world):
    nframes = 840  # divisible by 1..8
    shards = [set(rank_frames(1, 0, 0, nframes, r, world).tolist()) for r in range(world)]
    assert sum(len(s) for s in shards) == nframes
    assert set().union(*shards) == set(range(nframes))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("batch_size", [1, 3, 32])
def test_batches_partition_the_shard(world, batch_size):
    nframes = 80
    shard = rank_frames(3, 0, 0, nframes, world - 1, world)
    nb = int(batches_per_rank([nframes], [batch_size], world)[0])
    batches = [batch_of_shard(shard, j, batch_size) for j in range(nb)]
    np.testing.assert_array_equal(np.concatenate(batches), shard)
    assert all(len(b) == batch_size for b in batches[:-1]) and 1 <= len(batches[-1]) <= batch_size


def test_every_pass_is_a_new_permutation():
    perms = {tuple(frame_permutation(0, 0, p, 80)) for p in range(20)}
    assert len(perms) == 20


def test_equal_sizes_do_not_share_a_permutation():
    perms = {tuple(frame_permutation(0, sid, 0, 80)) for sid in range(50)}
    assert len(perms) == 50
    # nor do neighbouring seeds
    assert tuple(frame_permutation(1, 0, 0, 80)) != tuple(frame_permutation(0, 0, 0, 80))


def test_deterministic_by_seed():
    a = rank_frames(42, 5, 3, 80, 1, 4)
    b = rank_frames(42, 5, 3, 80, 1, 4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, rank_frames(43, 5, 3, 80, 1, 4))


def test_shuffle_false_is_in_order():
    np.testing.assert_array_equal(rank_frames(0, 0, 5, 7, 1, 2, shuffle=False), [1, 3, 5, 0])


def test_shard_frames_matches_distributed_sampler():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler

    for n in [1, 5, 8, 13]:
        for w in [1, 2, 3, 8]:
            for r in range(w):
                ds = DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=False)
                np.testing.assert_array_equal(shard_frames(np.arange(n), r, w), list(ds))
    assert torch is not None


@pytest.mark.parametrize("nframes", FRAMES)
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("nbatch", [1, 2, 10])
def test_statistics_frames_are_the_first_batches_of_a_one_rank_pass(nframes, batch_size, nbatch):
    """What DeePMD-kit's make_stat_input reads from a one-rank job: the first min(nbatch, nb)
    batches of pass 0, distinct frames, the same for every rank count (no world size in it)."""
    got = statistics_frames(5, 3, nframes, batch_size, nbatch)
    shard = rank_frames(5, 3, 0, nframes, 0, 1)
    nb = batches_per_rank([nframes], [batch_size], 1)[0]
    want = np.concatenate([batch_of_shard(shard, j, batch_size) for j in range(min(nbatch, nb))])
    assert got.tolist() == want.tolist()
    assert len(set(got.tolist())) == len(got) == min(nframes, nbatch * batch_size)
    assert statistics_frames(5, 4, nframes, batch_size, nbatch).tolist() == \
        statistics_frames(5, 4, nframes, batch_size, nbatch).tolist()
    assert statistics_frames(5, 3, nframes, batch_size, nbatch, shuffle=False).tolist() == \
        list(range(len(got)))


def test_occurrence_to_batch():
    assert occurrence_to_batch(0, 10) == (0, 0)
    assert occurrence_to_batch(23, 10) == (2, 3)


def test_stream_follows_probabilities_and_skips_zero():
    p = np.array([0.5, 0.0, 0.3, 0.2, 0.0])
    draws = stream_draws(11, 0, 0, 200_000, weights_to_cdf(p))
    freq = np.bincount(draws, minlength=5) / len(draws)
    np.testing.assert_allclose(freq, p, atol=0.005)
    assert freq[1] == 0 and freq[4] == 0


def test_stream_random_access_and_counts_agree():
    cdf = weights_to_cdf(np.ones(7))
    full = stream_draws(5, 1, 0, 3 * STREAM_CHUNK + 17, cdf)
    part = stream_draws(5, 1, STREAM_CHUNK - 3, 2 * STREAM_CHUNK + 5, cdf)
    np.testing.assert_array_equal(part, full[STREAM_CHUNK - 3:2 * STREAM_CHUNK + 5])
    counts = stream_counts(5, 1, 100, len(full), cdf)
    np.testing.assert_array_equal(counts, np.bincount(full[100:], minlength=7))


def test_stream_per_rank_and_shared_mode():
    cdf = weights_to_cdf(np.ones(10))
    ranks = [stream_draws(3, r, 0, 1000, cdf) for r in range(4)]
    assert len({tuple(x) for x in ranks}) == 4
    shared = [stream_draws(3, r, 0, 1000, cdf, same_system_across_ranks=True) for r in range(4)]
    assert len({tuple(x) for x in shared}) == 1


def test_shared_mode_disjoint_frames_across_ranks():
    # All ranks draw the same systems, so their per-system counters agree -> same pass and batch.
    nframes = np.array([12, 5, 9])
    world, bs = 3, 2
    cdf = weights_to_cdf(np.ones(3))
    draws = stream_draws(9, 0, 0, 60, cdf, same_system_across_ranks=True)
    nb = batches_per_rank(nframes, [bs] * 3, world)
    seen = {}
    counts = np.zeros(3, dtype=int)
    for sid in draws:
        p, j = occurrence_to_batch(counts[sid], nb[sid])
        counts[sid] += 1
        rows = [set(batch_of_shard(rank_frames(9, sid, p, nframes[sid], r, world), j, bs))
                for r in range(world)]
        if nframes[sid] % world == 0:
            assert not set.intersection(*rows) and sum(map(len, rows)) == len(set.union(*rows))
        for fr in set.union(*rows):
            seen.setdefault((sid, p), set()).add(fr)
    for (sid, p), frames in seen.items():
        if counts[sid] // nb[sid] > p:   # complete passes cover the whole system
            assert frames == set(range(nframes[sid]))


def test_weights_to_cdf_rejects_bad():
    with pytest.raises(ConfigError, match="not all 0"):
        weights_to_cdf(np.zeros(3))
    with pytest.raises(ConfigError):
        weights_to_cdf(np.array([0.5, np.nan]))


def test_normalize_seed():
    assert normalize_seed(None) is None
    assert normalize_seed(5) == 5
    assert normalize_seed(-1) == 2**64 - 1
    assert normalize_seed([1, 99], rank=1) == 99      # DeePMD main's [rank, seed]
    assert normalize_seed([0, 99], rank=0) == 99
    mixed = normalize_seed([3, 4, 5])
    assert isinstance(mixed, int) and mixed == normalize_seed((3, 4, 5))
    with pytest.raises(ConfigError, match="seed must be an int"):
        normalize_seed("7")


def test_sizes_digest():
    a = sizes_digest([80, 80], [1, 2])
    assert a == sizes_digest(np.array([80, 80]), np.array([1, 2]))
    assert a != sizes_digest([80, 80], [2, 1]) and a != sizes_digest([80, 80, 1], [1, 2])
