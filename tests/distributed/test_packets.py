"""Framed packets in one process: data, a clean stop, errors that name the system and file."""

from __future__ import annotations

import pickle
import threading

import pytest

from mdloader.distributed import packets as pk
from mdloader.errors import (
    DistributedError,
    MissingDataError,
    RemoteError,
)


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


def test_header_tensor() -> None:
    header = pk.header_tensor(pk.Packet(pk.Kind.STOP, b"", 4))
    assert header.tolist() == [pk.MAGIC, pk.PROTOCOL_VERSION, int(pk.Kind.STOP), 0, 4]
