"""Packets from rank 0 to the other ranks of a gloo group: broadcast, timeout, header, agree."""

from __future__ import annotations

import time

import pytest
import torch
from support.distributed_utils import RankError, errors, run_ranks, values

from mdloader.distributed import channel, group
from mdloader.distributed import packets as pk
from mdloader.errors import (
    CollectiveTimeoutError,
    ConfigError,
    DistributedError,
    MissingDataError,
    RemoteError,
)
from mdloader.settings import SETTINGS, resolve
from mdloader.world import World


@pytest.mark.parametrize("name, env, default", [
    ("build_timeout", "MDLOADER_BUILD_TIMEOUT", 1800.0),
    ("collective_timeout", "MDLOADER_COLLECTIVE_TIMEOUT", 300.0),
])
def test_resolve_timeout(monkeypatch: pytest.MonkeyPatch, name: str, env: str,
                         default: float) -> None:
    assert SETTINGS[name].env == env
    monkeypatch.delenv(env, raising=False)
    assert resolve(name) == default
    monkeypatch.setenv(env, "12.5")
    assert resolve(name) == 12.5
    assert resolve(name, 3, argument="timeout") == 3.0
    monkeypatch.setenv(env, "soon")
    with pytest.raises(ConfigError, match=f"{env}: expected a number of seconds, found 'soon'"):
        resolve(name)
    with pytest.raises(ConfigError, match="timeout: expected at least 0.001 seconds, found 0"):
        resolve(name, 0, argument="timeout")


def _broadcast_object(rank: int, world: int, obj: object) -> tuple[object, int, World]:
    chan = channel.world_channel(timeout=20, activity="testing")
    packet = pk.data_packet(obj, rank=0, count=len(obj)) if rank == 0 else None
    got = chan.broadcast(packet)
    chan.agree(pk.digest(got.payload), None)
    return pk.open_packet(got, rank=rank), got.count, group.current_world()


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("size", [1000, 100_000])
def test_broadcast_reaches_every_rank(world: int, size: int) -> None:
    obj = {"x": list(range(size)), "s": "é" * 10, "t": torch.arange(size)}
    got = values(run_ranks(_broadcast_object, world, obj))
    for g in got:
        assert g[0]["x"] == obj["x"] and torch.equal(g[0]["t"], obj["t"])
    assert [g[1] for g in got] == [len(obj)] * world
    assert [g[2] for g in got] == [World(r, world, r, world) for r in range(world)]


def _broadcast_failure(rank: int, world: int, mode: str) -> None:
    chan = channel.world_channel(timeout=20, activity="testing")
    packet = None
    if rank == 0:
        if mode == "error":
            try:
                raise MissingDataError("no coord.npy", system="/d/s", file="/d/s/set.000/coord.npy")
            except MissingDataError as exc:
                packet = pk.error_packet(exc, rank=0, context="building systems")
        else:
            packet = pk.data_packet(lambda: 0, rank=0, context="list serialization failed")
    pk.open_packet(chan.broadcast(packet), rank=rank)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, pattern", [
    ("error", r"rank 0 failed \(building systems\): MissingDataError: no coord.npy; system: /d/s; "
              r"file: /d/s/set.000/coord.npy"),
    ("unpicklable", r"rank 0 failed \(list serialization failed\): (PicklingError|AttributeError)"),
])
def test_error_packet_is_raised_on_every_rank(mode: str, pattern: str) -> None:
    errs = errors(run_ranks(_broadcast_failure, 3, mode))
    for err in errs:
        assert err.exc_type == "RemoteError"
        with pytest.raises(RemoteError, match=pattern):
            raise err.exception
        assert "Traceback" in err.exception.traceback_text
    spread = max(e.finished_at for e in errs) - min(e.finished_at for e in errs)
    print(f"the {len(errs)} ranks raised within {spread:.3f} s")
    # measured 0.001-0.016 s: 2 s is a hang guard (5-10 times that would be a timing test on a
    # busy machine), a tenth of the 20 s a rank left waiting for the packet would take
    assert spread < 2.0


def _slow_source(rank: int, world: int) -> None:
    chan = channel.world_channel(timeout=1.0, setting="build_timeout",
                                 activity="building the systems")
    if rank == 0:
        time.sleep(3)
        chan.broadcast(pk.data_packet([1], rank=0))
    else:
        chan.broadcast(None)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_receiver_timeout_says_rank0_may_still_be_building() -> None:
    outcomes = run_ranks(_slow_source, 2)
    err = outcomes[1]
    assert isinstance(err, RankError) and err.exc_type == "CollectiveTimeoutError"
    with pytest.raises(CollectiveTimeoutError,
                       match=r"rank 1 waited [1-9]\d*\.\d s for the packet header from rank 0 "
                             r"\(timeout 1 s\): rank 0 may still be building the systems; raise "
                             r"the timeout argument or \$MDLOADER_BUILD_TIMEOUT"):
        raise err.exception


def _bad_header(rank: int, world: int, field: int) -> None:
    import torch.distributed as dist

    chan = channel.world_channel(timeout=20, activity="testing")
    if rank == 0:
        header = pk.header_tensor(pk.Packet(pk.Kind.DATA, b""))
        header[field] = 99
        dist.broadcast(header, src=0, group=chan.group)
    else:
        chan.broadcast(None)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("field, pattern", [
    (0, r"rank 1 received a packet with magic 0x63 from rank 0, expected 0x4d444c44504b54"),
    (1, r"rank 1 speaks packet protocol 1, rank 0 sent 99: mixed mdloader versions"),
    (2, r"rank 1 received a malformed header from rank 0: kind=99, length=0"),
])
def test_receiver_validates_header(field: int, pattern: str) -> None:
    err = run_ranks(_bad_header, 2, field)[1]
    assert isinstance(err, RankError)
    with pytest.raises(DistributedError, match=pattern):
        raise err.exception


def _agree(rank: int, world: int, case: str) -> None:
    chan = channel.world_channel(timeout=20, activity="testing")
    payload = b"same"
    problem = None
    if case == "digest" and rank in (1, 3):
        payload = b"other"
    if case == "problem" and rank == 2:
        problem = "entries [4, 7] are None"
    chan.agree(pk.digest(payload), problem)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_agree_names_ranks_with_another_digest() -> None:
    for err in errors(run_ranks(_agree, 4, "digest")):
        with pytest.raises(DistributedError, match=r"payload digest differs from rank 0's on "
                                                   r"ranks \[1, 3\]"):
            raise err.exception


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_agree_fails_every_rank_when_one_rank_has_a_problem() -> None:
    errs = errors(run_ranks(_agree, 4, "problem"))
    with pytest.raises(DistributedError, match=r"rank 2: entries \[4, 7\] are None \(verification "
                                               r"failed on ranks \[2\]\)"):
        raise errs[2].exception
    for rank in (0, 1, 3):
        with pytest.raises(DistributedError, match=rf"verification of the broadcast failed on "
                                                   rf"ranks \[2\]; rank {rank} was fine"):
            raise errs[rank].exception
