"""Per-feature moments: shares merge by addition into the mean and std of all rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mdloader.errors import ConfigError
from mdloader.stats.merging import merge_all
from mdloader.stats.moments import FeatureMoments


@pytest.mark.parametrize("cuts", [(), (1,), (40, 41, 90), (13, 13, 60)])
def test_any_split_gives_the_mean_and_std_of_all_rows(cuts: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    rows = np.exp(rng.normal(size=(120, 6))) * [1e-3, 1, 10, 0.5, 2, 7] + [0, 0, 5, 0, 1, 0]
    parts = [FeatureMoments.of_rows(p) for p in np.split(rows, cuts)]  # empty shares too
    mean, std = merge_all(parts).mean_std()
    want = torch.as_tensor(rows)
    np.testing.assert_allclose(mean, want.mean(0).numpy(), rtol=1e-13, atol=0)
    np.testing.assert_allclose(std, want.std(0).numpy(), rtol=1e-12, atol=0)


def test_one_row_has_no_spread_and_no_rows_is_an_error() -> None:
    mean, std = FeatureMoments.of_rows(np.array([[2.0, -1.0]])).mean_std()
    assert mean.tolist() == [2.0, -1.0] and std.tolist() == [0.0, 0.0]
    with pytest.raises(ConfigError, match="no atoms in the statistics frames"):
        FeatureMoments.zeros(2).mean_std()
    with pytest.raises(ConfigError, match="cannot be merged: 2 / 3 features"):
        FeatureMoments.zeros(2).merge(FeatureMoments.zeros(3))
