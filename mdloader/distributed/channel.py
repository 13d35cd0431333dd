"""Framed packets from rank 0 of a group to its other members, with a timeout.

A fixed header (magic, protocol version, kind, byte length, item count) travels first, then the
bytes. Every receiver validates the header and re-raises an error packet as
:class:`~mdloader.errors.RemoteError`, so all ranks fail together with the same message.

Transport: packets go over a dedicated CPU gloo group even when the training group is NCCL --
metadata has no business on the GPU, and the group carries our own timeout. Without gloo, the
bytes move as a device tensor on ``cuda:<local_rank>`` (:func:`transport_device`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mdloader.distributed.group import (
    cpu_group,
    current_world,
    group_rank,
    group_size,
    transport_device,
)
from mdloader.distributed.packets import MAGIC, PROTOCOL_VERSION, Kind, Packet, header_tensor
from mdloader.distributed.torch_versions import broadcast_from, gather_to
from mdloader.errors import AgreementError, CollectiveTimeoutError, DistributedError
from mdloader.settings import SETTINGS, resolve


def world_channel(*, activity: str, timeout: float | None = None,
                  setting: str = "collective_timeout") -> Channel:
    """Rank 0 to all ranks over CPU gloo, or over the default NCCL group if gloo is missing.

    ``timeout`` (seconds) overrides the setting it defaults to (``build_timeout`` while rank 0
    builds, else ``collective_timeout``); ``activity`` says what rank 0 is doing while the others
    wait, for the timeout message.
    """
    seconds = resolve(setting, timeout, argument="timeout")
    remedy = f"raise the timeout argument or ${SETTINGS[setting].env} (seconds)"
    group = cpu_group(seconds) if dist.is_gloo_available() else dist.group.WORLD
    return Channel(group, timeout=seconds, activity=activity, remedy=remedy)


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
        self.global_rank = dist.get_rank()
        self.src_global = dist.get_global_rank(group, 0)
        self.device = device or transport_device(dist.get_backend(group),
                                                 current_world().local_rank)

    @property
    def is_source(self) -> bool:
        return self.rank == 0

    def broadcast(self, packet: Packet | None) -> Packet:
        """The source passes its packet, the others ``None``; every member gets the packet.

        Two collectives: the fixed header, then the bytes (none for an empty payload); a larger
        fixed first message that could inline small payloads cost more than it saved.
        """
        if self.is_source and packet is None:
            raise DistributedError("the source rank must pass a packet to broadcast")
        header = (header_tensor(packet) if self.is_source
                  else torch.zeros(5, dtype=torch.int64, device=self.device))
        header = self._broadcast(header.to(self.device), "packet header")
        if self.is_source:
            if packet.payload:
                self._broadcast(_bytes_tensor(packet.payload, self.device), "packet body")
            return packet
        kind, nbytes, count = self._check_header(header.cpu().tolist())
        body = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if nbytes:
            body = self._broadcast(body, "packet body")
        return Packet(kind, body.cpu().numpy().tobytes(), count)

    def gather(self, packet: Packet) -> list[Packet]:
        """Every member sends its packet and receives everyone's, in group-rank order.

        Headers first (so every rank knows every length), then the bytes as
        :func:`gather_plan` says: one all-gather padded to the longest when that at most
        doubles what arrives, else one broadcast per member of its packet at its own length
        (gloo's all-gather takes equal sizes only), so a rank holds the sum of the lengths,
        never the world size times the longest.
        """
        head = [torch.zeros(5, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self._all_gather(header_tensor(packet).to(self.device), "packet headers", head)
        metas = [self._check_header(t.cpu().tolist()) for t in head]
        lengths = [n for _, n, _ in metas]
        plan = gather_plan(lengths)
        if plan == "none":
            bodies = [b""] * self.size
        elif plan == "padded":
            bodies = self._padded(packet.payload, lengths)
        else:
            bodies = self._broadcasts(packet.payload, lengths)
        return [Packet(kind, body, count) for (kind, _, count), body in zip(metas, bodies)]

    def _padded(self, payload: bytes, lengths: list[int]) -> list[bytes]:
        longest = max(lengths)
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        mine[:len(payload)] = _bytes_tensor(payload, self.device)
        out = [torch.empty(longest, dtype=torch.uint8, device=self.device)
               for _ in range(self.size)]
        self._all_gather(mine, "packet bodies", out)
        return [body[:n].cpu().numpy().tobytes() for n, body in zip(lengths, out)]

    def _broadcasts(self, payload: bytes, lengths: list[int]) -> list[bytes]:
        """One broadcast per member with a non-empty packet, all launched before any wait."""
        out = [_bytes_tensor(payload, self.device) if r == self.rank
               else torch.empty(n, dtype=torch.uint8, device=self.device)
               for r, n in enumerate(lengths)]
        works = [(r, broadcast_from(t, self.group, r)) for r, t in enumerate(out) if lengths[r]]
        for r, work in works:
            self._wait(lambda work=work: work, f"packet body of group rank {r}")
        return [payload if r == self.rank else t.cpu().numpy().tobytes()
                for r, t in enumerate(out)]

    def gather_rows(self, row: np.ndarray) -> np.ndarray | None:
        """Every member's float64 ``row`` (one length on every member) stacked on group rank 0
        in group-rank order, ``None`` elsewhere: one gather, so a member other than rank 0
        sends its row and receives nothing, whatever the group's size."""
        mine = torch.as_tensor(np.asarray(row, dtype=np.float64), device=self.device)
        rows = ([torch.empty_like(mine) for _ in range(self.size)] if self.is_source
                else None)
        self._wait(lambda: gather_to(mine, rows, self.group, 0), "row gather")
        return None if rows is None else torch.stack(rows).cpu().numpy()

    def agree(self, payload_digest: bytes, problem: str | None) -> None:
        """Every member reports (ok?, digest); all raise :class:`AgreementError` together if any
        rank disagrees.

        ``problem`` is this rank's own verification failure (``None`` when fine); its text stays
        local, the other ranks learn which ranks failed.
        """
        mine = np.zeros(5, dtype=np.int64)
        mine[0] = problem is None
        mine[1:] = np.frombuffer(payload_digest[:32], dtype=np.int64)
        out = [torch.zeros(5, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self._all_gather(torch.from_numpy(mine).to(self.device), "digest check", out)
        rows = [t.cpu().tolist() for t in out]
        ranks = [dist.get_global_rank(self.group, r) for r in range(self.size)]
        failed = [g for g, row in zip(ranks, rows) if not row[0]]
        if problem is not None:
            raise AgreementError(f"rank {dist.get_rank()}: {problem} "
                                 f"(verification failed on ranks {failed})")
        if failed:
            raise AgreementError(f"verification of the broadcast failed on ranks {failed}; "
                                 f"rank {dist.get_rank()} was fine: see the errors of {failed}")
        differ = [g for g, row in zip(ranks, rows) if row[1:] != rows[0][1:]]
        if differ:
            raise AgreementError(f"payload digest differs from rank {self.src_global}'s on ranks "
                                 f"{differ}: the broadcast was corrupted or the ranks disagree")

    def _check_header(self, values: list[int]) -> tuple[Kind, int, int]:
        magic, version, kind, nbytes, count = values
        me = dist.get_rank()
        if magic != MAGIC:
            raise DistributedError(f"rank {me} received a packet with magic {magic:#x} from rank "
                                   f"{self.src_global}, expected {MAGIC:#x}: collectives out "
                                   "of step")
        if version != PROTOCOL_VERSION:
            raise DistributedError(f"rank {me} speaks packet protocol {PROTOCOL_VERSION}, rank "
                                   f"{self.src_global} sent {version}: mixed mdloader versions")
        if kind not in {int(k) for k in Kind} or nbytes < 0:
            raise DistributedError(f"rank {me} received a malformed header from rank "
                                   f"{self.src_global}: kind={kind}, length={nbytes}")
        return Kind(kind), nbytes, count

    def any_set(self, flags: list[bool], what: str = "flag exchange") -> list[bool]:
        """Whether each flag is set on any member: one all-reduce (max) of a few integers."""
        tensor = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int64,
                              device=self.device)
        self._wait(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group,
                                           async_op=True), what)
        return [bool(v) for v in tensor.cpu().tolist()]

    def _broadcast(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Broadcast ``tensor`` in place from group rank 0; the tensor."""
        self._wait(lambda: broadcast_from(tensor, self.group, 0), what)
        return tensor

    def _all_gather(self, tensor: torch.Tensor, what: str, outputs: list[torch.Tensor]) -> None:
        self._wait(lambda: dist.all_gather(outputs, tensor, group=self.group, async_op=True), what)

    def _wait(self, launch: Callable[[], Any], what: str) -> None:
        start = time.monotonic()
        try:
            launch().wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise self._failure(exc, what, time.monotonic() - start) from exc

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


def gather_plan(lengths: list[int]) -> str:
    """How :meth:`Channel.gather` moves packets of these lengths (the same on every rank):
    ``"none"`` (all empty), ``"padded"`` (one all-gather at the longest, when the world size
    times the longest is at most twice the sum) or ``"broadcasts"`` (one per non-empty packet).
    """
    longest, total = max(lengths, default=0), sum(lengths)
    if longest == 0:
        return "none"
    return "padded" if len(lengths) * longest <= 2 * total else "broadcasts"


def _bytes_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    if not payload:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
