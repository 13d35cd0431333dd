"""How a failure on one rank ends a ``mdloader dp`` job: every rank at once, with one line.

DeePMD-kit's trainer knows nothing of mdloader's failure channel: a rank whose read fails (or
whose DataLoader worker dies) raised its error alone, and its peers, inside DDP's all-reduce,
ended with gloo's "Connection closed by peer". :func:`ending_together` runs DeePMD-kit's ``dp``
so that the first failure of the job is published in the store of the default group and raised
on every rank as the same :class:`~mdloader.errors.RankFailedError`
(:mod:`mdloader.distributed.failure`); the command line then prints it and leaves at once. A
failure every rank raised at the same point (rank 0's build error, sent to every rank) is
raised as it is, once the ranks met. Without a group, the failure is raised as it is, a dead
worker of the feed's pool as a :class:`~mdloader.errors.WorkerLostError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

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
from mdloader.distributed.group import current_world
from mdloader.errors import StopRequested
from mdloader.loading.pool import lost_worker_error

T = TypeVar("T")

ACTIVITY = Activity("DeePMD-kit's training")


def ending_together(run: Callable[[], T]) -> T:
    """``run()``; when it raises on a rank of a started group, the job's first published
    failure (this rank's own, when it is the first) is raised instead, on every rank; a
    failure every rank raised together is raised as it is."""
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
        world = current_world()
        if not world.distributed:
            if said is exc:
                raise
            raise said from exc
        if failed_together(said):  # every rank holds this very error: no rank to name
            settle(job, world.world_size)
            part_together(job, world.world_size)
            group_ended()
            if said is exc:
                raise
            raise said from exc
        group_ended()  # the group is left as it is: a peer may still be inside a collective
        failure = published_failure(job)
        if failure is not None:
            raise failure from exc
        raise fail_alone(said, job=job, activity=ACTIVITY) from exc


def in_own_words(exc: BaseException) -> BaseException:
    """A failure caused by a dead DataLoader worker of this process, as mdloader says it;
    anything else unchanged."""
    if isinstance(exc, RuntimeError):
        return lost_worker_error() or exc
    return exc
