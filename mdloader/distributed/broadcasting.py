"""One reader per model-parallel group: the source rank iterates the real loader, the others
receive each batch from it.

With model parallelism (a structure's atoms, or the model's layers, split across the ranks of a
group) every member of the group must see the *same* batch. Reading it on every member multiplies
the file-system load by the group size; :class:`BroadcastingDataLoader` (after NVIDIA NeMo's)
builds the loader on one source rank per group and sends each batch to the others as one framed
packet (:mod:`mdloader.distributed.packets`): a batch, a clean stop, or the source's error. So
every member finishes, or fails with the source's error, at the same step, and no length is
needed up front. Each step costs a pickle, two collectives and a copy of the batch per member
(``docs/benchmarks.md``): it pays when reading costs more, never for pure data parallelism.

Usage: every rank calls :func:`mdloader.loading.build.build_systems` (a collective); the source rank
of each group then builds its loader for its *data-parallel* rank (``World(dp_rank, dp_size)``) and
the others pass ``None``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from mdloader.distributed.channel import Channel
from mdloader.distributed.group import current_world, group_rank, group_size, subgroup
from mdloader.distributed.packets import Kind, Packet, Stop, data_packet, error_packet, open_packet
from mdloader.errors import ConfigError, DistributedError
from mdloader.settings import resolve
from mdloader.state import check_keys, check_same

DEFAULT_AXES = ("cp", "tp")
#: Version of :meth:`BroadcastingDataLoader.state_dict` (1: ``{"version", "source"}``).
STATE_VERSION = 1


def active_axes(device_mesh: Any, axes: Sequence[str]) -> tuple[str, ...]:
    """The ``axes`` present in the mesh with more than one rank (absent axes count as size 1)."""
    names = tuple(device_mesh.mesh_dim_names or ())
    shape = tuple(device_mesh.mesh.shape)
    return tuple(a for a in axes if a in names and shape[names.index(a)] > 1)


def submesh_ranks(device_mesh: Any, axes: Sequence[str]) -> list[int]:
    """Global ranks of this rank's group along ``axes`` (the source first)."""
    names = tuple(device_mesh.mesh_dim_names)
    coordinate = device_mesh.get_coordinate()
    index = tuple(slice(None) if name in axes else coordinate[i] for i, name in enumerate(names))
    return [int(r) for r in np.asarray(device_mesh.mesh[index]).reshape(-1)]


def is_source_rank(device_mesh: Any = None, axes: Sequence[str] = DEFAULT_AXES,
                   group: Any = None) -> bool:
    """Whether this rank reads for its group: group rank 0, or coordinate 0 along every axis.

    Without a mesh and a group (or when nothing is distributed) every rank is its own source.
    """
    if device_mesh is not None and group is not None:
        raise ConfigError("pass either device_mesh or group, not both", path="device_mesh")
    if group is not None:
        return not current_world().distributed or group_rank(group) == 0
    if device_mesh is None:
        return True
    return all(device_mesh.get_local_rank(a) == 0 for a in active_axes(device_mesh, axes))


def _broadcasting(device_mesh: Any, axes: Sequence[str], group: Any) -> bool:
    if not current_world().distributed:
        return False
    if group is not None:
        return group_size(group) > 1
    return device_mesh is not None and bool(active_axes(device_mesh, axes))


def _open_channel(device_mesh: Any, axes: Sequence[str], group: Any,
                  timeout: float | None) -> Channel:
    """The channel of this rank's group; a several-axis group is created here (a collective of
    its members), once per loader -- never looked up by ``id()`` of the mesh."""
    if group is None:
        axes = active_axes(device_mesh, axes)
        group = (device_mesh.get_group(axes[0]) if len(axes) == 1
                 else subgroup(submesh_ranks(device_mesh, axes)))
    seconds = resolve("collective_timeout", timeout, argument="timeout")
    return Channel(group, timeout=seconds, activity="reading the next batch",
                   remedy="pass a larger timeout= or raise $MDLOADER_COLLECTIVE_TIMEOUT")


def broadcast_batch(batch: Any, *, device_mesh: Any = None, axes: Sequence[str] = DEFAULT_AXES,
                    group: Any = None, timeout: float | None = None) -> Any:
    """The source's ``batch`` on every member of its group (others pass ``None``).

    A several-axis mesh creates its group on every call: in a loop, use
    :class:`BroadcastingDataLoader` or pass ``group=``.
    """
    if not _broadcasting(device_mesh, axes, group):
        return batch
    channel = _open_channel(device_mesh, axes, group, timeout)
    packet = None
    if channel.is_source:
        packet = data_packet(batch, rank=channel.global_rank, context="batch serialization failed")
    received = channel.broadcast(packet)
    value = open_packet(received, rank=channel.global_rank)
    return batch if channel.is_source else value


