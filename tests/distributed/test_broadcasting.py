"""BroadcastingDataLoader: fake-mesh unit tests, then real 2- and 4-rank gloo groups."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.distributed_utils import run_ranks, values

from mdloader.distributed import broadcasting as bc
from mdloader.distributed.packets import Kind, Packet, data_packet
from mdloader.errors import ConfigError, DistributedError, RemoteError, StateDictError
from mdloader.testing import make_system
from mdloader.world import World

# ----------------------------------------------------------------------------- fakes


class FakeMesh:
    """The parts of ``DeviceMesh`` the loader uses, for rank ``rank`` of ``shape``."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...], rank: int) -> None:
        self.mesh_dim_names = names
        self.mesh = torch.arange(int(np.prod(shape))).reshape(shape)
        self.rank = rank
        self.groups: list[str] = []

    def get_coordinate(self) -> list[int]:
        return [int(c) for c in (self.mesh == self.rank).nonzero()[0]]

    def get_local_rank(self, name: str) -> int:
        return self.get_coordinate()[self.mesh_dim_names.index(name)]

    def get_group(self, name: str) -> tuple[str, int, str]:
        self.groups.append(name)
        return ("group", id(self), name)


class FakeChannel:
    """Records what the source sends; receivers get ``inbox`` packets."""

    sent: list[Packet] = []
    inbox: list[Packet] = []
    made: list[Any] = []

    def __init__(self, group: Any, *, timeout: float, activity: str = "", remedy: str = "",
                 source: bool = True) -> None:
        FakeChannel.made.append(group)
        self.group, self.is_source, self.src_global, self.global_rank = group, source, 0, 0

    def broadcast(self, packet: Packet | None) -> Packet:
        if packet is not None:
            FakeChannel.sent.append(packet)
            return packet
        return FakeChannel.inbox.pop(0)


@pytest.fixture
def fake_dist(monkeypatch: pytest.MonkeyPatch) -> type[FakeChannel]:
    FakeChannel.sent, FakeChannel.inbox, FakeChannel.made = [], [], []
    monkeypatch.setattr(bc, "current_world", lambda: World(rank=0, world_size=2))
    monkeypatch.setattr(bc, "Channel", FakeChannel)
    monkeypatch.setattr(bc, "subgroup", lambda ranks: ("subgroup", tuple(ranks)))
    return FakeChannel


class Source:
    def __init__(self, items: list[Any], fail_iter: bool = False) -> None:
        self.items, self.fail_iter, self.loaded = items, fail_iter, None

    def __iter__(self) -> Iterator[Any]:
        if self.fail_iter:
            raise OSError("cannot open shard list")
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def state_dict(self) -> dict[str, int]:
        return {"pos": 3}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded = state


# ----------------------------------------------------------------------------- one process


def test_source_ranks_of_a_dp_cp_tp_mesh() -> None:
    sources = [r for r in range(8) if bc.is_source_rank(FakeMesh(("dp", "cp", "tp"), (2, 2, 2), r))]
    assert sources == [0, 4]
    mesh = FakeMesh(("dp", "cp", "tp"), (2, 2, 2), 5)
    assert bc.submesh_ranks(mesh, ("cp", "tp")) == [4, 5, 6, 7]
    assert bc.submesh_ranks(mesh, ("tp",)) == [4, 5]
    assert bc.active_axes(mesh, ("cp", "tp", "ep")) == ("cp", "tp")  # absent axes: size 1


def test_axes_of_size_one_make_every_rank_a_source() -> None:
    assert all(bc.is_source_rank(FakeMesh(("dp", "tp"), (4, 1), r)) for r in range(4))
    assert bc.active_axes(FakeMesh(("dp", "tp"), (4, 1), 2), ("cp", "tp")) == ()


