"""One restore test for every stateful class: save after k items, restore into a fresh object,
and the rest of the stream must be exactly what the uninterrupted object yields next.

The cases follow lhotse's sampler-restoring tests: k = 0, inside the first epoch, exactly at an
epoch's end, and in a later epoch; with 0 and 2 DataLoader workers where a loader is involved,
including torchdata's ``StatefulDataLoader`` driving mdloader's sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from mdloader import BroadcastingDataLoader, DpLoaderSet, Stateful, get_weighted_sampler
from mdloader.errors import StateDictError
from mdloader.sampling.stateful_loader import StatefulLoader
from mdloader.testing import make_system
from mdloader.transport import identity

EPOCH = 12  # keys per epoch (num_samples)
TYPE_MAP = ["O", "H"]


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


def _loader_set(systems: list[str]) -> DpLoaderSet:
    return DpLoaderSet(systems, 2, TYPE_MAP, seed=11)


def _sampler(systems: list[str]) -> Any:
    return get_weighted_sampler(_loader_set(systems), "prob_sys_size", num_samples=EPOCH)


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


def _stateful_loader(systems: list[str], workers: int) -> StatefulLoader:
    ls = _loader_set(systems)
    sampler = get_weighted_sampler(ls, "prob_sys_size", num_samples=EPOCH)
    return StatefulLoader(ls, sampler, num_workers=workers)


def _torchdata_loader(systems: list[str], workers: int) -> StatefulDataLoader:
    ls = _loader_set(systems)
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
    import mdloader.loader as loader
    import mdloader.sampling.samplers as samplers
    import mdloader.sampling.stateful_loader as stateful_loader

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
