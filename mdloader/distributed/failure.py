"""How a job of several ranks ends after a failure: together when the ranks failed together, at
once when one rank failed alone.

* **Together** (the error has ``every_rank``: a framed error or a failed agreement reached every
  rank at the same point). The ranks meet at a barrier on the job's store, which every rank
  leaves after :data:`SETTLE_SECONDS` at most, then tear the group down: gloo aborts a process
  that destroys its group while a peer is still inside a collective. They meet once more before
  leaving their processes (:func:`depart`), so that every rank has said the failure before the
  launcher, seeing one rank exit, stops the others.
* **Alone** (a read error, a lost DataLoader worker, any exception in one rank's step). The rank
  must not wait for the others: they may be inside a collective that waits for it. It publishes
  its failure in the store of the default group (the first failure of a job wins), raises it as
  :class:`~mdloader.errors.RankFailedError`, and leaves the group as it is. The process should
  then exit (:func:`exit_now`): its peers' collectives fail as soon as its connections close
  (gloo), or the launcher stops them. A peer whose collective broke that way finds the original
  failure in the store and raises the same error, so every rank prints the same line.

Under ``torchrun`` the store lives in the agent, so it outlives any rank. Without an agent it
lives in rank 0's process, and when rank 0 is the one that died the others report their own
broken connection instead.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mdloader.distributed.packets import remote_error
from mdloader.errors import DistributedError, RankFailedError, RemoteError

SETTLE_SECONDS = 10.0
"""The longest any rank waits for the others after a failure they share."""

_POLL_SECONDS = 0.05
_jobs = itertools.count()
_ended = False  # a job of this process ended the group it started
_parting: tuple[Any, int, int] | None = None  # (store, job, world size) of a shared failure


@dataclass
class Activity:
    """What this rank is doing, in the words of the failure line ("training step 12")."""

    doing: str = "running the job"

    def __str__(self) -> str:
        return self.doing


def next_job() -> int:
    """A number for the job that starts now, the same on every rank (they start jobs in step)."""
    return next(_jobs)


def failed_together(exc: BaseException) -> bool:
    """Whether every rank raised this at the same point (so that they can meet once more)."""
    return isinstance(exc, KeyboardInterrupt) or bool(getattr(exc, "every_rank", False))


def settle(job: int, world_size: int, seconds: float = SETTLE_SECONDS, *,
           point: str = "settle", store: Any = None) -> bool:
    """Wait until every rank arrived at ``point``, at most ``seconds``; False when one did not.

    A counter in the store rather than a collective: a collective's timeout binds one rank only
    (gloo's ``monitored_barrier``) or the whole group's timeout, and the store answers even when
    the group's connections are broken.
    """
    store = _store() if store is None else store
    if store is None:
        return False
    key = f"mdloader/job{job}/{point}"
    deadline = time.monotonic() + seconds
    try:
        arrived = store.add(key, 1)
        while arrived < world_size and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
            arrived = store.add(key, 0)
    except (RuntimeError, ValueError):  # the store is gone: its host died
        return False
    return arrived >= world_size


def fail_alone(exc: BaseException, *, job: int, activity: object) -> RankFailedError:
    """The error this rank raises after failing alone: the job's first published failure.

    If no other rank published one, this rank's own failure is published and returned.
    """
    rank = dist.get_rank()
    mine = RankFailedError(**_fields(remote_error(_plain(exc, activity), rank=rank,
                                                  context=str(activity))))
    store = _store()
    if store is None:
        return mine
    record = json.dumps(_fields(mine))
    try:
        current = store.compare_set(f"mdloader/job{job}/failure", "", record)
    except (RuntimeError, ValueError):
        return mine
    current = current.decode() if isinstance(current, bytes) else current
    return mine if current == record else RankFailedError(**json.loads(current))


def published_failure(job: int) -> RankFailedError | None:
    """The failure a rank of ``job`` published, if any, without waiting: a rank stopped by the
    launcher's SIGTERM reports it rather than its stop (the launcher stops the others because
    that rank failed)."""
    store = _store()
    key = f"mdloader/job{job}/failure"
    try:
        if store is None or not store.check([key]):
            return None
        record = store.get(key)
    except (RuntimeError, ValueError):  # the store is gone: its host died
        return None
    record = record.decode() if isinstance(record, bytes) else record
    return RankFailedError(**json.loads(record)) if record else None


def group_ended() -> None:
    """Remember that a job of this process ended its group, torn down or left as it was."""
    global _ended
    _ended = True


def part_together(job: int, world_size: int) -> None:
    """Remember that the ranks of ``job`` failed together, so that none leaves the process before
    every rank has said the failure (:func:`depart`). Called before the group is torn down: the
    store is kept for that last meeting."""
    global _parting
    _parting = (_store(), job, world_size)


def depart(code: int) -> None:
    """Leave the process with ``code`` (:func:`exit_now`); after a failure the ranks shared, once
    every rank has said it, at most :data:`SETTLE_SECONDS` later. The launcher stops the other
    ranks as soon as one exits: a rank still on its way to its own line (through DeePMD-kit's
    ``@record`` wrapper, on a loaded machine) was killed without saying it."""
    if _parting is not None:
        store, job, world_size = _parting
        if store is not None:
            settle(job, world_size, point="depart", store=store)
    exit_now(code)


def ended_a_group() -> bool:
    """True after a job of this process ended the group it started (torn down or abandoned):
    the process is a rank of a finished job, which should exit now (:func:`exit_now`)."""
    return _ended


def exit_now(code: int) -> None:
    """Leave the process at once with ``code``, after flushing what it wrote.

    Destructors are skipped on purpose: tearing down a group that a peer still uses can abort
    the process, and as soon as one rank has exited ``torchrun`` sends SIGTERM to the others,
    which would end them during the interpreter's shutdown with another exit code. DataLoader
    workers are killed first; otherwise they would notice the missing parent only seconds later,
    holding the launcher's output pipes open meanwhile.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(code)


def _store() -> Any:
    """The default group's key-value store (``None`` without one)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _fields(error: RemoteError) -> dict[str, Any]:
    return {name: getattr(error, name) for name in RemoteError.FIELDS}


_BROKEN = ("connection closed by peer", "connection reset by peer", "broken pipe")


def _plain(exc: BaseException, activity: object) -> BaseException:
    """A collective broken by a peer that left, said in words; anything else unchanged."""
    text = str(exc)
    if not any(marker in text.lower() for marker in _BROKEN):
        return exc
    said = text.split("] ", 1)[-1].split(". This is typically", 1)[0]
    return DistributedError(f"another rank left the job during {activity} (it failed or was "
                            f"killed: see its own output and the launcher's); gloo: {said}")
