"""How a failure on one rank ends a ``mdloader dp`` job: every rank at once, with one line.

DeePMD-kit's trainer knows nothing of mdloader's failure channel: a rank whose read fails (or
whose DataLoader worker dies) raised its error alone, and its peers, inside DDP's all-reduce,
ended with gloo's "Connection closed by peer". :func:`ending_together` runs DeePMD-kit's ``dp``
so that the first failure of the job is published in the store of the default group and raised
on every rank as the same :class:`~mdloader.errors.RankFailedError`
(:mod:`mdloader.distributed.failure`); the command line then prints it and leaves at once.
Without a group, the failure is raised as it is, in mdloader's words where torch's hide them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from mdloader.distributed.failure import (
    Activity,
    fail_alone,
    group_ended,
    next_job,
    published_failure,
)
from mdloader.distributed.group import current_world
from mdloader.errors import MdloaderError, StopRequested
from mdloader.loading.stateful_loader import lost_worker

T = TypeVar("T")

ACTIVITY = Activity("DeePMD-kit's training")


def ending_together(run: Callable[[], T]) -> T:
    """``run()``; when it raises on a rank of a started group, the job's first published
    failure (this rank's own, when it is the first) is raised instead, on every rank."""
    job = next_job()
    try:
        return run()
    except (SystemExit, KeyboardInterrupt):
        raise
    except StopRequested as exc:  # every rank got the signal: none waits for another
        if not current_world().distributed:
            raise
        group_ended()
        failure = published_failure(job)
        if failure is not None:  # the launcher stopped this rank because another one failed
            raise failure from exc
        raise
    except BaseException as exc:
        said = in_own_words(exc)
        if not current_world().distributed:
            if said is exc:
                raise
            raise said from exc
        group_ended()  # the group is left as it is: a peer may still be inside a collective
        failure = published_failure(job)
        if failure is not None:
            raise failure from exc
        raise fail_alone(said, job=job, activity=ACTIVITY) from exc


def in_own_words(exc: BaseException) -> BaseException:
    """A failure of a DataLoader worker as mdloader says it (a lost worker, a worker's mdloader
    error with its own message); anything else unchanged."""
    lost = lost_worker(exc) if isinstance(exc, RuntimeError) else None
    return lost or worker_error(exc)


def worker_error(exc: BaseException) -> BaseException:
    """An mdloader error raised in a DataLoader worker of DeePMD-kit's trainer, with its own
    message: torch re-raises it as the same type whose message is "Caught ... in DataLoader
    worker process N." and the traceback text, whose last line holds the original message
    (system and file included). Anything else unchanged."""
    text = str(exc)
    head = text.split("\n", 1)[0]
    if not (isinstance(exc, MdloaderError) and head.startswith("Caught ")
            and "DataLoader worker" in head):
        return exc
    last = text.rstrip().splitlines()[-1]
    said = last.split(": ", 1)[1] if ": " in last else last
    try:
        return type(exc)(said)
    except TypeError:  # a type whose constructor takes more: the message alone, typed
        return MdloaderError(said)
