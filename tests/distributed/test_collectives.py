"""The small collectives of a job over real ranks: gather, broadcast, flags, failing together."""

from __future__ import annotations

import threading

import pytest
from support.distributed_utils import errors, run_ranks, values

from mdloader.distributed import collectives
from mdloader.errors import (
    MissingDataError,
    RemoteError,
)


def _gather(rank: int, world: int, poison: bool) -> object:
    obj = threading.Lock() if (poison and rank == world - 1) else {"rank": rank, "x": [rank] * 3}
    main = collectives.broadcast_from_main({"seed": 7} if rank == 0 else None)
    return main, collectives.gather_to_main(obj, context="gathering loader states")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_gather_to_main_and_broadcast_from_main_are_framed() -> None:
    got = values(run_ranks(_gather, 3, False))
    assert [main for main, _ in got] == [{"seed": 7}] * 3
    assert got[0][1] == [{"rank": r, "x": [r] * 3} for r in range(3)]
    assert got[1][1] is None and got[2][1] is None


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_gather_with_an_unpicklable_object_fails_every_rank() -> None:
    errs = errors(run_ranks(_gather, 3, True))
    assert len(errs) == 3
    for err in errs:
        assert err.exc_type == "RemoteError"
        assert "rank 2 failed (gathering loader states): TypeError: cannot pickle" in err.message
    assert max(e.finished_at for e in errs) - min(e.finished_at for e in errs) < 5


def _flags_and_failures(rank: int, world: int) -> tuple[list[bool], str]:
    flags = collectives.any_rank([rank == 1, False, rank == 0], activity="a test step")
    mine = MissingDataError("gone", system="/d/s", file="/d/s/set.001/force.npy") \
        if rank == 1 else None
    try:
        collectives.fail_together(mine, context="training step 9")
    except RemoteError as exc:
        return flags, exc.summary
    raise AssertionError("fail_together did not raise")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_any_rank_and_fail_together() -> None:
    got = values(run_ranks(_flags_and_failures, 3))
    assert [flags for flags, _ in got] == [[True, False, True]] * 3
    assert {line for _, line in got} == {
        "rank 1 failed (training step 9): MissingDataError: gone; system: /d/s; "
        "file: /d/s/set.001/force.npy"}
