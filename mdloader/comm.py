"""The only module that talks to ``torch.distributed``: framed packets from one rank to a group.

Why framing: DeePMD-kit's build raises on rank 0 *before* the collective, so the other ranks hang
until the process-group timeout or die with "Connection closed by peer", never learning which
system was broken (DEEPMD-FORMAT.md §4.1). Here the sender first turns its outcome into a
:class:`Packet` -- data, a clean stop, or an error with the exception's type, message, system, file
and traceback -- and only then enters the collective. A fixed header (magic, protocol version,
kind, byte length, item count) travels first, then the bytes. Every receiver validates the header
and re-raises an error packet as :class:`~mdloader.errors.RemoteError`, so all ranks fail together
with the same message (the model is ``torch._utils.ExceptionWrapper``).

Transport: object broadcasts go over a dedicated CPU gloo group even when the training group is
NCCL -- metadata has no business on the GPU, and the group carries our own timeout. Without gloo,
the bytes move as a device tensor on ``cuda:<local_rank>`` (:func:`transport_device`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from . import packets
from .errors import CollectiveTimeoutError, DistributedError, RemoteError
from .packets import (  # noqa: F401 - re-exported: callers use comm.Packet, comm.Stop ...
    MAGIC, PROTOCOL_VERSION, STOP_PACKET, Kind, Packet, Stop, digest, dumps, header_tensor)
from .settings import setting
from .world import World

TIMEOUT_ENV = "MDLOADER_BUILD_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0


def data_packet(obj: Any, **kwargs: Any) -> Packet:
    """:func:`mdloader.packets.data_packet` stamped with this rank."""
    return packets.data_packet(obj, rank=current_world().rank, **kwargs)


def error_packet(exc: BaseException, **kwargs: Any) -> Packet:
    """:func:`mdloader.packets.error_packet` stamped with this rank."""
    return packets.error_packet(exc, rank=current_world().rank, **kwargs)


def remote_error(exc: BaseException, **kwargs: Any) -> RemoteError:
    return packets.remote_error(exc, rank=current_world().rank, **kwargs)


def open_packet(packet: Packet) -> Any:
    """DATA -> the object; STOP -> :class:`Stop`; ERROR -> raise :class:`RemoteError`."""
    return packets.open_packet(packet, rank=current_world().rank)


def current_world() -> World:
    """Rank and size from the initialised default group, else a single-process :class:`World`."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    env = World.from_env()
    return World(rank=dist.get_rank(), world_size=dist.get_world_size(),
                 local_rank=env.local_rank, local_world_size=env.local_world_size)


def is_distributed() -> bool:
    """A default process group is running with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def group_rank(group: Any) -> int:
    """This rank's position in ``group``."""
    return dist.get_group_rank(group, dist.get_rank())


def group_size(group: Any) -> int:
    return dist.get_world_size(group)


def resolve_timeout(timeout: float | None = None) -> float:
    """The argument, else ``$MDLOADER_BUILD_TIMEOUT`` (seconds), else 1800 s."""
    return setting(timeout, argument="timeout", env=TIMEOUT_ENV, default=DEFAULT_TIMEOUT,
                   parse=float, minimum=1e-3,
                   expected="a number of seconds", floor="a positive number of seconds")


def transport_device(backend: str, local_rank: int) -> torch.device:
    """Where packet tensors must live for ``backend``: CPU unless the group is NCCL only.

    ``"cpu:gloo,cuda:nccl"`` style groups take CPU tensors over gloo, so only a pure NCCL (or
    other device-only) backend needs the bytes on ``cuda:<local_rank>``.
    """
    backend = str(backend).lower()
    if "gloo" in backend or "mpi" in backend or "cpu:" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


_cpu_groups: tuple[Any, dict[float, Any]] | None = None  # (parent WORLD, timeout -> gloo group)


def cpu_group(timeout: float) -> Any:
    """A gloo group over all ranks whose collectives time out after ``timeout`` seconds.

    Created once per (default group, timeout) -- a collective, so every rank must ask for the
    same timeouts in the same order (they come from the same argument or environment). The cache
    holds a strong reference to the parent and compares identity: after destroy/re-init a new
    group is made, where caching by ``id()`` could hand a dead group to a new parent that reuses
    the address. The group's own timeout equals ``timeout`` so that a receiver that gives up
    leaves no collective pending for longer than it waited.
    """
    global _cpu_groups
    parent = dist.group.WORLD
    if _cpu_groups is None or _cpu_groups[0] is not parent:
        _cpu_groups = (parent, {})
    groups = _cpu_groups[1]
    if timeout not in groups:
        groups[timeout] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    return groups[timeout]


def subgroup(ranks: list[int]) -> Any:
    """A group of ``ranks`` (default backend); only its members call this."""
    return dist.new_group(sorted(ranks), use_local_synchronization=True)