def test_without_process_group_the_loader_is_its_source() -> None:
    source = Source([1, 2, 3])
    loader = bc.BroadcastingDataLoader(source, FakeMesh(("tp",), (2,), 1))
    assert not loader.broadcasting and list(loader) == [1, 2, 3] and len(loader) == 3
    assert loader.state_dict() == {"version": 1, "source": {"pos": 3}}
    assert bc.broadcast_batch({"a": 1}) == {"a": 1}
    with pytest.raises(TypeError, match="has no len"):
        len(bc.BroadcastingDataLoader(iter([1])))


def test_wrong_source_argument_is_a_clear_error(fake_dist: type[FakeChannel]) -> None:
    with pytest.raises(ConfigError, match=r"source: rank 0 is the source rank of its group: pass "
                                          r"the real loader, not None"):
        bc.BroadcastingDataLoader(None, FakeMesh(("tp",), (2,), 0))
    with pytest.raises(ConfigError, match=r"source: rank 0 is not the source rank of its group: "
                                          r"pass source=None"):
        bc.BroadcastingDataLoader(Source([1]), FakeMesh(("tp",), (2,), 1))
    with pytest.raises(ConfigError, match="device_mesh: pass either device_mesh or group"):
        bc.is_source_rank(FakeMesh(("tp",), (2,), 1), group=object())


def test_iterator_creation_failure_sends_exactly_one_error_packet(
        fake_dist: type[FakeChannel]) -> None:
    loader = bc.BroadcastingDataLoader(Source([1], fail_iter=True), FakeMesh(("tp",), (2,), 0))
    with pytest.raises(RemoteError, match=r"rank 0 failed \(source iterator creation failed\): "
                                          r"OSError: cannot open shard list") as info:
        list(loader)
    assert isinstance(info.value.__cause__, OSError)
    assert [p.kind for p in fake_dist.sent] == [Kind.ERROR]


def test_source_sends_each_batch_then_stop(fake_dist: type[FakeChannel]) -> None:
    loader = bc.BroadcastingDataLoader(Source(["a", "b"]), FakeMesh(("tp",), (2,), 0))
    assert list(loader) == ["a", "b"]
    assert [(p.kind, p.count) for p in fake_dist.sent] == [
        (Kind.DATA, 0), (Kind.DATA, 1), (Kind.STOP, 2)]


def test_unpicklable_batch_becomes_an_error_packet(fake_dist: type[FakeChannel]) -> None:
    loader = bc.BroadcastingDataLoader(Source([1, threading.Lock()]), FakeMesh(("tp",), (2,), 0))
    it = iter(loader)
    assert next(it) == 1
    with pytest.raises(RemoteError,
                       match=r"\(batch serialization failed\): TypeError: cannot pickle"):
        next(it)
    assert [p.kind for p in fake_dist.sent] == [Kind.DATA, Kind.ERROR]


def test_receiver_checks_the_step(fake_dist: type[FakeChannel],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bc, "Channel", lambda group, **k: FakeChannel(group, source=False, **k))
    fake_dist.inbox = [data_packet("x", rank=0, count=0), data_packet("y", rank=0, count=5)]
    loader = bc.BroadcastingDataLoader(None, FakeMesh(("tp",), (2,), 1), length=7)
    it = iter(loader)
    assert next(it) == "x" and len(loader) == 7
    assert loader.state_dict() == {"version": 1, "source": None}
    with pytest.raises(DistributedError,
                       match="expected step 1 from source rank 0, received step 5"):
        next(it)
    with pytest.raises(TypeError, match="pass length= on the other ranks"):
        len(bc.BroadcastingDataLoader(None, FakeMesh(("tp",), (2,), 1)))


def test_groups_are_resolved_once_per_loader_never_by_mesh_id(fake_dist: type[FakeChannel]) -> None:
    mesh = FakeMesh(("dp", "tp"), (1, 2), 0)
    loader = bc.BroadcastingDataLoader(Source([1]), mesh)
    list(loader), list(loader)
    assert mesh.groups == ["tp"] and fake_dist.made == [("group", id(mesh), "tp")]
    del loader, mesh
    new = FakeMesh(("dp", "tp"), (1, 2), 0)  # often at the old address: must not matter
    list(bc.BroadcastingDataLoader(Source([1]), new))
    assert new.groups == ["tp"] and fake_dist.made[1] == ("group", id(new), "tp")