def _fail(channel: Channel, exc: Exception, context: str) -> NoReturn:
    """Send the source's failure to the group, then raise it here as the others do."""
    packet = error_packet(exc, rank=channel.global_rank, context=context)
    channel.broadcast(packet)
    open_packet(packet, rank=channel.global_rank)
    raise AssertionError("unreachable: an error packet always raises")  # pragma: no cover


class BroadcastingDataLoader:
    """Iterate ``source`` on the first rank of each model-parallel group, broadcast to the rest.

    Parameters
    ----------
    source
        The real loader on the group's source rank (:func:`is_source_rank`), ``None`` elsewhere.
    device_mesh, axes
        A ``DeviceMesh`` and the names of its model-parallel dimensions (absent ones ignored).
    group
        Instead of a mesh: the process group whose rank 0 is the source.
    length
        ``len()`` on the non-source ranks, which cannot ask the source without a collective.
    timeout
        Seconds the other ranks wait for one batch (default ``$MDLOADER_COLLECTIVE_TIMEOUT``).

    No mesh, axes of size 1, or no process group: iterating is iterating ``source``.
    Drop the mesh and this loader before ``destroy_process_group()``: with torch 2.13 and gloo a
    mesh that outlives its groups can abort the process at exit (docs/distributed.md).
    """

    def __init__(self, source: Iterable[Any] | None, device_mesh: Any = None,
                 axes: Sequence[str] = DEFAULT_AXES, group: Any = None, *,
                 length: int | None = None, timeout: float | None = None) -> None:
        self.device_mesh, self.axes, self.group = device_mesh, tuple(axes), group
        self.length, self.timeout = length, timeout
        self.broadcasting = _broadcasting(device_mesh, self.axes, group)
        self.is_source = not self.broadcasting or is_source_rank(device_mesh, self.axes, group)
        rank = current_world().rank
        if self.is_source and source is None:
            raise ConfigError(f"rank {rank} is the source rank of its group: pass the real "
                              f"loader, not None", path="source")
        if not self.is_source and source is not None:
            raise ConfigError(f"rank {rank} is not the source rank of its group: pass "
                              f"source=None (only the group's first rank reads)", path="source")
        self.source = source
        self._channel: Channel | None = None

    def _get_channel(self) -> Channel:
        if self._channel is None:
            self._channel = _open_channel(self.device_mesh, self.axes, self.group, self.timeout)
        return self._channel

    def __iter__(self) -> Iterator[Any]:
        if not self.broadcasting:
            return iter(self.source)  # type: ignore[arg-type]
        channel = self._get_channel()
        return self._send(channel) if self.is_source else self._receive(channel)

    def _send(self, channel: Channel) -> Iterator[Any]:
        try:
            iterator = iter(self.source)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - the others must hear of it
            _fail(channel, exc, "source iterator creation failed")
        step = 0
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                channel.broadcast(Packet(Kind.STOP, b"", step))
                return
            except Exception as exc:  # noqa: BLE001
                _fail(channel, exc, "source iterator failed")
            packet = data_packet(batch, rank=channel.global_rank, count=step,
                                 context="batch serialization failed")
            channel.broadcast(packet)
            if packet.kind is Kind.ERROR:
                open_packet(packet, rank=channel.global_rank)  # raises here as on the others
            yield batch
            step += 1

    def _receive(self, channel: Channel) -> Iterator[Any]:
        step = 0
        while True:
            packet = channel.broadcast(None)
            value = open_packet(packet, rank=channel.global_rank)  # raises the source's error
            if packet.count != step:
                raise DistributedError(
                    f"rank {channel.global_rank} expected step {step} from source rank "
                    f"{channel.src_global}, received step {packet.count}: the group is out of "
                    f"step (did only some ranks break out of the loop?)")
            if value is Stop:
                return
            yield value
            step += 1

    def __len__(self) -> int:
        if self.is_source:
            return len(self.source)  # type: ignore[arg-type]
        if self.length is None:
            raise TypeError("BroadcastingDataLoader: the length is known only on the source "
                            "rank; pass length= on the other ranks")
        return self.length

    def state_dict(self) -> dict[str, Any]:
        """``{"version": 1, "source": ...}``: the source's state on the source rank, ``None``
        elsewhere (:func:`~mdloader.sampling.elastic.merge_rank_states` merges the sources')."""
        source = self.source.state_dict() if self.is_source else None  # type: ignore[union-attr]
        return {"version": STATE_VERSION, "source": source}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the source on the source rank; elsewhere only check the state.

        Raises
        ------
        StateDictError
            Unknown or missing keys, another version, or no source's state to give the source
            rank (a non-source rank's own state, not the merged job state).
        """
        check_keys(state, kind="BroadcastingDataLoader", version=STATE_VERSION, keys=("source",))
        if not self.is_source:
            return
        if state["source"] is None:  # a non-source rank's own state
            check_same("BroadcastingDataLoader", "source state", None,
                       "one to restore on its source rank",
                       hint="; load the job state merged from every rank (merge_rank_states)")
        self.source.load_state_dict(state["source"])  # type: ignore[union-attr]
