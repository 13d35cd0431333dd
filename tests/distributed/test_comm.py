"""Framed packets (one process) and their broadcast over real gloo groups (2 and 4 ranks)."""

from __future__ import annotations

import pickle
import re
import threading
import time

import pytest
import torch
from distributed_utils import RankError, errors, run_ranks, values

from mdloader.distributed import channel, collectives, failure, group
from mdloader.distributed import packets as pk
from mdloader.errors import (
    CollectiveTimeoutError,
    ConfigError,
    DistributedError,
    MissingDataError,
    RemoteError,
    StopRequested,
)
from mdloader.settings import SETTINGS, resolve
from mdloader.world import World

# ----------------------------------------------------------------------------- one process


def test_data_packet_round_trip() -> None:
    packet = pk.data_packet({"a": [1, 2]}, rank=0, count=7)
    assert packet.kind is pk.Kind.DATA and packet.count == 7
    assert pk.open_packet(packet, rank=0) == {"a": [1, 2]}
    assert pk.open_packet(pk.STOP_PACKET, rank=0) is pk.Stop


def test_unpicklable_object_becomes_error_packet() -> None:
    packet = pk.data_packet([threading.Lock()], rank=0, context="batch serialization failed",
                              describe=lambda exc: {"system": "/d/sys"})
    assert packet.kind is pk.Kind.ERROR
    with pytest.raises(RemoteError, match=r"rank 0 failed \(batch serialization failed\): "
                                          r"TypeError: cannot pickle.*\[system: /d/sys\]") as info:
        pk.open_packet(packet, rank=0)
    assert isinstance(info.value.__cause__, TypeError)
    assert "Traceback" in info.value.traceback_text


def test_error_packet_carries_data_error_system_and_file() -> None:
    exc = MissingDataError("no coord.npy", system="/d/sys", file="/d/sys/set.000/coord.npy")
    packet = pk.error_packet(exc, rank=0, context="build", system="ignored")
    received = pk.Packet(packet.kind, packet.payload)  # as another rank sees it: no cause
    with pytest.raises(RemoteError, match="MissingDataError: no coord.npy; system: /d/sys; "
                                          "file: /d/sys/set.000/coord.npy") as info:
        pk.open_packet(received, rank=0)
    err = info.value
    assert (err.origin_rank, err.exc_type, err.system, err.file, err.context) == (
        0, "MissingDataError", "/d/sys", "/d/sys/set.000/coord.npy", "build")
    assert err.__cause__ is None
    assert pickle.loads(pickle.dumps(err)).file == err.file


def test_error_packet_takes_file_from_os_error() -> None:
    packet = pk.error_packet(PermissionError(13, "Permission denied", "/d/sys/type.raw"), rank=0,
                               context="build", system="/d/sys")
    with pytest.raises(RemoteError,
                       match=r"PermissionError.*\[system: /d/sys; file: /d/sys/type.raw\]"):
        pk.open_packet(packet, rank=0)


def test_unreadable_data_packet_is_a_distributed_error() -> None:
    with pytest.raises(DistributedError, match="could not unpickle a 3-byte packet"):
        pk.open_packet(pk.Packet(pk.Kind.DATA, b"xyz"), rank=0)


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


@pytest.mark.parametrize("backend, device", [
    ("gloo", "cpu"), ("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cpu"), ("mpi", "cpu"),
    ("NCCL", "cuda:3"), ("ucc", "cpu"),
])
def test_transport_device(backend: str, device: str) -> None:
    assert group.transport_device(backend, 3) == torch.device(device)


def test_current_world_without_process_group() -> None:
    assert group.current_world() == World()


# ----------------------------------------------------------------------------- real ranks


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
    assert max(e.finished_at for e in errs) - min(e.finished_at for e in errs) < 2.0


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
                       match=r"rank 1 waited 1\.\d s for the packet header from rank 0 "
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


def _group_cache(rank: int, world: int, port: int) -> tuple[bool, bool, bool]:
    import datetime
    import os

    import torch.distributed as dist

    first = group.cpu_group(5.0)
    other = group.cpu_group(6.0)
    same = group.cpu_group(5.0) is first and group.cpu_group(6.0) is other
    other_timeout = other is not first
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    fresh = group.cpu_group(6.0)
    chan = channel.Channel(fresh, timeout=5)
    got = pk.open_packet(chan.broadcast(pk.data_packet("hi", rank=0) if rank == 0 else None),
                         rank=rank)
    return same, other_timeout, fresh is not first and got == "hi"


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_cpu_group_is_reused_until_the_default_group_changes() -> None:
    from distributed_utils import free_port

    assert values(run_ranks(_group_cache, 2, free_port())) == [(True, True, True)] * 2


def test_header_tensor() -> None:
    header = pk.header_tensor(pk.Packet(pk.Kind.STOP, b"", 4))
    assert header.tolist() == [pk.MAGIC, pk.PROTOCOL_VERSION, int(pk.Kind.STOP), 0, 4]


# ---------------------------------------------------- gather / broadcast helpers of the jobs