def test_several_axes_make_one_subgroup_of_the_submesh(fake_dist: type[FakeChannel]) -> None:
    mesh = FakeMesh(("dp", "cp", "tp"), (2, 2, 2), 4)
    list(bc.BroadcastingDataLoader(Source([1]), mesh))
    assert fake_dist.made == [("subgroup", (4, 5, 6, 7))] and mesh.groups == []


def test_state_dict_delegates_on_the_source(fake_dist: type[FakeChannel]) -> None:
    source = Source([1])
    loader = bc.BroadcastingDataLoader(source, FakeMesh(("tp",), (2,), 0))
    loader.load_state_dict({"version": 1, "source": {"pos": 1}})
    assert source.loaded == {"pos": 1}
    assert loader.state_dict() == {"version": 1, "source": {"pos": 3}}
    other = bc.BroadcastingDataLoader(None, FakeMesh(("tp",), (2,), 1))
    other.load_state_dict({"version": 1, "source": {"pos": 1}})
    assert other.state_dict() == {"version": 1, "source": None}


def test_a_source_rank_refuses_a_state_without_the_source_state(
        fake_dist: type[FakeChannel]) -> None:
    loader = bc.BroadcastingDataLoader(Source([1]), FakeMesh(("tp",), (2,), 0))
    with pytest.raises(StateDictError, match="saved state has source state None but this loader "
                       "has one to restore on its source rank; load the job state merged"):
        loader.load_state_dict({"version": 1, "source": None})
    with pytest.raises(StateDictError, match="version 2 is not supported"):
        loader.load_state_dict({"version": 2, "source": {"pos": 1}})
    with pytest.raises(StateDictError, match=r"unknown keys \['pos'\] and lacks keys \['source'\]"):
        loader.load_state_dict({"version": 1, "pos": 1})


# ----------------------------------------------------------------------------- real ranks

TYPE_MAP = ["O", "H"]


