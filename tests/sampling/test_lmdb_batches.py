"""The batches of an LMDB pass as pure functions: DeePMD-kit's rules, ``mix:N``'s atom budget,
and mdloader's guarantees (per-pass reshuffle, rank shares on grids, exact and elastic resume)."""

from __future__ import annotations

import numpy as np
import pytest

from mdloader.sampling import lmdb_batches as lb

NLOCS = np.array([4, 6, 8, 6, 4, 10, 8, 6, 4, 12, 3, 30, 7, 7, 5, 9] * 4)


def _pass(rule: str, epoch: int = 0, seed: int | None = 7, ragged: bool = False
          ) -> list[list[int]]:
    parsed = lb.parse_lmdb_rule(rule)
    kept = lb.kept_frames(parsed, NLOCS)
    return lb.pass_batches(parsed, NLOCS, lb.batch_groups(parsed, NLOCS, kept), seed=seed,
                           epoch=epoch, ragged=ragged)


@pytest.mark.parametrize("spec", ["filter:", "filter:0", "max:-5", "mix:x", "min:3", "auto:"])
def test_malformed_rules_are_refused_with_deepmd_messages(spec: str) -> None:
    with pytest.raises(ValueError, match=f"Unsupported batch_size '{spec}'"):
        lb.parse_lmdb_rule(spec)


def test_per_nloc_sizes_follow_deepmd_rules() -> None:
    sizes = {rule: [lb.batch_size_for_nloc(lb.parse_lmdb_rule(rule), n) for n in (1, 6, 40)]
             for rule in ("auto", "auto:12", "max:12", "filter:12", "mix:12", 5)}
    assert sizes == {"auto": [32, 6, 1], "auto:12": [12, 2, 1], "max:12": [12, 2, 1],
                     "filter:12": [12, 2, 1], "mix:12": [12, 2, 1], 5: [5, 5, 5]}


@pytest.mark.parametrize("rule", ["auto:16", "max:20", "filter:10", 3])
def test_uniform_rules_keep_one_atom_count_and_every_kept_frame(rule: object) -> None:
    batches = _pass(rule)  # type: ignore[arg-type]
    assert all(len({int(NLOCS[i]) for i in b}) == 1 for b in batches)
    flat = sorted(i for b in batches for i in b)
    expected = lb.kept_frames(lb.parse_lmdb_rule(rule), NLOCS).tolist()  # type: ignore
    assert flat == expected


@pytest.mark.parametrize("ragged", [False, True])
def test_mix_fills_batches_to_the_atom_budget(ragged: bool) -> None:
    budget = 24
    batches = _pass(f"mix:{budget}", ragged=ragged)
    assert sorted(i for b in batches for i in b) == list(range(len(NLOCS)))
    assert any(len({int(NLOCS[i]) for i in b}) > 1 for b in batches)
    for batch in batches:
        atoms = NLOCS[batch]
        axis = atoms.sum() if ragged else len(batch) * atoms.max()
        assert axis <= budget or len(batch) == 1  # a frame above the budget rides alone
    alone = [b for b in batches if len(b) == 1 and NLOCS[b[0]] > budget]
    assert len(alone) == np.count_nonzero(NLOCS > budget) == 4


def test_chop_mixed_rectangular_sorts_and_cuts_greedily() -> None:
    nlocs = np.array([5, 2, 3, 9, 2])
    assert lb.chop_mixed(np.arange(5), nlocs, 9, ragged=False) == [[1, 4, 2], [0], [3]]
    assert lb.chop_mixed(np.arange(5), nlocs, 9, ragged=True) == [[0, 1], [2], [3], [4]]
    assert lb.chop_mixed(np.array([], dtype=int), nlocs, 9, ragged=True) == []


def test_each_pass_is_a_function_of_seed_and_epoch() -> None:
    assert _pass("mix:24", epoch=3) == _pass("mix:24", epoch=3)
    assert _pass("mix:24", epoch=3) != _pass("mix:24", epoch=4)
    assert _pass("auto:16", seed=1, epoch=2) == _pass("auto:16", seed=2, epoch=1)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_rank_shares_cover_the_pass_with_equal_counts(world: int) -> None:
    batches = _pass("mix:24")
    shares = [lb.rank_batches(batches, rank, world) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1
    assert len(shares[0]) == -(-len(batches) // world)
    seen = [tuple(b) for share in shares for b in share]
    assert set(seen) == {tuple(b) for b in batches}
    assert len(seen) - len(batches) == (-len(batches)) % world  # padding repeats the start


def test_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2 ranks"):
        lb.rank_batches([[0]], 2, 2)


@pytest.mark.parametrize("old_world,new_world", [(2, 2), (2, 3), (4, 1), (3, 5)])
def test_resume_reads_exactly_the_rest_of_the_pass(old_world: int, new_world: int) -> None:
    batches = _pass("mix:24", epoch=5)
    steps = 3
    consumed = steps * old_world  # every rank read `steps` batches before the stop
    read = [b for rank in range(old_world)
            for b in lb.rank_batches(batches, rank, old_world)[:steps]]
    rest = [b for rank in range(new_world)
            for b in lb.resume_batches(batches, consumed, rank, new_world)]
    assert sorted(map(tuple, read)) == sorted(map(tuple, batches[:consumed]))
    assert {tuple(b) for b in rest} == {tuple(b) for b in batches[consumed:]}
    with pytest.raises(ValueError, match="outside a pass"):
        lb.resume_batches(batches, len(batches) + 1, 0, 1)