def _gather(rank: int, world: int, poison: bool) -> object:
    obj = threading.Lock() if (poison and rank == world - 1) else {"rank": rank, "x": [rank] * 3}
    main = collectives.broadcast_from_main({"seed": 7} if rank == 0 else None)
    return main, collectives.gather_to_main(obj, context="gathering loader states")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_gather_to_main_and_broadcast_from_main_are_framed() -> None:
    got = values(run_ranks(_gather, 3, False))
    assert [main for main, _ in got] == [{"seed": 7}] * 3
    assert got[0][1] == [{"rank": r, "x": [r] * 3} for r in range(3)]
    assert got[1][1] is None and got[2][1] is None


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_gather_with_an_unpicklable_object_fails_every_rank() -> None:
    errs = errors(run_ranks(_gather, 3, True))
    assert len(errs) == 3
    for err in errs:
        assert err.exc_type == "RemoteError"
        assert "rank 2 failed (gathering loader states): TypeError: cannot pickle" in err.message
    assert max(e.finished_at for e in errs) - min(e.finished_at for e in errs) < 5


# ------------------------------------------------------------- failures during a job


def _flags_and_failures(rank: int, world: int) -> tuple[list[bool], str]:
    flags = collectives.any_rank([rank == 1, False, rank == 0], activity="a test step")
    mine = MissingDataError("gone", system="/d/s", file="/d/s/set.001/force.npy") \
        if rank == 1 else None
    try:
        collectives.fail_together(mine, context="training step 9")
    except RemoteError as exc:
        return flags, exc.summary
    raise AssertionError("fail_together did not raise")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_any_rank_and_fail_together() -> None:
    got = values(run_ranks(_flags_and_failures, 3))
    assert [flags for flags, _ in got] == [[True, False, True]] * 3
    assert {line for _, line in got} == {
        "rank 1 failed (training step 9): MissingDataError: gone; system: /d/s; "
        "file: /d/s/set.001/force.npy"}


def _settle(rank: int, world: int) -> tuple[bool, float, bool, float]:
    start = time.monotonic()
    alone = failure.settle(100, world, seconds=1.0) if rank == 0 else time.sleep(1.5)
    waited = time.monotonic() - start
    start = time.monotonic()
    together = failure.settle(101, world, seconds=30.0)
    return bool(alone), waited, together, time.monotonic() - start


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_the_failure_barrier_is_bounded_on_every_rank() -> None:
    """A rank that does not come is waited for ``seconds`` at most (gloo's monitored_barrier
    bounds rank 0 only: the others wait for the whole group timeout)."""
    (alone, waited, together, quick), _ = values(run_ranks(_settle, 2))
    assert not alone and 1.0 <= waited < 1.4
    assert together and quick < 1.0


def _fail_alone(rank: int, world: int) -> tuple[str, str, bool]:
    import torch
    import torch.distributed as dist

    with group.process_group(failure.Activity("training step 3")):
        if rank == 1:
            raise MissingDataError("gone", system="/d/s", file="/d/s/set.001/force.npy")
        dist.all_reduce(torch.ones(1))  # waits for rank 1, which failed and left
    raise AssertionError("unreachable")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_that_fails_alone_names_itself_on_every_rank() -> None:
    """Rank 1 publishes its failure and leaves; rank 0's collective breaks at once and it raises
    rank 1's failure from the store, not its own broken connection."""
    errs = errors(run_ranks(_fail_alone, 2, init_group=False))  # process_group starts it
    for err in errs:
        assert err.exc_type == "RankFailedError", str(err)
        assert err.message.startswith(
            "rank 1 failed (training step 3): MissingDataError: gone; system: /d/s; "
            "file: /d/s/set.001/force.npy")
    assert errs[0].finished_at - errs[1].finished_at < 5  # not the group's timeout (600 s)


def _killed_without_a_word(rank: int, world: int) -> None:
    import os

    import torch
    import torch.distributed as dist

    with group.process_group(failure.Activity("training step 5")):
        if rank == 1:
            os._exit(9)  # as a SIGKILL would: nothing published
        dist.all_reduce(torch.ones(1))


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_killed_outright_is_named_as_a_rank_that_left() -> None:
    rank0, rank1 = run_ranks(_killed_without_a_word, 2, init_group=False)
    assert rank1.exc_type == "ProcessDied" and rank0.exc_type == "RankFailedError", rank0
    assert re.match(r"rank 0 failed \(training step 5\): DistributedError: another rank left "
                    r"the job during training step 5 \(it failed or was killed: see its own "
                    r"output and the launcher's\); gloo: .*Connection (closed|reset) by peer",
                    rank0.message), rank0.message


def _stopped_after_a_peer_failed(rank: int, world: int) -> None:
    import torch.distributed as dist

    with group.process_group(failure.Activity("building the loader")):
        if rank == 1:
            raise MissingDataError("gone", system="/d/s", file="/d/s/set.001/force.npy")
        store = dist.distributed_c10d._get_default_store()
        while not store.check(["mdloader/job0/failure"]):  # rank 1 published its failure
            time.sleep(0.01)
        raise StopRequested("SIGTERM")  # what the launcher's SIGTERM raises before step 1


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_stopped_because_a_peer_failed_reports_the_failure() -> None:
    """torchrun sends SIGTERM to the other ranks once one has failed: a rank stopped that way
    before the first step prints the failure, the same line as the failing rank, not its stop."""
    errs = errors(run_ranks(_stopped_after_a_peer_failed, 2, init_group=False))
    assert [e.exc_type for e in errs] == ["RankFailedError", "RankFailedError"], errs
    assert {e.message.splitlines()[0] for e in errs} == {
        "rank 1 failed (building the loader): MissingDataError: gone; system: /d/s; "
        "file: /d/s/set.001/force.npy"}
