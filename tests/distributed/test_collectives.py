"""The small collectives of a job over real ranks: gather, broadcast, flags, failing together."""

from __future__ import annotations

import threading

import pytest
from support.distributed_utils import errors, run_ranks, values

from mdloader.distributed import channel, collectives, packets
from mdloader.errors import (
    MissingDataError,
    RemoteError,
)


def _share(rank: int) -> object:
    """Statistics-like shares of very unequal sizes: none, a few bytes, 200 kB."""
    return [None, {"r": 1}, bytes(range(256)) * 800][rank % 3]


def _gather(rank: int, world: int, poison: bool) -> object:
    obj = threading.Lock() if (poison and rank == world - 1) else {"rank": rank, "x": [rank] * 3}
    main = collectives.broadcast_from_main({"seed": 7} if rank == 0 else None)
    gathered = collectives.gather_to_main(obj, context="gathering loader states")
    if poison:
        return main, gathered
    return main, gathered, collectives.gather_from_every_rank(_share(rank))


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_gather_to_main_and_broadcast_from_main_are_framed() -> None:
    got = values(run_ranks(_gather, 3, False))
    assert [g[0] for g in got] == [{"seed": 7}] * 3
    assert got[0][1] == [{"rank": r, "x": [r] * 3} for r in range(3)]
    assert got[1][1] is None and got[2][1] is None
    # unequal shares travel at their own lengths (one broadcast each), equal ones padded
    lengths = [len(packets.data_packet(_share(r), rank=r).payload) for r in range(3)]
    assert channel.gather_plan(lengths) == "broadcasts"
    assert [g[2] for g in got] == [[_share(r) for r in range(3)]] * 3


def test_gather_plan_pads_only_what_at_most_doubles_the_bytes() -> None:
    assert channel.gather_plan([0, 0, 0]) == "none"
    assert channel.gather_plan([]) == "none"
    assert channel.gather_plan([100, 100, 99]) == "padded"
    assert channel.gather_plan([100, 50, 50, 0]) == "padded"  # 400 <= 2 * 200
    assert channel.gather_plan([100, 40, 50, 0]) == "broadcasts"  # 400 > 2 * 190
    assert channel.gather_plan([10] * 1023 + [10_000]) == "broadcasts"


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
