"""Environment-matrix statistics: davg/dstd and stat items equal to DeePMD-kit's
``compute_input_stats`` (se_e2_a, DPA-1) within 1e-10 relative; sums merge over shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import deepmd_ref, stats_data

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.errors import ConfigError
from mdloader.stats.env_mat import (
    EnvMatSettings,
    EnvMatSums,
    davg_dstd,
    smooth_weight,
    system_env_sums,
)
from mdloader.stats.merging import merge_all


def _settings(case: dict) -> EnvMatSettings:
    sel = case["sel"] if isinstance(case["sel"], list) else [case["sel"]]
    return EnvMatSettings(case["rcut"], case["rcut_smth"], tuple(sel), len(case["type_map"]),
                          mixed_types=case["kind"] == "dpa1",
                          env_protection=case["env_protection"],
                          exclude_types=tuple(tuple(p) for p in case["exclude_types"]))


def _cases(gen: dict[str, list[str]]) -> list[dict]:
    oh, ohc = ["O", "H"], ["O", "H", "C"]
    rows = [  # systems, type map, kind, rcut, rcut_smth, sel, set_davg_zero, exclusions, p
        ([str(stats_data.WATER / "data_0")], oh, "se_e2_a", 6.0, 0.5, [46, 92], False, [], 0.0),
        ([str(stats_data.MIXED_PBC)], oh, "dpa1", 6.0, 0.5, 120, False, [], 0.0),
        ([str(p) for p in stats_data.MIXED_NOPBC], ["H", "C", "N", "O"], "dpa1", 4.0, 0.5, 30,
         False, [], 0.0),
        (gen["small"] + gen["tri"], oh, "se_e2_a", 6.0, 2.0, [5, 7], False, [[0, 1]], 0.0),
        (gen["small"], oh, "dpa1", 6.0, 2.0, 9, False, [], 0.0),  # truncated to 9 neighbours
        (gen["mixed"] + gen["nopbc"], ohc, "dpa1", 5.0, 1.0, 6, True, [], 0.1),
        (gen["three"], ohc, "se_e2_a", 5.0, 1.0, [3, 30, 0], False, [], 0.0),  # type C: no data
    ]
    keys = ("systems", "type_map", "kind", "rcut", "rcut_smth", "sel", "set_davg_zero",
            "exclude_types", "env_protection")
    return [dict(zip(keys, row)) for row in rows]


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict, dict, list]]:
    gen = stats_data.generated(tmp_path_factory.mktemp("envmat"))
    cases = _cases(gen)
    theirs = deepmd_ref.run(deepmd_ref.ENV_MAT, {"cases": cases})["cases"]
    ours = [[system_env_sums(DeepmdDataSetForLoader(s, c["type_map"]), _settings(c))
             for s in c["systems"]] for c in cases]
    return list(zip(cases, theirs, ours))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_davg_dstd_and_items_are_deepmd_kits(compared: list) -> None:
    for case, ref, parts in compared:
        settings = _settings(case)
        sums = merge_all(parts)
        mean, std = davg_dstd(sums, settings, set_davg_zero=case["set_davg_zero"])
        np.testing.assert_allclose(mean, ref["mean"], rtol=1e-10, atol=1e-300)
        np.testing.assert_allclose(std, ref["stddev"], rtol=1e-10, atol=0)
        assert sorted(sums.items()) == sorted(ref["items"])
        for key, value in sums.items().items():
            np.testing.assert_allclose(value, ref["items"][key], rtol=1e-10, atol=1e-300)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sums_over_shards_equal_one_shard(compared: list) -> None:
    """Per-system sums merged in any grouping: equal to 1e-12 (sums are float64 additions)."""
    for _case, _ref, parts in compared:
        whole = merge_all(parts)
        for nshards in range(1, 6):
            shards = [merge_all([EnvMatSums.zeros(whole.number.shape[0])] + parts[r::nshards])
                      for r in range(nshards)]
            merged = merge_all(shards)
            np.testing.assert_array_equal(merged.number, whole.number)
            np.testing.assert_allclose(merged.total, whole.total, rtol=1e-12, atol=1e-300)
            np.testing.assert_allclose(merged.squared, whole.squared, rtol=1e-12, atol=1e-300)


def test_frame_subsets_add_up(tmp_path: Path) -> None:
    system = stats_data.generated(tmp_path)["small"][0]
    ds = DeepmdDataSetForLoader(system, ["O", "H"])
    settings = EnvMatSettings(6.0, 1.0, (4, 6), 2)
    whole = system_env_sums(ds, settings)
    halves = merge_all([system_env_sums(ds, settings, frames=[0, 3]),
                        system_env_sums(ds, settings, frames=[1, 2])])
    assert whole.frames == halves.frames == 4
    np.testing.assert_array_equal(whole.number, halves.number)
    np.testing.assert_allclose(whole.total, halves.total, rtol=1e-12)


def test_no_data_gives_deepmd_kits_defaults() -> None:
    settings = EnvMatSettings(6.0, 0.5, (2, 3), 2)
    mean, std = davg_dstd(EnvMatSums.zeros(2), settings)
    assert mean.shape == std.shape == (2, 5, 4)
    assert (mean == 0).all() and (std == 0.1).all()
    sums = EnvMatSums(np.full((2, 2), 4.0), np.full((2, 2), 4.0), np.full((2, 2), 4.0))
    mean, std = davg_dstd(sums, settings)  # zero variance: protected to 1e-2
    assert (mean[:, :, 0] == 1.0).all() and (mean[:, :, 1:] == 0).all() and (std == 1e-2).all()


def test_switch_is_one_inside_and_zero_outside() -> None:
    w = smooth_weight(np.array([0.1, 0.5, 3.25, 6.0, 7.0]), 0.5, 6.0)
    assert w[0] == w[1] == 1.0 and w[3] == w[4] == 0.0 and w[2] == pytest.approx(0.5)


def test_bad_settings_and_merges_are_refused() -> None:
    with pytest.raises(ConfigError, match="rcut_smth must be below rcut, got rcut_smth=6.0"):
        EnvMatSettings(6.0, 6.0, (1, 2), 2)
    with pytest.raises(ConfigError, match=r"one entry per type: 3 types, sel=\[1, 2\]"):
        EnvMatSettings(6.0, 1.0, (1, 2), 3)
    with pytest.raises(ConfigError, match=r"mixed-type descriptor has one sel, got \[1, 2\]"):
        EnvMatSettings(6.0, 1.0, (1, 2), 2, mixed_types=True)
    with pytest.raises(ConfigError, match="statistics of 2 and 3 types cannot be merged"):
        EnvMatSums.zeros(2).merge(EnvMatSums.zeros(3))
