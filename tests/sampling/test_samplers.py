"""Stateful sampler: keys, passes, continuation across iter(), exact resume with workers."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from mdloader.errors import StateDictError
from mdloader.loading.stateful_loader import StatefulLoader
from mdloader.sampling.order import FrameOrder
from mdloader.sampling.samplers import BatchKey, WeightedSystemSampler

NFRAMES = [80, 13, 7, 1, 40]
BSIZES = [4, 2, 3, 1, 5]
PROBS = [0.3, 0.2, 0.2, 0.1, 0.2]


def make(rank=0, world=1, seed=7, **kw):
    return WeightedSystemSampler(NFRAMES, BSIZES, PROBS, seed=seed, rank=rank, world_size=world,
                                 **kw)


class KeyEcho(Dataset):
    """Reads nothing: returns the key, so tests see exactly what workers were asked for."""

    def __len__(self) -> int:
        return len(NFRAMES)

    def __getitem__(self, key):
        return (key.sid, key.fids, key.step)


def test_keys_shape_and_weights():
    s = make(num_samples=50)
    keys = list(s)
    assert len(keys) == 50 == len(s)
    assert all(isinstance(k, BatchKey) for k in keys)
    assert [k.step for k in keys] == list(range(50))
    for k in keys:
        assert 1 <= len(k.fids) <= BSIZES[k.sid] and all(0 <= f < NFRAMES[k.sid] for f in k.fids)
    assert isinstance(s.weights, torch.Tensor) and s.weights.dtype == torch.double
    np.testing.assert_allclose(s.weights.numpy(), PROBS)
    assert make().num_samples == sum(int(np.ceil(f / b)) for f, b in zip(NFRAMES, BSIZES))


def test_each_pass_of_a_system_is_a_permutation_and_passes_differ():
    s = make(num_samples=3000)
    by_sys = defaultdict(list)
    for k in s:
        by_sys[k.sid].append(k.fids)
    for sid, batches in by_sys.items():
        nb = -(-NFRAMES[sid] // BSIZES[sid])
        passes = [sum(batches[i:i + nb], ()) for i in range(0, len(batches) - nb + 1, nb)]
        assert len(passes) >= 2
        for p in passes:
            assert sorted(p) == list(range(NFRAMES[sid]))
        if NFRAMES[sid] > 2:
            assert len(set(passes)) > 1, "frames were not reshuffled across passes"


def test_iter_continues_the_stream():
    a = make(num_samples=37)
    first, second = list(a), list(a)
    b = make(num_samples=74)
    assert first + second == list(b)


def test_deterministic_and_seed_dependent():
    assert list(make(num_samples=100)) == list(make(num_samples=100))
    assert list(make(num_samples=100)) != list(make(seed=8, num_samples=100))


@pytest.mark.parametrize("world", range(1, 9))
def test_rank_grid_coverage(world):
    # Every rank runs its own stream; once all ranks finished pass p of a system, pass p covered
    # every frame (padding aside).
    seen = defaultdict(list)     # (sid, pass) -> frames from all ranks
    done = defaultdict(int)      # (sid, pass) -> ranks that completed it
    for r in range(world):
        s = make(rank=r, world=world, num_samples=600)
        counts = np.zeros(len(NFRAMES), dtype=int)
        for k in s:
            nb = s.order.nbatches[k.sid]
            p = counts[k.sid] // nb
            counts[k.sid] += 1
            seen[(k.sid, p)].extend(k.fids)
            if counts[k.sid] % nb == 0:
                done[(k.sid, p)] += 1
    full = [key for key, n in done.items() if n == world]
    assert full
    for sid, p in full:
        frames = seen[(sid, p)]
        per_rank = -(-NFRAMES[sid] // world)
        assert len(frames) == per_rank * world
        assert set(frames) == set(range(NFRAMES[sid]))


def test_same_system_across_ranks():
    world = 4
    streams = [list(make(rank=r, world=world, num_samples=200, same_system_across_ranks=True))
               for r in range(world)]
    for step in range(200):
        keys = [st[step] for st in streams]
        assert len({k.sid for k in keys}) == 1
        sid = keys[0].sid
        if NFRAMES[sid] % (world * BSIZES[sid]) == 0:
            frames = [f for k in keys for f in k.fids]
            assert len(frames) == len(set(frames)), "ranks read the same frame"
    default = [list(make(rank=r, world=world, num_samples=200)) for r in range(world)]
    assert any(len({st[i].sid for st in default}) > 1 for i in range(200))


def test_state_roundtrip_and_seek():
    a = make(num_samples=500)
    head = [a.next_key() for _ in range(123)]
    state = a.state_dict()
    assert state["steps"] == 123 and state["history"] == []
    assert all(isinstance(v, int) for k, v in state.items() if k != "history")
    rest = [a.next_key() for _ in range(300)]
    b = make(num_samples=500)
    b.load_state_dict(state)
    assert [b.next_key() for _ in range(300)] == rest
    b.seek(10)
    assert [b.next_key() for _ in range(5)] == head[10:15]
    b.seek(5000)
    c = make()
    c.seek(5000)
    assert b.next_key() == c.next_key()


@pytest.mark.parametrize("change,match", [
    (dict(world=2), "world size 1 but this loader has 2"),
    (dict(seed=8), "seed 7 but this loader has 8"),
])
def test_load_rejects_other_jobs(change, match):
    saved = make().state_dict()
    other = make(**change)
    with pytest.raises(StateDictError, match=match):
        other.load_state_dict(saved)


def test_load_rejects_other_systems_and_bad_states():
    saved = make().state_dict()
    fewer = WeightedSystemSampler(NFRAMES[:4], BSIZES[:4], [0.25] * 4, seed=7)
    with pytest.raises(StateDictError, match="number of systems 5 but this loader has 4"):
        fewer.load_state_dict(saved)
    resized = WeightedSystemSampler([81] + NFRAMES[1:], BSIZES, PROBS, seed=7)
    with pytest.raises(StateDictError, match="system sizes/batch sizes digest"):
        resized.load_state_dict(saved)
    reweighted = WeightedSystemSampler(NFRAMES, BSIZES, [0.2] * 5, seed=7)
    with pytest.raises(StateDictError, match="system probabilities digest"):
        reweighted.load_state_dict(saved)
    rank1 = make(rank=1, world=2)
    with pytest.raises(StateDictError, match="rank 0 but this loader has 1"):
        rank1.load_state_dict(dict(saved, world_size=2))
    with pytest.raises(StateDictError, match=r"unknown keys \['extra'\]"):
        make().load_state_dict(dict(saved, extra=1))
    with pytest.raises(StateDictError, match=r"lacks keys \['steps'\]"):
        make().load_state_dict({k: v for k, v in saved.items() if k != "steps"})
    with pytest.raises(StateDictError, match="version 99 is not supported"):
        make().load_state_dict(dict(saved, version=99))


def _drain(loader, n=None):
    out = []
    for item in loader:
        out.append(item)
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_loader_resume_is_exact(num_workers):
    # torchdata style: read k, save, drain; a fresh loader restored yields exactly the rest.
    k = 23
    a = StatefulLoader(KeyEcho(), make(num_samples=60), num_workers=num_workers)
    head = _drain(a, k)
    state = a.state_dict()
    assert state["sampler"]["steps"] == k
    if num_workers:
        assert a.sampler.position > k, "workers prefetch: the sampler runs ahead"
    rest = _drain(a) + _drain(a)          # the rest of this epoch, then one more epoch
    b = StatefulLoader(KeyEcho(), make(num_samples=60), num_workers=num_workers)
    b.load_state_dict(state)
    assert _drain(b) + _drain(b) == rest
    assert [h[2] for h in head] == list(range(k))
    steps = [r[2] for r in rest]
    assert steps == list(range(k, k + len(rest))), "a batch was skipped or repeated"


def test_sampler_state_with_consumed_matches_plain_dataloader():
    sampler = make(num_samples=60)
    dl = DataLoader(KeyEcho(), sampler=sampler, batch_size=None, num_workers=2,
                    collate_fn=lambda b: b)
    it = iter(dl)
    head = [next(it) for _ in range(10)]
    state = sampler.state_dict(consumed=10)
    rest = list(it)
    fresh = make(num_samples=60)
    fresh.load_state_dict(state)
    replay = [(k.sid, k.fids, k.step) for k in (fresh.next_key() for _ in range(len(rest)))]
    assert replay == rest and len(head) == 10


def test_no_duplicates_with_workers():
    sampler = make(num_samples=400)
    dl = DataLoader(KeyEcho(), sampler=sampler, batch_size=None, num_workers=2,
                    collate_fn=lambda b: b)
    got = list(dl)
    expected = [(k.sid, k.fids, k.step) for k in make(num_samples=400)]
    assert got == expected


def test_bad_rank():
    from mdloader.errors import ConfigError
    with pytest.raises(ConfigError, match="rank must be in"):
        make(rank=1, world=1)


def test_frame_order_cache_is_bounded():
    order = FrameOrder([1000] * 50, [10] * 50, seed=0, cache_frames=3000)
    for sid in range(50):
        order.fids(sid, 0)
    assert order._cached <= 3000 and len(order._cache) <= 3
    assert order.fids(0, 0) == FrameOrder([1000], [10], seed=0).fids(0, 0)


def test_cached_shard_owns_its_frames():
    # A view would keep the whole padded permutation of the system alive while cached.
    for world in (1, 4):
        order = FrameOrder([1001], [10], seed=0, rank=world - 1, world_size=world)
        shard = order.shard(0, 0)
        assert shard.base is None and shard.flags.owndata
        assert len(shard) == -(-1001 // world)


def test_adopt_seed_for_unseeded_runs():
    a = make(seed=123)
    [a.next_key() for _ in range(17)]
    state = a.state_dict()
    rest = [a.next_key() for _ in range(20)]
    b = make(seed=999, adopt_seed=True)
    b.load_state_dict(state)
    assert [b.next_key() for _ in range(20)] == rest
    with pytest.raises(StateDictError, match="seed 123 but this loader has 999"):
        make(seed=999).load_state_dict(state)


def test_a_refused_state_leaves_the_sampler_as_it_was():
    """Another job's state is refused before anything changes, the adopted seed included."""
    a = make(seed=123)
    [a.next_key() for _ in range(5)]
    foreign = a.state_dict()
    foreign["nsys"] += 1
    b = make(seed=999, adopt_seed=True)
    [b.next_key() for _ in range(3)]
    before = b.state_dict()
    with pytest.raises(StateDictError, match="number of systems"):
        b.load_state_dict(foreign)
    assert b.state_dict() == before and b.order.seed == 999
