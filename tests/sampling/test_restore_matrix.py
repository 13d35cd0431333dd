"""One restore test for every stateful class: save after k items, restore into a fresh object,
and the rest of the stream must be exactly what the uninterrupted object yields next.

The cases follow lhotse's sampler-restoring tests: k = 0, inside the first epoch, exactly at an
epoch's end, and in a later epoch; with 0 and 2 DataLoader workers where a loader is involved,
including torchdata's ``StatefulDataLoader`` driving mdloader's sampler.

Then the elastic matrix: the states of W ranks (K workers) merged and loaded on W' ranks (K'
workers), W, W' in {1, 2, 4}, K -> K' in {0 -> 2, 2 -> 0}; the ranks played in one process for the
whole matrix and on real gloo groups for a subset. The same world size continues exactly; another
one serves exactly what the old ranks owed (counted by tests/support/elastic_ledger.py). The
classes whose state is per rank by nature refuse another world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from support.distributed_utils import run_ranks, values
from support.elastic_ledger import Ledger, by_drawer
from torchdata.stateful_dataloader import StatefulDataLoader

from mdloader import (
    BroadcastingDataLoader,
    DpLoaderSet,
    Stateful,
    get_weighted_sampler,
    merge_rank_states,
)
from mdloader.distributed.collectives import gather_to_main
from mdloader.errors import StateDictError
from mdloader.loading.stateful_loader import StatefulLoader
from mdloader.sampling.spec import SamplingSpec
from mdloader.testing import make_system
from mdloader.transport import identity
from mdloader.world import World

EPOCH = 12  # keys per epoch (num_samples)
TYPE_MAP = ["O", "H"]
BALANCE = 5  # steps per balanced window (not a divisor of EPOCH: windows straddle epochs)


@dataclass
class Case:
    """How to make one stateful object and read its stream from a position (items consumed)."""

    make: Callable[[], Any]
    stream: Callable[[Any, int], Iterator[Any]]
    ours: bool = True  # False: the state layout is torchdata's, validated by torchdata


@pytest.fixture(scope="module")
def systems(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("restore")
    return [make_system(root, f"sys{i}", natoms=3 + i, nframes=5 + 3 * i, seed=i)
            for i in range(3)]


def _loader_set(systems: list[str], balance: int = 0) -> DpLoaderSet:
    return DpLoaderSet(systems, 2, TYPE_MAP, seed=11,
                       spec=SamplingSpec(2, balance_window=balance))


def _sampler(systems: list[str], balance: int = 0) -> Any:
    return get_weighted_sampler(_loader_set(systems, balance), "prob_sys_size",
                                num_samples=EPOCH)


def _batches(loader: Any, position: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    """Batches as (sid, fids), re-entering the loader at the end of each epoch."""
    while True:
        for batch in loader:
            yield int(batch["sid"]), tuple(batch["fid"])


def _keys(sampler: Any, position: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    while True:
        for key in iter(sampler):
            yield key.sid, key.fids


def _epoch_iterator_keys(it: Any, position: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    for key in it:
        yield key.sid, key.fids


def _cursor_batches(ls: DpLoaderSet, position: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    """``ls[sid]`` for sid = 0, 1, 2, 0, ...: the cursors decide which frames come next."""
    sid = position % len(ls)
    while True:
        yield sid, tuple(ls[sid]["fid"])
        sid = (sid + 1) % len(ls)


def _stateful_loader(systems: list[str], workers: int, balance: int = 0) -> StatefulLoader:
    ls = _loader_set(systems, balance)
    sampler = get_weighted_sampler(ls, "prob_sys_size", num_samples=EPOCH)
    return StatefulLoader(ls, sampler, num_workers=workers)


def _torchdata_loader(systems: list[str], workers: int,
                      balance: int = 0) -> StatefulDataLoader:
    ls = _loader_set(systems, balance)
    sampler = get_weighted_sampler(ls, "prob_sys_size", num_samples=EPOCH)
    return StatefulDataLoader(ls, sampler=sampler, batch_size=None, num_workers=workers,
                              collate_fn=identity)


def _epoch_iterator(systems: list[str]) -> Any:
    sampler = _sampler(systems)
    return iter(sampler)


CASES: dict[str, Callable[[list[str]], Case]] = {
    "sampler": lambda s: Case(lambda: _sampler(s), _keys),
    "epoch-iterator": lambda s: Case(lambda: _epoch_iterator(s), _epoch_iterator_keys),
    "loader-set-cursors": lambda s: Case(lambda: _loader_set(s), _cursor_batches),
    "stateful-loader-0": lambda s: Case(lambda: _stateful_loader(s, 0), _batches),
    "stateful-loader-2": lambda s: Case(lambda: _stateful_loader(s, 2), _batches),
    "torchdata-0": lambda s: Case(lambda: _torchdata_loader(s, 0), _batches, ours=False),
    "torchdata-2": lambda s: Case(lambda: _torchdata_loader(s, 2), _batches, ours=False),
    "broadcasting-no-group": lambda s: Case(
        lambda: BroadcastingDataLoader(_stateful_loader(s, 0)), _batches),
    "balanced-sampler": lambda s: Case(lambda: _sampler(s, BALANCE), _keys),
    "balanced-stateful-loader-2": lambda s: Case(
        lambda: _stateful_loader(s, 2, BALANCE), _batches),
    "balanced-torchdata-2": lambda s: Case(lambda: _torchdata_loader(s, 2, BALANCE), _batches,
                                           ours=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("k", [0, 5, EPOCH, EPOCH + 7])
def test_restore_continues_exactly(systems: list[str], name: str, k: int) -> None:
    case = CASES[name](systems)
    if name == "epoch-iterator":
        k = min(k, EPOCH - 3)  # a single epoch: save inside it
    reference = case.make()
    assert isinstance(reference, Stateful)
    stream = case.stream(reference, 0)
    for _ in range(k):
        next(stream)
    state = reference.state_dict()
    expected = [next(stream, None) for _ in range(EPOCH)]
    restored = case.make()
    restored.load_state_dict(state)
    rest = case.stream(restored, k)
    assert [next(rest, None) for _ in range(EPOCH)] == expected


@pytest.mark.parametrize("name", sorted(n for n in CASES if CASES[n]([]).ours))
def test_a_state_that_does_not_fit_is_refused(systems: list[str], name: str) -> None:
    obj = CASES[name](systems).make()
    with pytest.raises(StateDictError, match="state has unknown keys"):
        obj.load_state_dict({"version": 2, "unknown": 1})


def test_every_stateful_class_is_in_the_matrix() -> None:
    import mdloader.distributed.broadcasting as broadcasting
    import mdloader.loading.loader as loader
    import mdloader.loading.stateful_loader as stateful_loader
    import mdloader.sampling.samplers as samplers

    classes = {cls for mod in (broadcasting, loader, samplers, stateful_loader)
               for cls in vars(mod).values()
               if isinstance(cls, type) and cls.__module__ == mod.__name__
               and hasattr(cls, "state_dict") and hasattr(cls, "load_state_dict")}
    covered = {"BroadcastingDataLoader", "DpLoaderSet", "WeightedSystemSampler", "EpochIterator",
               "StatefulLoader"}
    assert {cls.__name__ for cls in classes} == covered


def test_restore_refuses_another_seed(systems: list[str]) -> None:
    state = _sampler(systems).state_dict()
    other = get_weighted_sampler(DpLoaderSet(systems, 2, TYPE_MAP, seed=12), "prob_sys_size",
                                 num_samples=EPOCH)
    with pytest.raises(StateDictError, match="seed 11 but this loader has 12"):
        other.load_state_dict(state)



def test_broadcasting_refuses_what_its_source_cannot_continue(systems: list[str]) -> None:
    """Its own checks (a source rank given a non-source rank's state), then its source's."""
    loader = BroadcastingDataLoader(_stateful_loader(systems, 0))
    with pytest.raises(StateDictError, match="the saved state has source state None but this "
                       "loader has one to restore on its source rank"):
        loader.load_state_dict({"version": 1, "source": None})
    state = loader.state_dict()
    assert state["version"] == 1 and set(state) == {"version", "source"}
    ls = DpLoaderSet(systems, 2, TYPE_MAP, seed=12)
    other = BroadcastingDataLoader(StatefulLoader(ls, get_weighted_sampler(
        ls, "prob_sys_size", num_samples=EPOCH), num_workers=0))
    with pytest.raises(StateDictError, match="seed 11 but this loader has 12"):
        other.load_state_dict(state)


def test_broadcasting_states_merge_without_the_non_source_ranks(systems: list[str]) -> None:
    state = BroadcastingDataLoader(_stateful_loader(systems, 0)).state_dict()
    job = merge_rank_states([{"version": 1, "source": None}, state])
    assert job == {"version": 1, "source": merge_rank_states([state["source"]])}

# -- elastic: a state saved on W ranks (K workers) resumes on W' ranks (K' workers) -------------

WORLDS = [1, 2, 4]
NEW_STEPS = 40


def _loader_on(systems: list[str], rank: int, world: int, workers: int,
               balance: int = 0) -> StatefulLoader:
    ls = DpLoaderSet(systems, 2, TYPE_MAP, seed=11, world=World(rank=rank, world_size=world),
                     spec=SamplingSpec(2, balance_window=balance))
    return StatefulLoader(ls, get_weighted_sampler(ls, "prob_sys_size", num_samples=EPOCH),
                          num_workers=workers)


def _sampler_on(systems: list[str], rank: int, world: int, workers: int,
                balance: int = 0) -> Any:
    ls = DpLoaderSet(systems, 2, TYPE_MAP, seed=11, world=World(rank=rank, world_size=world),
                     spec=SamplingSpec(2, balance_window=balance))
    return get_weighted_sampler(ls, "prob_sys_size", num_samples=EPOCH)


def _balanced_keys(sampler: Any, position: int) -> Iterator[Any]:
    """Whole keys: the ledger counts a balanced batch for the rank that drew it."""
    while True:
        yield from iter(sampler)


ELASTIC: dict[str, tuple[Callable[..., Any], Callable[[Any, int], Iterator[Any]]]] = {
    "sampler": (_sampler_on, _keys),
    "stateful-loader": (_loader_on, _batches),
    "broadcasting-no-group": (lambda *a: BroadcastingDataLoader(_loader_on(*a)), _batches),
    "balanced-sampler": (lambda *a: _sampler_on(*a, BALANCE), _balanced_keys),
    "balanced-stateful-loader": (lambda *a: _loader_on(*a, BALANCE), _batches),
}


def _ledger(systems: list[str]) -> Ledger:
    ls = DpLoaderSet(systems, 2, TYPE_MAP, seed=11)
    return Ledger(ls.nframes.tolist(), ls.batch_sizes.tolist(), seed=11)


def _check_elastic(ledger: Ledger, old: list[list[Any]], old_world: int, new: list[list[Any]],
                   new_world: int) -> None:
    """The new ranks serve exactly what the old ones owed, then W'-rank passes."""
    first = ledger.generation(old, old_world)
    owed = dict(ledger.owed)
    second = ledger.generation(new, new_world, drained=True)
    for sid, frames in owed.items():
        assert second["from_leftover"][sid] == frames
        assert first["prefix"][sid] + second["from_leftover"][sid] == first["units"][sid]


ELASTIC_CASES = [("sampler", (0, 0)), ("broadcasting-no-group", (0, 0)),
                 ("stateful-loader", (0, 2)), ("stateful-loader", (2, 0)),
                 ("balanced-sampler", (0, 0)), ("balanced-stateful-loader", (2, 0))]


@pytest.mark.parametrize("name,workers", ELASTIC_CASES,
                         ids=[f"{n}-K{a}-K{b}" for n, (a, b) in ELASTIC_CASES])
@pytest.mark.parametrize("new_world", WORLDS)
@pytest.mark.parametrize("old_world", WORLDS)
def test_elastic_restore(systems: list[str], name: str, old_world: int, new_world: int,
                         workers: tuple[int, int]) -> None:
    make, stream = ELASTIC[name]
    balanced = name.startswith("balanced")
    olds = [make(systems, r, old_world, workers[0]) for r in range(old_world)]
    old_streams = [stream(o, 0) for o in olds]
    # a balanced job changes its number of ranks from steps every rank took (inside a window)
    old = [[next(s) for _ in range(8 if balanced else 7 + 3 * r)]
           for r, s in enumerate(old_streams)]
    job = merge_rank_states([o.state_dict() for o in olds])
    news = [make(systems, r, new_world, workers[1]) for r in range(new_world)]
    for n in news:
        n.load_state_dict(job)
    new = [[next(s) for _ in range(NEW_STEPS)] for s in (stream(n, 0) for n in news)]
    if new_world == old_world:  # exact continuation
        assert new == [[next(s) for _ in range(NEW_STEPS)] for s in old_streams]
    elif name == "balanced-sampler":
        _check_elastic(_ledger(systems), by_drawer(old, old_world), old_world,
                       by_drawer(new, new_world), new_world)
    elif balanced:  # the loader serves what the balanced sampler (checked above) keys
        keys = [[k for _, k in zip(range(8), _balanced_keys(s, 0))]
                for s in (_sampler_on(systems, r, old_world, 0, BALANCE)
                          for r in range(old_world))]
        assert old == [[(k.sid, k.fids) for k in row] for row in keys]
        samplers = [_sampler_on(systems, r, new_world, 0, BALANCE) for r in range(new_world)]
        for s in samplers:
            s.load_state_dict(job["sampler"])
        assert new == [[(k.sid, k.fids) for _, k in zip(range(NEW_STEPS), _balanced_keys(s, 0))]
                       for s in samplers]
    else:
        _check_elastic(_ledger(systems), old, old_world, new, new_world)


@pytest.mark.parametrize("name", ["epoch-iterator", "loader-set-cursors", "torchdata-0"])
def test_per_rank_states_refuse_another_world_size(systems: list[str], name: str) -> None:
    """These states are per rank by nature: loading them on another world size is refused."""
    def make(world: int) -> Any:
        ls = DpLoaderSet(systems, 2, TYPE_MAP, seed=11, world=World(rank=0, world_size=world))
        if name == "loader-set-cursors":
            return ls
        sampler = get_weighted_sampler(ls, "prob_sys_size", num_samples=EPOCH)
        if name == "epoch-iterator":
            return iter(sampler)
        return StatefulDataLoader(ls, sampler=sampler, batch_size=None, collate_fn=identity)

    state = make(2).state_dict()
    with pytest.raises(StateDictError, match="world size 2 but this loader has 1"):
        fresh = make(1)
        fresh.load_state_dict(state)
        next(iter(fresh))  # torchdata restores the sampler's iterator when iteration starts


def _gloo_generation(rank: int, world: int, systems: list[str], workers: int, state: Any,
                     steps: list[int], balance: int = 0) -> tuple[list[Any], Any]:
    """One generation on a real gloo group: resume, read, and merge every rank's state."""
    loader = StatefulLoader(*_built(systems, balance), num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    batches = _batches(loader, 0)
    got = [next(batches) for _ in range(steps[rank])]
    states = gather_to_main(loader.state_dict())
    return got, None if states is None else merge_rank_states(states)


def _built(systems: list[str], balance: int = 0) -> tuple[DpLoaderSet, Any]:
    # rank and world size from the group
    ls = DpLoaderSet(systems, 2, TYPE_MAP, seed=11, spec=SamplingSpec(2, balance_window=balance))
    return ls, get_weighted_sampler(ls, "prob_sys_size", num_samples=EPOCH)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("old_world,new_world,workers", [(2, 1, (2, 0)), (2, 4, (0, 2)),
                                                         (4, 2, (2, 0)), (1, 2, (0, 0))])
def test_elastic_restore_on_gloo(systems: list[str], old_world: int, new_world: int,
                                 workers: tuple[int, int]) -> None:
    old = values(run_ranks(_gloo_generation, old_world, systems, workers[0], None,
                           [7 + 3 * r for r in range(old_world)], timeout=150, daemon=False))
    job = old[0][1]
    assert job["sampler"]["generations"][-1] == [old_world, *(7 + 3 * r for r in
                                                               range(old_world))]
    new = values(run_ranks(_gloo_generation, new_world, systems, workers[1], job,
                           [NEW_STEPS] * new_world, timeout=150, daemon=False))
    _check_elastic(_ledger(systems), [o[0] for o in old], old_world, [n[0] for n in new],
                   new_world)
    assert new[0][1]["sampler"]["generations"][0] == job["sampler"]["generations"][0]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_balanced_elastic_restore_on_gloo(systems: list[str]) -> None:
    """2 ranks (2 workers) -> 4 ranks, balanced: the batches are those the one-process balanced
    samplers key, which the ledger checks above."""
    old = values(run_ranks(_gloo_generation, 2, systems, 2, None, [8, 8], BALANCE, timeout=150,
                           daemon=False))
    job = old[0][1]
    assert job["sampler"]["balance_window"] == BALANCE
    new = values(run_ranks(_gloo_generation, 4, systems, 0, job, [NEW_STEPS] * 4, BALANCE,
                           timeout=150, daemon=False))
    samplers = [_sampler_on(systems, r, 4, 0, BALANCE) for r in range(4)]
    for s in samplers:
        s.load_state_dict(job["sampler"])
    assert [n[0] for n in new] == [
        [(k.sid, k.fids) for _, k in zip(range(NEW_STEPS), _balanced_keys(s, 0))]
        for s in samplers]
