"""Framed packets: one message that is either data, a clean stop, or an error.

The sender turns its outcome into a :class:`Packet` *before* any collective, so a failure to
build or to pickle still reaches every receiver as an error naming the system and the file
(the model is ``torch._utils.ExceptionWrapper``). :mod:`mdloader.distributed.channel` moves the
bytes; nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import enum
import hashlib
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mdloader.errors import DataError, DistributedError, RemoteError, traceback_text
from mdloader.transport import tensor_as_numpy

MAGIC = 0x4D444C4450_4B54  # "MDLDPKT"
PROTOCOL_VERSION = 1


class Kind(enum.IntEnum):
    """What a packet carries: data, the end of the stream, or a typed error."""

    DATA = 1
    STOP = 2
    ERROR = 3


@dataclass(frozen=True)
class Packet:
    """One framed message. ``cause`` stays on the sending rank (it becomes ``__cause__``)."""

    kind: Kind
    payload: bytes
    count: int = 0
    cause: BaseException | None = field(default=None, compare=False, repr=False)


STOP_PACKET = Packet(Kind.STOP, b"")


class Stop:
    """Returned by :func:`open_packet` for a STOP packet: the sender's stream ended cleanly."""


def data_packet(obj: Any, *, rank: int, count: int = 0, context: str = "serialization failed",
                describe: Callable[[BaseException], dict[str, str | None]] | None = None
                ) -> Packet:
    """Pickle ``obj`` now, before any collective; a pickling failure becomes an ERROR packet.

    ``describe(exc)`` may return ``system``/``file`` to name the culprit in that error.
    """
    try:
        payload = dumps(obj)
    except Exception as exc:  # noqa: BLE001 - any pickling failure must reach the other ranks
        return error_packet(exc, context=context, rank=rank, **(describe(exc) if describe else {}))
    return Packet(Kind.DATA, payload, count)


class _Pickler(pickle.Pickler):
    """Pickle CPU tensors as numpy arrays (:func:`mdloader.transport.tensor_as_numpy`), and a
    tensor on a GPU as its host copy: torch's own pickling would rebuild it on the sender's
    device index (``cuda:0`` of rank 0) on every receiving rank; a receiver moves what it got to
    its own device."""

    def reducer_override(self, obj: Any) -> Any:
        array = tensor_as_numpy(on_host(obj))
        return NotImplemented if array is None else (torch.from_numpy, (array,))


def on_host(value: Any) -> Any:
    """A plain tensor on an accelerator (no autograd history) copied to the CPU; anything else
    as it is."""
    if (type(value) is torch.Tensor and value.device.type not in ("cpu", "meta")
            and not value.requires_grad):
        return value.detach().cpu()
    return value


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` for a packet (protocol 5, tensors through numpy)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


def error_packet(exc: BaseException, *, rank: int, context: str, system: str | None = None,
                 file: str | None = None) -> Packet:
    """Describe ``exc`` in plain strings, so the packet can always be pickled and sent."""
    remote = remote_error(exc, context=context, system=system, file=file, rank=rank)
    state = {name: getattr(remote, name) for name in RemoteError.FIELDS}
    return Packet(Kind.ERROR, pickle.dumps(state), 0, cause=exc)


def remote_error(exc: BaseException, *, rank: int, context: str, system: str | None = None,
                 file: str | None = None) -> RemoteError:
    """The :class:`RemoteError` every rank raises for ``exc``; a DataError's own system/file win."""
    if isinstance(exc, DataError):
        system = exc.system or system
        file = exc.file or file
    file = file or getattr(exc, "filename", None)  # OSError knows its file
    text = traceback_text(exc)
    return RemoteError(origin_rank=rank, exc_type=type(exc).__name__,
                       exc_message=str(exc), context=context,
                       system=None if system is None else str(system),
                       file=None if file is None else str(file), traceback_text=text)


def open_packet(packet: Packet, *, rank: int) -> Any:
    """DATA -> the unpickled object; STOP -> :class:`Stop`; ERROR -> raise :class:`RemoteError`."""
    if packet.kind is Kind.STOP:
        return Stop
    if packet.kind is Kind.ERROR:
        raise RemoteError(**pickle.loads(packet.payload)) from packet.cause
    try:
        return pickle.loads(packet.payload)
    except Exception as exc:  # noqa: BLE001 - e.g. a class missing on this rank
        raise DistributedError(f"rank {rank} could not unpickle a "
                               f"{len(packet.payload)}-byte packet: {type(exc).__name__}: {exc}"
                               ) from exc


def digest(payload: bytes) -> bytes:
    """SHA-256 of the packet bytes, compared across ranks by :meth:`Channel.agree`."""
    return hashlib.sha256(payload).digest()


def header_tensor(packet: Packet) -> torch.Tensor:
    """The first message of a packet: magic, version, kind, byte length, item count."""
    return torch.tensor([MAGIC, PROTOCOL_VERSION, int(packet.kind), len(packet.payload),
                         packet.count], dtype=torch.int64, device="cpu")
