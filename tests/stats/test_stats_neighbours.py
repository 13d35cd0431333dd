"""Neighbour statistics: bit-identical to DeePMD-kit's on real and generated systems, the ``sel``
and ``min_nbor_dist`` rules, and every bad-data path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from support import deepmd_ref, stats_data

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.errors import ConfigError, NonFiniteError
from mdloader.stats.merging import merge_all
from mdloader.stats.neighbours import (
    DegenerateBoxError,
    NeighbourStats,
    OverlappingAtomsError,
    auto_sel_ratio,
    frames_neighbour_stats,
    min_nbor_dist,
    resolve_sel,
    system_neighbour_stats,
)
from mdloader.testing import make_system

SELS = ["auto", "auto:1.5", "auto:0.97", [10, 20], [200, 400]]


def _cases(gen: dict[str, list[str]]) -> list[dict]:
    water = [str(stats_data.WATER / "data_1")]  # two sets, 160 frames of 192 atoms
    nopbc = [str(p) for p in stats_data.MIXED_NOPBC]
    oh, ohc, hcno = ["O", "H"], ["O", "H", "C"], ["H", "C", "N", "O"]
    cases = [
        (water, oh, 6.0, False), (water, oh, 6.0, True),
        ([str(stats_data.MIXED_PBC)], oh, 6.0, True), ([str(stats_data.MIXED_PBC)], oh, 6.0, False),
        (nopbc, hcno, 6.0, True), (nopbc, hcno, 4.0, False),
        (gen["small"], oh, 6.0, False), (gen["small"], oh, 6.0, True),
        (gen["small"] + gen["tri"], oh, 1e-6, True),  # DeePMD-kit's get_min_nbor_dist
        (gen["nopbc"], oh, 4.0, False), (gen["mixed"], ohc, 5.0, True),
        (gen["mixed"], ohc, 5.0, False), (gen["three"], ohc, 5.0, False),
        (gen["tri"], oh, 6.0, False), (gen["tri"], oh, 9.0, True),
    ]
    return [{"systems": s, "type_map": t, "rcut": r, "mixed_type": m, "sels": SELS}
            for s, t, r, m in cases]


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict, dict, dict]]:
    """(case, DeePMD-kit's result, ours per system) for every case, DeePMD-kit run once."""
    gen = stats_data.generated(tmp_path_factory.mktemp("neighbours"))
    cases = _cases(gen)
    theirs = deepmd_ref.run(deepmd_ref.NEIGHBOURS, {"cases": cases})["cases"]
    out = []
    for case, ref in zip(cases, theirs):
        ours = {s: system_neighbour_stats(DeepmdDataSetForLoader(s, case["type_map"]),
                                          case["rcut"], len(case["type_map"]),
                                          mixed_type=case["mixed_type"])
                for s in case["systems"]}
        out.append((case, ref, ours))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_per_system_statistics_are_deepmd_kits_bit_for_bit(compared: list) -> None:
    for case, ref, ours in compared:
        label = f"{case['systems'][0]} rcut={case['rcut']} mixed={case['mixed_type']}"
        assert sorted(ref["systems"]) == sorted(ours), label
        for system, stats in ours.items():
            max_ref, min2_ref = ref["systems"][system]
            assert list(stats.max_neighbours) == max_ref, (label, system)
            assert stats.min_distance2.hex() == min2_ref, (label, system)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_merged_min_nbor_dist_and_sel_are_deepmd_kits(compared: list) -> None:
    for case, ref, ours in compared:
        merged = merge_all(ours.values())
        assert min_nbor_dist(merged).hex() == ref["min_nbor_dist"]
        assert list(merged.max_neighbours) == ref["max_nbor_size"]
        for sel in case["sels"]:
            assert resolve_sel(sel, merged)[0] == ref["sels"][json.dumps(sel)], sel


def test_sel_rule() -> None:
    stats = NeighbourStats(6.0, False, (38, 72))
    assert resolve_sel("auto", stats) == ([44, 80], [])  # int(41.8)=41 -> 44, int(79.2) -> 80
    assert resolve_sel("auto:1.5", stats) == ([60, 108], [])
    chosen, warnings = resolve_sel([46, 0], stats)
    assert chosen == [46, 0] and warnings == []  # 0: the type is meant to be excluded
    chosen, warnings = resolve_sel([30, 90], stats)
    assert chosen == [30, 90] and len(warnings) == 1 and "not less than 38" in warnings[0]
    assert resolve_sel(120, NeighbourStats(6.0, True, (110,))) == ([120], [])
    assert auto_sel_ratio([1, 2]) is None and auto_sel_ratio("auto") == 1.1
    with pytest.raises(ConfigError, match="invalid automatic sel 'auto:x'"):
        auto_sel_ratio("auto:x")
    with pytest.raises(ConfigError, match="invalid automatic sel 'auto:1:2'"):
        auto_sel_ratio("auto:1:2")


def test_min_nbor_dist_is_capped_like_deepmd_kit() -> None:
    assert min_nbor_dist(NeighbourStats(6.0, True, (0,), 4.0)) == 2.0
    assert min_nbor_dist(NeighbourStats(6.0, True, (0,))) == 10.0  # nothing seen: its start
    assert min_nbor_dist(NeighbourStats(6.0, True, (0,), 400.0)) == 10.0


def test_merge_is_min_and_max_and_refuses_other_settings() -> None:
    a = NeighbourStats(6.0, False, (3, 5), 2.0)
    b = NeighbourStats(6.0, False, (4, 1), 1.5)
    assert a.merge(b) == NeighbourStats(6.0, False, (4, 5), 1.5) == b.merge(a)
    assert a.merge(NeighbourStats.empty(6.0, 2, False)) == a
    with pytest.raises(ConfigError, match="different settings.*rcut 6.0 / 5.0"):
        a.merge(NeighbourStats(5.0, False, (1, 1)))


def _system(tmp_path: Path, **kw) -> tuple[str, Path]:
    path = make_system(tmp_path, "bad", natoms=6, nframes=4, dtype=np.float64, **kw)
    return path, Path(path) / "set.000"


def _edit(path: Path, key: str, edit) -> None:
    arr = np.load(path / f"{key}.npy")
    edit(arr)
    np.save(path / f"{key}.npy", arr)


def test_overlapping_atoms_are_named(tmp_path: Path) -> None:
    system, s = _system(tmp_path)

    def overlap(c):
        c[2, 3:6] = c[2, 0:3]  # atom 1 on atom 0 in frame 2
    _edit(s, "coord", overlap)
    with pytest.raises(OverlappingAtomsError,
                       match=r"atoms [01] and [01] of frame 2 overlap.*system: .*bad; "
                             r"file: .*set.000/coord.npy.*found: distance 0"):
        system_neighbour_stats(DeepmdDataSetForLoader(system, ["O", "H"]), 6.0)


def test_overlap_with_a_periodic_image_is_named(tmp_path: Path) -> None:
    system, s = _system(tmp_path)
    box = np.load(s / "box.npy")

    def image(c):
        c[1, 3:6] = c[1, 0:3] + box[1, 0:3]  # atom 1 on the image of atom 0 along a
    _edit(s, "coord", image)
    with pytest.raises(OverlappingAtomsError, match=r"\(periodic image \[-?1, 0, 0\]\) of "
                                                    r"frame 1 overlap"):
        system_neighbour_stats(DeepmdDataSetForLoader(system, ["O", "H"]), 6.0)


@pytest.mark.parametrize("edit,error,match", [
    (lambda b: b.__setitem__(1, 0.0), DegenerateBoxError,
     r"box of frame 1 has no volume.*file: .*set.000/box.npy.*volume 0.0"),
    (lambda b: b.__setitem__((3, 0), np.nan), NonFiniteError,
     r"box of frame 3 is not finite.*file: .*set.000/box.npy"),
    (lambda b: b.__setitem__((2, slice(6, 9)), b[2, 3:6]), DegenerateBoxError,
     r"box of frame 2 has no volume"),
    (lambda b: b.__setitem__((0, 8), -b[0, 8]), DegenerateBoxError,
     r"box of frame 0 is left-handed.*swap two of them.*volume -"),
])
def test_bad_boxes_are_named(tmp_path: Path, edit, error, match) -> None:
    system, s = _system(tmp_path)
    _edit(s, "box", edit)
    with pytest.raises(error, match=match):
        system_neighbour_stats(DeepmdDataSetForLoader(system, ["O", "H"]), 6.0)


def test_non_finite_coordinates_are_named(tmp_path: Path) -> None:
    system, s = _system(tmp_path, pbc=False)
    _edit(s, "coord", lambda c: c.__setitem__((3, 4), np.inf))
    with pytest.raises(NonFiniteError, match=r"coordinates of frame 3 are not finite.*system: "
                                             r".*bad; file: .*set.000/coord.npy"):
        system_neighbour_stats(DeepmdDataSetForLoader(system, ["O", "H"]), 6.0)


def test_isolated_atoms_are_a_finding_not_an_error(tmp_path: Path) -> None:
    system, s = _system(tmp_path, pbc=False)
    _edit(s, "coord", lambda c: c.__setitem__((slice(1, 3), slice(9, 12)), 1000.0))  # atom 3
    stats = system_neighbour_stats(DeepmdDataSetForLoader(system, ["O", "H"]), 10.0)
    (finding,) = stats.findings
    assert finding.frame == 1 and "atom 3" in finding.message and "2 frame(s) of 4" in \
        finding.message and finding.file.endswith("coord.npy")
    assert "system: " in str(finding)
    assert math.isfinite(stats.min_distance2)


def test_lone_atom_without_box_has_infinite_distance(tmp_path: Path) -> None:
    stats = frames_neighbour_stats(np.zeros((2, 1, 3)), np.zeros((2, 1), int), None, 6.0, 2)
    assert stats.min_distance2 == math.inf and stats.max_neighbours == (0, 0)
    assert min_nbor_dist(stats) == 10.0


def test_frames_out_of_range_are_refused(tmp_path: Path) -> None:
    system, _ = _system(tmp_path)
    with pytest.raises(ConfigError, match=r"frame ids out of range \[0, 4\).*bad: \[7\]"):
        system_neighbour_stats(DeepmdDataSetForLoader(system, ["O", "H"]), 6.0, frames=[0, 7])
