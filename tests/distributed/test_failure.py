"""How a job of several ranks ends after a failure: together, alone, killed, stopped by a peer."""

from __future__ import annotations

import re
import time

import pytest
import torch
from support.distributed_utils import errors, run_ranks, values

from mdloader.distributed import failure, group
from mdloader.errors import (
    MissingDataError,
    StopRequested,
)


def _settle(rank: int, world: int) -> tuple[bool, float, bool, float]:
    start = time.monotonic()
    alone = failure.settle(100, world, seconds=1.0) if rank == 0 else time.sleep(1.5)
    waited = time.monotonic() - start
    start = time.monotonic()
    together = failure.settle(101, world, seconds=30.0)
    return bool(alone), waited, together, time.monotonic() - start


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_the_failure_barrier_is_bounded_on_every_rank() -> None:
    """A rank that does not come is waited for ``seconds`` at most (gloo's monitored_barrier
    bounds rank 0 only: the others wait for the whole group timeout)."""
    (alone, waited, together, quick), (_, _, together1, quick1) = values(run_ranks(_settle, 2))
    print(f"rank 0 waited {waited:.3f} s alone; both came in {quick:.3f} s on rank 0 (0.5 s "
          f"before rank 1), {quick1:.3f} s on rank 1")
    assert not alone and 1.0 <= waited < 10  # measured 1.005-1.023 s; 10 s is a hang guard
    assert together and together1
    # measured 0.50-0.55 s on rank 0 (it comes 0.5 s before rank 1) and under 0.01 s on rank 1:
    # 5 s is a hang guard, far below the 30 s the barrier waits for a rank that does not come
    assert max(quick, quick1) < 5.0


def _fail_alone(rank: int, world: int) -> tuple[str, str, bool]:
    import torch.distributed as dist

    with group.process_group(failure.Activity("training step 3")):
        if rank == 1:
            raise MissingDataError("gone", system="/d/s", file="/d/s/set.001/force.npy")
        dist.all_reduce(torch.ones(1))  # waits for rank 1, which failed and left
    raise AssertionError("unreachable")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_that_fails_alone_names_itself_on_every_rank() -> None:
    """Rank 1 publishes its failure and leaves; rank 0's collective breaks at once and it raises
    rank 1's failure from the store, not its own broken connection."""
    errs = errors(run_ranks(_fail_alone, 2, init_group=False))  # process_group starts it
    for err in errs:
        assert err.exc_type == "RankFailedError", str(err)
        assert err.message.startswith(
            "rank 1 failed (training step 3): MissingDataError: gone; system: /d/s; "
            "file: /d/s/set.001/force.npy")
    # measured 0.02-0.04 s: a hang guard, far below the group's timeout (600 s)
    assert errs[0].finished_at - errs[1].finished_at < 5


def _killed_without_a_word(rank: int, world: int) -> None:
    import os

    import torch.distributed as dist

    with group.process_group(failure.Activity("training step 5")):
        if rank == 1:
            os._exit(9)  # as a SIGKILL would: nothing published
        dist.all_reduce(torch.ones(1))


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_killed_outright_is_named_as_a_rank_that_left() -> None:
    rank0, rank1 = run_ranks(_killed_without_a_word, 2, init_group=False)
    assert rank1.exc_type == "ProcessDied" and rank0.exc_type == "RankFailedError", rank0
    assert re.match(r"rank 0 failed \(training step 5\): DistributedError: another rank left "
                    r"the job during training step 5 \(it failed or was killed: see its own "
                    r"output and the launcher's\); gloo: .*Connection (closed|reset) by peer",
                    rank0.message), rank0.message


def _stopped_after_a_peer_failed(rank: int, world: int) -> None:
    import torch.distributed as dist

    with group.process_group(failure.Activity("building the loader")):
        if rank == 1:
            raise MissingDataError("gone", system="/d/s", file="/d/s/set.001/force.npy")
        store = dist.distributed_c10d._get_default_store()
        while not store.check(["mdloader/job0/failure"]):  # rank 1 published its failure
            time.sleep(0.01)
        raise StopRequested("SIGTERM")  # what the launcher's SIGTERM raises before step 1


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_stopped_because_a_peer_failed_reports_the_failure() -> None:
    """torchrun sends SIGTERM to the other ranks once one has failed: a rank stopped that way
    before the first step prints the failure, the same line as the failing rank, not its stop."""
    errs = errors(run_ranks(_stopped_after_a_peer_failed, 2, init_group=False))
    assert [e.exc_type for e in errs] == ["RankFailedError", "RankFailedError"], errs
    assert {e.message.splitlines()[0] for e in errs} == {
        "rank 1 failed (building the loader): MissingDataError: gone; system: /d/s; "
        "file: /d/s/set.001/force.npy"}


def _depart_after_a_shared_failure(rank: int, world: int) -> tuple[float, float]:
    from mdloader.errors import RemoteError

    try:
        with group.process_group(failure.Activity("building the systems")):
            raise RemoteError(origin_rank=0, exc_type="ConfigError", exc_message="no systems",
                              context="discovering and building the systems")
    except RemoteError:
        pass
    if rank == 1:
        time.sleep(1.5)  # a long road to its own line (DeePMD-kit's ``@record``, a loaded CPU)
    said = time.time()
    failure.exit_now = lambda code: None  # type: ignore[assignment]  # to report back
    failure.depart(2)
    return said, time.time()


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_no_rank_leaves_a_shared_failure_before_every_rank_has_said_it() -> None:
    """The launcher stops the other ranks as soon as one exits: the first rank to leave used to
    end a peer still on its way to the failure line, so that only one rank said it."""
    (said0, left0), (said1, left1) = values(run_ranks(_depart_after_a_shared_failure, 2,
                                                      init_group=False))
    print(f"rank 0 said it at +0 s and left at +{left0 - said0:.3f} s; rank 1 said it at "
          f"+{said1 - said0:.3f} s")
    assert left0 >= said1 and left1 >= said1
    # rank 0 waits for rank 1 only, not SETTLE_SECONDS: measured 1.5 s; hang guard at 8 s
    assert left0 - said0 < 8.0