def world_channel(timeout: float | None = None, *, activity: str = "working") -> "Channel":
    """Rank 0 to all ranks over CPU gloo, or over the default NCCL group if gloo is missing.

    ``timeout`` is resolved by :func:`resolve_timeout`; ``activity`` says what rank 0 is doing
    while the others wait (for the timeout message).
    """
    timeout = resolve_timeout(timeout)
    remedy = f"raise the timeout argument or ${TIMEOUT_ENV} (seconds)"
    group = cpu_group(timeout) if dist.is_gloo_available() else dist.group.WORLD
    return Channel(group, timeout=timeout, activity=activity, remedy=remedy)


class Channel:
    """Group rank 0 of ``group`` sends packets to the other members.

    Parameters
    ----------
    group
        A process group this rank belongs to.
    timeout
        Seconds a receiver waits for one packet (and for :meth:`agree`).
    activity, remedy
        Words for the timeout message: what the source may still be doing, how to wait longer.
    device
        Where tensors go; defaults to :func:`transport_device` of the group's backend.
    """

    def __init__(self, group: Any, *, timeout: float, activity: str = "working",
                 remedy: str = "raise the process group's timeout",
                 device: torch.device | None = None) -> None:
        self.group = group
        self.timeout = timeout
        self.activity = activity
        self.remedy = remedy
        self.rank = group_rank(group)
        self.size = group_size(group)
        self.src_global = dist.get_global_rank(group, 0)
        self.device = device or transport_device(dist.get_backend(group),
                                                 current_world().local_rank)

    @property
    def is_source(self) -> bool:
        return self.rank == 0

    def broadcast(self, packet: Packet | None) -> Packet:
        """The source passes its packet, the others ``None``; every member gets the packet.

        Two collectives: the fixed header, then the bytes (none for an empty payload). Inlining
        small payloads into a larger first message was measured and rejected: one 16 KiB
        message cost as much as two, and a 64 KiB one 10x more, on gloo over TCP.
        """
        if self.is_source and packet is None:
            raise DistributedError("the source rank must pass a packet to broadcast")
        header = header_tensor(packet) if self.is_source else torch.zeros(5, dtype=torch.int64)
        header = self._run(dist.broadcast, header.to(self.device), "packet header")
        if self.is_source:
            if packet.payload:
                self._run(dist.broadcast, _bytes_tensor(packet.payload, self.device), "packet body")
            return packet
        kind, nbytes, count = self._check_header(header.cpu().tolist())
        body = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if nbytes:
            body = self._run(dist.broadcast, body, "packet body")
        return Packet(kind, body.cpu().numpy().tobytes(), count)

    def gather(self, packet: Packet) -> list[Packet]:
        """Every member sends its packet and receives everyone's, in group-rank order.

        Headers first (so every rank knows every length), then the bytes padded to the longest.
        """
        head = [torch.zeros(5, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self._run(dist.all_gather, header_tensor(packet).to(self.device), "packet headers", head)
        metas = [self._check_header(t.cpu().tolist()) for t in head]
        longest = max(n for _, n, _ in metas)
        if longest == 0:
            return [Packet(kind, b"", count) for kind, _, count in metas]
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        mine[:len(packet.payload)] = _bytes_tensor(packet.payload, self.device)
        bodies = [torch.empty(longest, dtype=torch.uint8, device=self.device)
                  for _ in range(self.size)]
        self._run(dist.all_gather, mine, "packet bodies", bodies)
        return [Packet(kind, body[:n].cpu().numpy().tobytes(), count)
                for (kind, n, count), body in zip(metas, bodies)]

    def agree(self, payload_digest: bytes, problem: str | None) -> None:
        """Every member reports (ok?, digest); all raise together if any rank disagrees.

        ``problem`` is this rank's own verification failure (``None`` when fine); its text stays
        local, the other ranks learn which ranks failed.
        """
        mine = np.zeros(5, dtype=np.int64)
        mine[0] = problem is None
        mine[1:] = np.frombuffer(payload_digest[:32], dtype=np.int64)
        out = [torch.zeros(5, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self._run(dist.all_gather, torch.from_numpy(mine).to(self.device), "digest check", out)
        rows = [t.cpu().tolist() for t in out]
        ranks = [dist.get_global_rank(self.group, r) for r in range(self.size)]
        failed = [g for g, row in zip(ranks, rows) if not row[0]]
        if problem is not None:
            raise DistributedError(f"rank {dist.get_rank()}: {problem} "
                                   f"(verification failed on ranks {failed})")
        if failed:
            raise DistributedError(f"verification of the broadcast failed on ranks {failed}; "
                                   f"rank {dist.get_rank()} was fine: see the errors of {failed}")
        differ = [g for g, row in zip(ranks, rows) if row[1:] != rows[0][1:]]
        if differ:
            raise DistributedError(f"payload digest differs from rank {self.src_global}'s on ranks "
                                   f"{differ}: the broadcast was corrupted or the ranks disagree")

    def _check_header(self, values: list[int]) -> tuple[Kind, int, int]:
        magic, version, kind, nbytes, count = values
        me = dist.get_rank()
        if magic != MAGIC:
            raise DistributedError(f"rank {me} received a packet with magic {magic:#x} from rank "
                                   f"{self.src_global}, expected {MAGIC:#x}: collectives out of step")
        if version != PROTOCOL_VERSION:
            raise DistributedError(f"rank {me} speaks packet protocol {PROTOCOL_VERSION}, rank "
                                   f"{self.src_global} sent {version}: mixed mdloader versions")
        if kind not in {int(k) for k in Kind} or nbytes < 0:
            raise DistributedError(f"rank {me} received a malformed header from rank "
                                   f"{self.src_global}: kind={kind}, length={nbytes}")
        return Kind(kind), nbytes, count

    def _run(self, op: Callable[..., Any], tensor: torch.Tensor, what: str,
             outputs: list[torch.Tensor] | None = None) -> torch.Tensor:
        start = time.monotonic()
        try:
            if outputs is None:
                work = op(tensor, group=self.group, group_src=0, async_op=True)
            else:
                work = op(outputs, tensor, group=self.group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise self._failure(exc, what, time.monotonic() - start) from exc
        return tensor

    def _failure(self, exc: RuntimeError, what: str, waited: float) -> DistributedError:
        me, src = dist.get_rank(), self.src_global
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            return DistributedError(f"rank {me}: {what} with source rank {src} failed after "
                                    f"{waited:.1f} s: {exc}")
        if self.is_source:
            return CollectiveTimeoutError(
                f"rank {me} waited {waited:.1f} s to send the {what} to the other {self.size - 1} "
                f"ranks (timeout {self.timeout:g} s): they may have given up or failed")
        return CollectiveTimeoutError(
            f"rank {me} waited {waited:.1f} s for the {what} from rank {src} (timeout "
            f"{self.timeout:g} s): rank {src} may still be {self.activity}; {self.remedy}")


def _bytes_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


# -- the job's process group: started from torchrun's environment, torn down safely ------------


def init_from_env() -> World:
    """Start the default group when ``WORLD_SIZE`` > 1 and none runs; return this rank's world.

    NCCL when CUDA is available, else gloo. DeePMD-kit keys on ``LOCAL_RANK`` and silently runs
    W serial trainings under a launcher that does not set it; here the world size decides.
    """
    world = World.from_env()
    if world.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group(backend=backend)
    return current_world() if dist.is_initialized() else world


def device_of(world: World) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available, else the CPU."""
    return torch.device("cuda", world.local_rank) if torch.cuda.is_available() else \
        torch.device("cpu")


def is_running() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def process_group() -> Iterator[World]:
    """Run a job inside the default group, started here if needed and torn down after.

    Every rank passes a barrier before ``destroy_process_group``: torch 2.13 + gloo aborts a
    rank ("terminate called without an active exception") that tears down while another is
    still inside the group. On success that is a plain barrier. On failure the ranks usually
    failed together (a framed error reaches all of them), so they meet at a monitored barrier
    that gives up after :data:`SETTLE_SECONDS` instead of hanging on a rank that did not fail.
    """
    started = not is_running() and World.from_env().world_size > 1
    world = init_from_env()
    ok = False
    try:
        yield world
        ok = True
    finally:
        if started and dist.is_initialized():
            if ok:
                dist.barrier()
            else:
                _settle_after_failure()
            dist.destroy_process_group()


SETTLE_SECONDS = 30.0


def _settle_after_failure() -> None:
    group = _cpu_groups[1].get(resolve_timeout()) if _cpu_groups is not None and \
        _cpu_groups[0] is dist.group.WORLD else None
    if group is None and dist.get_backend() == "gloo":
        group = dist.group.WORLD
    if group is None:
        return  # NCCL only: no barrier that can time out; tear down as we are
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=SETTLE_SECONDS))
    except RuntimeError:
        pass  # a peer did not fail with us: nothing to wait for


def all_reduce_mean(values: np.ndarray | list[float],
                    device: torch.device | None = None) -> np.ndarray:
    """Mean over ranks of a small float vector (identity in a single process)."""
    arr = np.asarray(values, dtype=np.float64)
    if not is_distributed():
        return arr
    tensor = torch.as_tensor(arr, device=device or torch.device("cpu"))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu().numpy() / dist.get_world_size()


def gather_to_main(obj: Any, *, timeout: float | None = None,
                   context: str = "gathering to rank 0") -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (rank order), ``None`` elsewhere; framed like a broadcast.

    A rank whose object cannot be pickled sends an error packet, and every rank raises it.
    """
    if not is_distributed():
        return [obj]
    channel = world_channel(timeout, activity=context)
    received = channel.gather(data_packet(obj, context=context))
    for packet in received:
        if packet.kind is Kind.ERROR:
            open_packet(packet)  # raises the same RemoteError on every rank
    return [open_packet(p) for p in received] if dist.get_rank() == 0 else None


def broadcast_from_main(obj: Any = None, *, timeout: float | None = None,
                        context: str = "broadcasting from rank 0") -> Any:
    """Rank 0's ``obj`` on every rank, as one framed packet (its failure fails every rank)."""
    if not is_distributed():
        return obj
    channel = world_channel(timeout, activity=context)
    mine = data_packet(obj, context=context) if channel.is_source else None
    return open_packet(channel.broadcast(mine))
