"""Run a function on W real gloo ranks, with a hard deadline, and collect what each rank did.

Multi-process tests must never hang CI: :func:`run_ranks` starts one process per rank, gives
them a fresh TCP port on 127.0.0.1, waits at most ``timeout`` seconds, then kills every child
that is still alive and fails. Each rank's return value (or the facts of its exception) travels
back over a pipe, so the caller can compare ranks: same result, same error, exit times close
together.

Children come from a *forkserver* that has imported torch once: starting a rank costs a fork
instead of a fresh interpreter importing torch (about a second), and the children do
not inherit pytest's threads or state the way a plain ``fork`` of the test process would.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "numpy", "mdloader"])


@dataclass(frozen=True)
class RankError:
    """What a rank raised, flattened to strings so that any exception can be reported."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    finished_at: float
    exception: BaseException | None = None  # the exception itself when it could be pickled

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.exc_type}: {self.message}\n{self.traceback}"


@dataclass(frozen=True)
class RankResult:
    """A rank's return value and the wall-clock time at which it returned."""

    rank: int
    value: Any
    finished_at: float


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    init_group: bool = True,
    group_timeout: float | None = None,
    daemon: bool = True,
) -> list[RankResult | RankError]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; one outcome per rank.

    Parameters
    ----------
    fn
        A module-level (picklable) function.
    timeout
        Hard deadline in seconds for the whole run. Children still alive then are killed and
        :class:`TimeoutError` is raised: a hang fails the test instead of the CI job.
    env
        Extra environment variables for the children.
    init_group
        Initialise a gloo default group before calling ``fn`` (and tear it down after).
    group_timeout
        The default group's collective timeout (defaults to ``timeout``).
    daemon
        ``False`` lets the ranks start processes of their own (DataLoader workers); the
        deadline still kills every rank, and torch's workers exit when their rank dies.
    """
    port = free_port()
    pipes, procs = [], []
    for rank in range(world_size):
        reader, writer = _CONTEXT.Pipe(duplex=False)
        proc = _CONTEXT.Process(
            target=_child,
            args=(writer, fn, rank, world_size, port, args, env or {}, init_group,
                  group_timeout or timeout),
            name=f"rank{rank}",
            daemon=daemon,
        )
        proc.start()
        writer.close()
        pipes.append(reader)
        procs.append(proc)
    try:
        outcomes = _collect(pipes, procs, time.monotonic() + timeout)
    finally:
        _reap(procs)
    missing = [r for r, o in enumerate(outcomes) if o is None]
    if missing:
        raise TimeoutError(
            f"ranks {missing} of {world_size} reported nothing within {timeout} s "
            f"(killed); exit codes: {[p.exitcode for p in procs]}; others: "
            f"{[o for o in outcomes if o is not None]}"
        )
    return outcomes  # type: ignore[return-value]


def values(outcomes: list[RankResult | RankError]) -> list[Any]:
    """Return values per rank; raise if any rank failed (its traceback in the message)."""
    errors = [o for o in outcomes if isinstance(o, RankError)]
    if errors:
        raise AssertionError("some ranks failed:\n" + "\n".join(str(e) for e in errors))
    return [o.value for o in outcomes]  # type: ignore[union-attr]


def errors(outcomes: list[RankResult | RankError]) -> list[RankError]:
    """The errors per rank; raise if some rank did not fail."""
    ok = [o.rank for o in outcomes if not isinstance(o, RankError)]
    if ok:
        raise AssertionError(f"ranks {ok} did not fail: {outcomes}")
    return outcomes  # type: ignore[return-value]


def _collect(pipes: list[Any], procs: list[Any], deadline: float) -> list[Any]:
    outcomes: list[Any] = [None] * len(procs)
    pending = {pipe: rank for rank, pipe in enumerate(pipes)}
    while pending and time.monotonic() < deadline:
        ready = mpc.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        for pipe in ready:
            rank = pending.pop(pipe)
            try:
                outcomes[rank] = pickle.loads(pipe.recv_bytes())
            except EOFError:  # died without reporting (segfault, abort, os._exit)
                procs[rank].join(5)
                outcomes[rank] = RankError(rank, "ProcessDied",
                                           f"exit code {procs[rank].exitcode}", "", time.time())
    return outcomes


def _reap(procs: list[Any], grace: float = 10.0) -> None:
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _child(writer: Any, fn: Callable[..., Any], rank: int, world_size: int, port: int,
           args: tuple[Any, ...], env: dict[str, str], init_group: bool,
           group_timeout: float) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), **env})
    import torch.distributed as dist

    if init_group:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=group_timeout))
    try:
        outcome: RankResult | RankError = RankResult(rank, fn(rank, world_size, *args), time.time())
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        outcome = RankError(rank, type(exc).__name__, str(exc), traceback.format_exc(),
                            time.time(), exc)
    # Plain pickle: multiprocessing's pickler would share tensors through file descriptors
    # that die with this process.
    try:
        data = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - the value or exception could not be pickled
        if isinstance(outcome, RankError):
            outcome = RankError(rank, outcome.exc_type, outcome.message, outcome.traceback,
                                outcome.finished_at)
        else:
            outcome = RankError(rank, "UnpicklableResult", repr(outcome.value)[:200], "",
                                outcome.finished_at)
        data = pickle.dumps(outcome)
    writer.send_bytes(data)
    writer.close()
    if init_group and dist.is_initialized():
        _teardown(dist)


def _teardown(dist: Any) -> None:
    # gloo + torch 2.13: without a barrier a rank may abort in destroy_process_group. After a
    # failure the ranks may be out of step, so every rank uses the same barrier, one that gives
    # up after a few seconds instead of hanging.
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=5), wait_all_ranks=True)
    except Exception:  # noqa: BLE001 - best effort; the outcome is already reported
        pass
    dist.destroy_process_group()
