"""Part (a) of the GPU check: mdloader's framed packets over a one-rank NCCL group, and a batch's
road from the worker pool to the GPU.

``python -m benchmarks.gpu.checks --backend nccl`` (``gloo``: the same on the CPU, the stand-in
where no GPU is) starts ``torch.distributed`` with that backend at W = 1 and checks, printing a
line each:

* the channel of the group puts its tensors on ``cuda:<local_rank>`` (NCCL) or the CPU (gloo);
* a batch broadcast from the source (header and body on that device) and gathered back (every
  member's receiving side: headers checked, bodies copied back to the host) arrives equal, every
  tensor on the host (a tensor sent from the GPU too);
* an error packet, broadcast or gathered, is raised on receipt as the same
  :class:`~mdloader.errors.RemoteError` (type, message, system and file), as on every rank;
* the flag all-reduce and the digest agreement run on the group;
* the pool's batches are pinned (workers 0 and 2) and reach the GPU by a non-blocking copy.

The last line is a JSON object (``ok``, the checks, the broadcast time of a 1 MiB packet); the
exit code is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mdloader.distributed import packets as pk
from mdloader.distributed.channel import Channel
from mdloader.distributed.group import transport_device, use_device
from mdloader.errors import MissingDataError, RemoteError
from mdloader.loading.pool import WorkerPool
from mdloader.transport import to_device
from mdloader.world import World


class CheckFailed(Exception):
    """A check whose outcome is not the expected one."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(device: torch.device) -> dict[str, Any]:
    """A water-like batch, one tensor on ``device`` (a GPU tensor must arrive on the host)."""
    gen = torch.Generator().manual_seed(0)
    return {"coord": torch.rand(2, 192, 3, dtype=torch.float64, generator=gen),
            "atype": torch.randint(0, 2, (2, 192), generator=gen, dtype=torch.int32),
            "sid": 3, "fid": [4, 5], "sent_from_device": torch.ones(3, device=device)}


def _same(got: dict[str, Any], sent: dict[str, Any]) -> None:
    for key, value in sent.items():
        if isinstance(value, torch.Tensor):
            if got[key].device.type != "cpu":
                raise CheckFailed(f"{key} arrived on {got[key].device}, not on the host")
            if not torch.equal(got[key], value.cpu()):
                raise CheckFailed(f"{key} arrived changed")
        elif got[key] != value:
            raise CheckFailed(f"{key} arrived as {got[key]!r}, sent {value!r}")


def _expect_remote(packet: pk.Packet, sent: MissingDataError) -> str:
    """Open ``packet`` as a receiver does; the RemoteError it raises must be ``sent``'s."""
    try:
        pk.open_packet(pk.Packet(packet.kind, packet.payload, packet.count), rank=0)
    except RemoteError as err:
        if (err.exc_type, err.exc_message, err.system, err.file) != (
                type(sent).__name__, str(sent), sent.system, sent.file):
            raise CheckFailed(f"the error arrived as {err}") from err
        return str(err).splitlines()[0]
    raise CheckFailed("an error packet opened without raising")


def check_channel(device: torch.device) -> dict[str, Any]:
    """The packet checks on the default group; what they measured."""
    expected = transport_device(dist.get_backend(), 0)
    channel = Channel(dist.group.WORLD, timeout=60.0, activity="the GPU check")
    if channel.device != expected or channel.device.type != device.type:
        raise CheckFailed(f"the channel of a {dist.get_backend()} group puts its tensors on "
                          f"{channel.device}, expected {expected}")
    print(f"(a) the {dist.get_backend()} channel puts its tensors on {channel.device}: ok")
    sent = _batch(device)
    packet = pk.data_packet(sent, rank=0, count=1)
    _same(pk.open_packet(channel.broadcast(packet), rank=0), sent)
    [back] = channel.gather(packet)
    _same(pk.open_packet(back, rank=0), sent)
    print(f"(a) a batch broadcast and gathered ({len(packet.payload)} bytes): arrives equal, "
          "every tensor on the host: ok")
    error = MissingDataError("no coord.npy in set.000", system="data/data_0",
                             file="data/data_0/set.000/coord.npy")
    failed = pk.error_packet(error, rank=0, context="the GPU check")
    line = _expect_remote(channel.broadcast(failed), error)
    _expect_remote(channel.gather(failed)[0], error)
    print(f"(a) an error packet, broadcast and gathered, is the same error: {line}: ok")
    if channel.any_set([True, False]) != [True, False]:
        raise CheckFailed("the flag all-reduce changed the flags")
    channel.agree(pk.digest(packet.payload), None)
    print("(a) flags and digest agreement: ok")
    big = pk.data_packet(bytes(2**20), rank=0)
    channel.broadcast(big)  # warm-up
    start = time.perf_counter()
    for _ in range(20):
        channel.broadcast(big)
    per = (time.perf_counter() - start) / 20 * 1e3
    print(f"(a) broadcast of a 1 MiB packet: {per:.2f} ms")
    return {"channel_device": str(channel.device), "broadcast_1mib_ms": round(per, 3)}


class _Frames(torch.utils.data.Dataset):
    """A batch per key, as a loader set returns one (a module-level class: workers pickle it)."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, key: int) -> dict[str, Any]:
        return {"coord": torch.full((1, 192, 3), float(key), dtype=torch.float64), "sid": key}


class _Keys:
    def __init__(self) -> None:
        self.key = -1

    def next_key(self) -> int:
        self.key += 1
        return self.key


def check_pinned(device: torch.device) -> None:
    """The pool pins its batches when the trainer's device is a GPU; the copy does not block."""
    pin = device.type == "cuda"
    for workers in (0, 2):
        pool = WorkerPool([_Frames()], [_Keys()], ["training"], itertools.repeat(0),
                          num_workers=workers, pin_memory=pin)
        try:
            batches = [pool.next_batch(0) for _ in range(3)]
        finally:
            pool.close()
        if [b["sid"] for b in batches] != [0, 1, 2]:
            raise CheckFailed(f"the pool delivered {[b['sid'] for b in batches]}")
        pinned = {b["coord"].is_pinned() for b in batches} if pin else {False}
        if pinned != {pin}:
            raise CheckFailed(f"workers={workers}: batches pinned {pinned}, expected {pin}")
        moved = [to_device(b["coord"], device) for b in batches]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if any(m.device != device or float(m[0, 0, 0]) != b["sid"]
               for m, b in zip(moved, batches)):
            raise CheckFailed(f"workers={workers}: a batch did not reach {device} intact")
    what = "pinned, copied to it without blocking" if pin else "not pinned (no GPU)"
    print(f"(a) the pool's batches (workers 0 and 2) reach {device}: {what}: ok")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    args = p.parse_args(argv)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                       "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    device = use_device(World()) if args.backend == "nccl" else torch.device("cpu")
    if args.backend == "nccl" and device.type != "cuda":
        print("(a) FAILED: NCCL needs a CUDA device and torch sees none")
        return 1
    result: dict[str, Any] = {"backend": args.backend, "device": str(device)}
    dist.init_process_group(args.backend, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        result.update(check_channel(device))
        check_pinned(device)
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - any failure is the check's outcome, printed
        print(f"(a) FAILED: {type(exc).__name__}: {exc}")
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
