"""Energy bias: DeePMD-kit's ``compute_output_stats`` reproduced from gathered per-frame samples,
the same whatever the shares."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import deepmd_ref, stats_data

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.schema import DataRequirementItem
from mdloader.errors import ConfigError, NonFiniteError
from mdloader.stats.merging import merge_all
from mdloader.stats.output import OutputSamples, output_bias, system_samples
from mdloader.testing import make_system

ENERGY = DataRequirementItem("energy", 1, atomic=False, must=False, high_prec=True)


def _samples(systems: list[str], type_map: list[str]) -> list[OutputSamples]:
    out = []
    for position, system in enumerate(systems):
        ds = DeepmdDataSetForLoader(system, type_map)
        ds.add_data_requirement([ENERGY])
        out.append(system_samples(ds, position))
    return out


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict, dict, list]]:
    gen = stats_data.generated(tmp_path_factory.mktemp("output"))
    water = [str(stats_data.WATER / f"data_{i}") for i in range(4)]
    cases = [
        {"systems": water, "type_map": ["O", "H"], "rcond": None, "preset": None},
        {"systems": water, "type_map": ["O", "H"], "rcond": 1e-3, "preset": [None, -0.5]},
        {"systems": [str(stats_data.MIXED_PBC)] + gen["small"], "type_map": ["O", "H"],
         "rcond": None, "preset": None},
        {"systems": gen["mixed"] + gen["three"], "type_map": ["O", "H", "C"], "rcond": None,
         "preset": None},
    ]
    theirs = deepmd_ref.run(deepmd_ref.OUTPUT, {"cases": cases})["cases"]
    return [(c, r, _samples(c["systems"], c["type_map"])) for c, r in zip(cases, theirs)]


def _preset(case: dict) -> np.ndarray | None:
    if case["preset"] is None:
        return None
    return np.array([[np.nan if v is None else v] for v in case["preset"]])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_energy_bias_is_deepmd_kits(compared: list) -> None:
    for case, ref, parts in compared:
        bias, std = output_bias(merge_all(parts), rcond=case["rcond"],
                                assigned_bias=_preset(case))
        np.testing.assert_allclose(bias, ref["bias"], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(std, ref["std"], rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shares_merge_to_the_same_samples_and_bias(compared: list) -> None:
    for case, _ref, parts in compared:
        whole = merge_all(parts)
        for nshards in range(1, 6):
            shares = [merge_all([OutputSamples.empty("energy", whole.counts.shape[1])]
                                + parts[r::nshards]) for r in range(nshards)]
            merged = merge_all(shares[::-1])  # any order of shares
            np.testing.assert_array_equal(merged.counts, whole.counts)
            np.testing.assert_array_equal(merged.labels, whole.labels)
            np.testing.assert_array_equal(output_bias(merged, rcond=case["rcond"])[0],
                                          output_bias(whole, rcond=case["rcond"])[0])


def test_frames_without_the_label_are_left_out(tmp_path: Path) -> None:
    with_e = make_system(tmp_path, "a", natoms=4, nframes=3)
    without = make_system(tmp_path, "b", natoms=5, nframes=2, keys=("force",))
    parts = _samples([with_e, without], ["O", "H"])
    assert parts[1].counts.shape == (0, 2)
    merged = merge_all(parts)
    assert merged.positions.tolist() == [[0, 0], [0, 1], [0, 2]]
    with pytest.raises(ConfigError, match="no frame carries 'energy'"):
        output_bias(parts[1])


def test_non_finite_labels_and_bad_merges_are_refused(tmp_path: Path) -> None:
    system = make_system(tmp_path, "nan", natoms=4, nframes=3, dtype=np.float64)
    energy = Path(system) / "set.000" / "energy.npy"
    values = np.load(energy)
    values[1] = np.nan
    np.save(energy, values)
    with pytest.raises(NonFiniteError, match=r"energy of frame 1 is not finite.*system: .*nan"):
        _samples([system], ["O", "H"])
    ds = DeepmdDataSetForLoader(system, ["O", "H"])
    with pytest.raises(ConfigError, match="does not require 'energy'"):
        system_samples(ds, 0)
    with pytest.raises(ConfigError, match="cannot be merged: key 'energy' / 'dos'"):
        OutputSamples.empty("energy", 2).merge(OutputSamples.empty("dos", 2))
