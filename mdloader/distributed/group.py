"""The job's process group: started from the launcher's environment, torn down safely.

DeePMD-kit keys on ``LOCAL_RANK`` and silently runs W serial trainings under a launcher that
does not set it; here the world size decides.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mdloader.distributed.failure import (
    Activity,
    fail_alone,
    failed_together,
    group_ended,
    next_job,
    part_together,
    published_failure,
    settle,
)
from mdloader.errors import ConfigError, StopRequested
from mdloader.settings import resolve
from mdloader.world import World


def current_world() -> World:
    """Rank and size from the initialised default group, else a single-process :class:`World`."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    env = World.from_env()
    return World(rank=dist.get_rank(), world_size=dist.get_world_size(),
                 local_rank=env.local_rank, local_world_size=env.local_world_size,
                 node=env.node)


def group_rank(group: Any) -> int:
    """The position of the calling rank in ``group``."""
    return dist.get_group_rank(group, dist.get_rank())


def group_size(group: Any) -> int:
    """The number of ranks in ``group``."""
    return dist.get_world_size(group)


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


def create_cpu_groups() -> None:
    """Create the CPU groups of both timeout settings now, while every rank is alive.

    Creating a gloo group waits for every peer's address for the group's whole timeout: made on
    first use, after a peer died, it kept the others waiting there for minutes, deaf to the
    launcher's SIGTERM. A collective: every rank calls it, in the same order.
    """
    if dist.is_gloo_available():
        for setting in ("build_timeout", "collective_timeout"):
            cpu_group(resolve(setting))


def subgroup(ranks: list[int]) -> Any:
    """A group of ``ranks`` (default backend); only its members call this."""
    return dist.new_group(sorted(ranks), use_local_synchronization=True)


#: Signals that end a rank still joining the group: nothing has started, nothing is to be saved.
JOINING_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


@contextmanager
def stop_while_joining(rank: int) -> Iterator[None]:
    """Within, a stop signal ends the process at once with one line and exit code 128 + signal.

    Joining the group blocks in torch's C++ rendezvous, where Python signal handlers do not run:
    a SIGTERM (torchrun's, after it lost a peer or was told to stop) was only honoured once the
    rank that starts the store had joined, or at torchrun's SIGKILL 30 s later. The signal's
    C-level handler writes to a wakeup file descriptor even then, and a thread reading it ends
    the rank. Outside the main thread, or for signals left at their default action, it does
    nothing (a default SIGTERM already ends the process).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    joined = threading.Event()
    start = time.monotonic()

    def watch() -> None:
        while not joined.is_set():
            data = os.read(read_end, 1)
            if joined.is_set() or not data:
                return
            if data[0] in JOINING_STOP_SIGNALS:
                name = signal.Signals(data[0]).name
                os.write(2, (f"mdloader: rank {rank} stopped by {name} while joining the process"
                             f" group ({time.monotonic() - start:.1f} s after it began to wait): "
                             "nothing had started, nothing to save\n").encode())
                sys.stderr.flush()
                os._exit(128 + data[0])

    watcher = threading.Thread(target=watch, name="mdloader-join-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        joined.set()
        signal.set_wakeup_fd(previous)
        os.write(write_end, b"\0")
        watcher.join(timeout=1.0)
        os.close(write_end)
        os.close(read_end)


def init_from_env() -> World:
    """Start the default group when ``WORLD_SIZE`` > 1 and none runs; return this rank's world.

    NCCL when CUDA is available, else gloo, with the timeout ``$MDLOADER_GROUP_TIMEOUT`` (a
    rank that starts late is waited for; a stop signal while waiting ends the rank at once,
    :func:`stop_while_joining`).
    DeePMD-kit keys on ``LOCAL_RANK`` and silently runs W serial trainings under a launcher that
    does not set it; here the world size decides.
    """
    world = World.from_env()
    if world.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            use_device(world)
        with stop_while_joining(world.rank):
            dist.init_process_group(backend=backend,
                                    timeout=timedelta(seconds=resolve("group_timeout")))
    return current_world() if dist.is_initialized() else world


def device_of(world: World) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available, else the CPU (:func:`rank_device`)."""
    return rank_device(world.local_rank,
                       torch.cuda.device_count() if torch.cuda.is_available() else 0)


def rank_device(local_rank: int, cuda_devices: int) -> torch.device:
    """The device of the rank ``local_rank`` of a node where ``cuda_devices`` GPUs are visible:
    ``cuda:<local_rank>``, or the CPU on a node without one.

    Raises
    ------
    ConfigError
        More ranks on the node than GPUs it shows them: torch would fail later with "invalid
        device ordinal", naming neither the rank nor the remedy.
    """
    if cuda_devices <= 0:
        return torch.device("cpu")
    if local_rank >= cuda_devices:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this process sees {cuda_devices} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start "
            "at most one rank per visible GPU on a node (torchrun --nproc_per_node=<GPUs>), and "
            "let every rank of a node see all of its GPUs")
    return torch.device("cuda", local_rank)


def use_device(world: World) -> torch.device:
    """The device of this rank (:func:`device_of`), made torch's current CUDA device if a GPU.

    What torch puts on "the" CUDA device without naming one -- the DataLoader's pinning thread,
    NCCL's communicators, ``torch.device("cuda")`` -- then lands on this rank's GPU, not on
    ``cuda:0`` of every rank.
    """
    device = device_of(world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


@contextmanager
def process_group(activity: Activity | None = None) -> Iterator[World]:
    """Run a job inside the default group, started here if needed and torn down after.

    Every rank passes a barrier before ``destroy_process_group``: torch 2.13 + gloo aborts a
    rank ("terminate called without an active exception") that tears down while another is
    still inside the group. After a failure, the ranks that failed together settle on the store
    for a bounded time before the teardown; a rank that failed alone raises
    :class:`~mdloader.errors.RankFailedError` at once and leaves the group as it is
    (:mod:`mdloader.distributed.failure`); after a :class:`~mdloader.errors.StopRequested`
    (every rank got the signal) each rank leaves the group as it is, without waiting, and raises
    the failure another rank published, if any (the launcher's SIGTERM followed it).
    ``activity`` says what the rank was doing, for the failure line. The CPU groups are created
    on entry (:func:`create_cpu_groups`).
    """
    started = not dist.is_initialized() and World.from_env().world_size > 1
    world = init_from_env()
    job = next_job()
    if world.distributed:
        with stop_while_joining(world.rank):  # made in C++, deaf to Python's signal handlers
            create_cpu_groups()
    try:
        yield world
    except BaseException as exc:
        if not world.distributed:
            raise
        if isinstance(exc, StopRequested):  # every rank got the signal: none waits for another
            group_ended()
            failure = published_failure(job)
            if failure is not None:  # the launcher stopped this rank because another failed
                raise failure from exc
            raise
        if not failed_together(exc):
            group_ended()
            raise fail_alone(exc, job=job, activity=activity or Activity()) from exc
        settled = settle(job, world.world_size)
        part_together(job, world.world_size)
        if started and dist.is_initialized():
            if settled:  # else the group is left as it is: a peer may still be inside it
                dist.destroy_process_group()
            group_ended()
        raise
    if started and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        group_ended()