def _mesh(world: int, layout: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shapes = {"tp": ((world,), ("tp",)), "dp_tp": ((world // 2, 2), ("dp", "tp")),
              "cp_tp": ((1, 2, world // 2), ("dp", "cp", "tp"))}
    shape, names = shapes[layout]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _real_source(root: str, mesh: Any, num_samples: int = 8) -> Any:
    """Every rank builds (a collective); sources make the loader of their data-parallel rank."""
    from mdloader.loading.build import build_systems
    from mdloader.loading.loader import DpLoaderSet, get_weighted_sampler
    from mdloader.loading.stateful_loader import StatefulLoader
    from mdloader.world import World

    datasets = build_systems(root, TYPE_MAP)
    if not bc.is_source_rank(mesh):
        return None
    names = mesh.mesh_dim_names
    dp = (mesh.get_local_rank("dp"), mesh.mesh.shape[0]) if "dp" in names else (0, 1)
    ls = DpLoaderSet(datasets, 2, TYPE_MAP, seed=5, world=World(dp[0], dp[1]))
    return StatefulLoader(ls, get_weighted_sampler(ls, "prob_sys_size", num_samples=num_samples))


def _fingerprint(batch: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for key in sorted(batch):
        value = batch[key]
        h.update(key.encode())
        h.update(value.numpy().tobytes() if isinstance(value, torch.Tensor)
                 else repr(value).encode())
    return h.hexdigest()[:16]


def _lockstep(rank: int, world: int, root: str, layout: str) -> tuple[list[int], list[str]]:
    mesh = _mesh(world, layout)
    loader = bc.BroadcastingDataLoader(_real_source(root, mesh), mesh)
    ranks = bc.submesh_ranks(mesh, bc.active_axes(mesh, bc.DEFAULT_AXES))
    return ranks, [_fingerprint(b) for b in loader]


def _systems(root: Path) -> str:
    for i in range(3):
        make_system(root, f"s{i}", natoms=4 + i, nframes=6, seed=i)
    return str(root)


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world, layout", [(2, "tp"), (4, "dp_tp"), (4, "cp_tp")])
def test_group_members_see_the_source_batches_in_lockstep(tmp_path: Path, world: int,
                                                          layout: str) -> None:
    got = values(run_ranks(_lockstep, world, _systems(tmp_path), layout))
    for rank, (group, prints) in enumerate(got):
        assert len(prints) == 8 and prints == got[group[0]][1], (rank, group)
    if layout == "dp_tp":  # the two data-parallel groups read different batches
        assert got[0][1] != got[2][1]


class _Failing:
    def __init__(self, k: int, mode: str) -> None:
        self.k, self.mode = k, mode

    def __iter__(self) -> Iterator[Any]:
        if self.mode == "create":
            raise FileNotFoundError(2, "No such file", "/data/shards.txt")
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        for i in range(self.k):
            yield {"x": torch.full((3,), float(i))}
        if self.mode == "unpicklable":
            yield {"lock": threading.Lock()}
        raise ValueError(f"bad frame after {self.k} batches")


def _failing(rank: int, world: int, k: int, mode: str) -> tuple[list[float], RemoteError]:
    mesh = _mesh(world, "tp")
    loader = bc.BroadcastingDataLoader(_Failing(k, mode) if rank == 0 else None, mesh)
    received = []
    try:
        for batch in loader:
            received.append(float(batch["x"][0]))
    except RemoteError as exc:
        return received, exc
    raise AssertionError("the loop should have raised")


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, mode, k, pattern", [
    (2, "iterate", 3, r"\(source iterator failed\): ValueError: bad frame after 3 batches"),
    (4, "iterate", 2, r"\(source iterator failed\): ValueError: bad frame after 2 batches"),
    (2, "create", 0, r"\(source iterator creation failed\): FileNotFoundError: .*No such file.*"
                     r"\[file: /data/shards.txt\]"),
    (2, "unpicklable", 2, r"\(batch serialization failed\): TypeError: cannot pickle"),
])
def test_source_failure_reaches_every_member_at_the_same_step(world: int, mode: str, k: int,
                                                              pattern: str) -> None:
    outcomes = run_ranks(_failing, world, k, mode)
    for received, exc in values(outcomes):
        with pytest.raises(RemoteError, match="rank 0 failed " + pattern):
            raise exc
        assert received == [float(i) for i in range(k)]
    assert max(o.finished_at for o in outcomes) - min(o.finished_at for o in outcomes) < 3.0


def _break_and_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = _mesh(world, "tp")
    loader = bc.BroadcastingDataLoader(_real_source(root, mesh, num_samples=10), mesh)
    head = []
    for batch in loader:  # every rank breaks after the same step
        head.append(_fingerprint(batch))
        if len(head) == 3:
            break
    state = loader.state_dict()
    rest = [_fingerprint(b) for b in loader]  # a new pass continues: the group is still usable
    fresh = bc.BroadcastingDataLoader(_real_source(root, mesh, num_samples=10), mesh)
    fresh.load_state_dict(state)
    again = [_fingerprint(b) for b in fresh]
    return {"head": head, "rest": rest, "again": again, "state": state,
            "after": bc.broadcast_batch({"r": rank} if rank == 0 else None, device_mesh=mesh)}


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_early_break_and_resume_through_state_dict(tmp_path: Path) -> None:
    got = values(run_ranks(_break_and_resume, 2, _systems(tmp_path)))
    for g in got:
        assert len(g["head"]) == 3 and len(g["rest"]) == 7 and g["again"] == g["rest"]
        assert g["head"] == got[0]["head"] and g["rest"] == got[0]["rest"]
        assert g["after"] == {"r": 0}
    assert got[0]["state"]["source"]["sampler"] and got[1]["state"]["source"] is None
