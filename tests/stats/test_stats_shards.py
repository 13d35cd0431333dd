"""Shares of systems on a grid of world sizes, in one process: disjoint, complete, balanced, and
the statistics merged over shares equal those of one share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import stats_data

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.errors import ConfigError
from mdloader.stats import env_mat, neighbours
from mdloader.stats.merging import merge_all
from mdloader.stats.shards import assign, share, system_weights


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8, 64])
def test_shares_are_disjoint_complete_and_balanced(world_size: int) -> None:
    rng = np.random.default_rng(world_size)
    weights = system_weights(rng.integers(1, 50, 200), rng.integers(3, 300, 200))
    shares = [share(weights, r, world_size) for r in range(world_size)]
    together = np.sort(np.concatenate(shares))
    assert together.tolist() == list(range(200))
    loads = np.array([weights[s].sum() for s in shares])
    assert loads.max() - loads.min() <= weights.max()  # greedy bound
    assert (assign(weights, world_size) == assign(weights, world_size)).all()


def test_more_ranks_than_systems_leaves_ranks_idle() -> None:
    shares = [share([5, 1], r, 4) for r in range(4)]
    assert [s.tolist() for s in shares] == [[0], [1], [], []]


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ConfigError, match="world_size must be >= 1, got 0"):
        assign([1], 0)
    with pytest.raises(ConfigError, match=r"rank must be in \[0, 2\), got 2"):
        share([1], 2, 2)
    with pytest.raises(ConfigError, match="weights must be >= 0, got -1"):
        assign([1, -1], 2)
    with pytest.raises(ConfigError, match="3 frame counts for 2 atom counts"):
        system_weights([1, 2, 3], [1, 2])


@pytest.mark.timeout(300)
def test_statistics_merged_over_shares_equal_one_share(tmp_path: Path) -> None:
    gen = stats_data.generated(tmp_path)
    systems = gen["small"] + gen["tri"] + gen["three"] + gen["nopbc"]
    data = [DeepmdDataSetForLoader(s, ["O", "H", "C"]) for s in systems]
    weights = system_weights([len(d) for d in data], [d.meta.natoms for d in data])
    settings = env_mat.EnvMatSettings(5.0, 1.0, (4, 6, 2), 3)
    nb = [neighbours.system_neighbour_stats(d, 5.0, 3) for d in data]
    em = [env_mat.system_env_sums(d, settings) for d in data]
    nb_one, em_one = merge_all(nb), merge_all(em)
    for world_size in range(1, 6):
        nb_parts, em_parts = [], []
        for r in range(world_size):
            mine = share(weights, r, world_size).tolist()
            nb_parts.append(merge_all(
                [neighbours.NeighbourStats.empty(5.0, 3, False)] + [nb[i] for i in mine]))
            em_parts.append(merge_all([env_mat.EnvMatSums.zeros(3)] + [em[i] for i in mine]))
        got = merge_all(nb_parts)
        assert got == nb_one and got.min_distance2 == nb_one.min_distance2
        sums = merge_all(em_parts)
        np.testing.assert_array_equal(sums.number, em_one.number)
        np.testing.assert_allclose(sums.total, em_one.total, rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(sums.squared, em_one.squared, rtol=1e-12, atol=1e-300)
