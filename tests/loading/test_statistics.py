"""The sharded statistics pass (:mod:`mdloader.loading.statistics`): shares merged on every rank,
the per-system cache (hit, miss, stale, refresh, off) and failures as one line on every rank."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from support.distributed_utils import RankError, run_ranks, values

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.schema import DataRequirementItem
from mdloader.loading.build import build_systems
from mdloader.loading.statistics import input_statistics, neighbour_statistics
from mdloader.stats import store
from mdloader.stats.env_mat import EnvMatSettings, system_env_sums
from mdloader.stats.merging import merge_all
from mdloader.stats.neighbours import OverlappingAtomsError, system_neighbour_stats
from mdloader.testing import make_system

TYPE_MAP = ["O", "H"]


def _systems(root: Path) -> list[str]:
    out = [make_system(root, f"p{i}", natoms=n, nframes=4, nsets=2, seed=i)
           for i, n in enumerate((6, 9, 12, 5))]
    out.append(make_system(root, "h5", natoms=8, nframes=3, backend="hdf5", seed=7))
    out.append(make_system(root, "free", natoms=7, nframes=3, pbc=False, seed=8))
    return out


def _one_by_one(systems: list[str], rcut: float, mixed: bool):
    return merge_all(system_neighbour_stats(DeepmdDataSetForLoader(s, TYPE_MAP), rcut, 2,
                                            mixed_type=mixed) for s in systems)


def test_single_process_equals_system_by_system(tmp_path: Path) -> None:
    systems = _systems(tmp_path / "d")
    datasets = [DeepmdDataSetForLoader(s, TYPE_MAP) for s in systems]
    for mixed in (False, True):
        ours = neighbour_statistics(datasets, 3.0, type_map=TYPE_MAP, mixed_type=mixed,
                                    mode="off")
        assert ours == _one_by_one(systems, 3.0, mixed)


def _rank_body(rank: int, world_size: int, root: list[str], cache: str, mixed: bool) -> dict:
    datasets = build_systems(root, TYPE_MAP, index_mode="off")
    import mdloader.loading.statistics as st

    computed = []
    real = st.system_neighbour_stats

    def spy(ds, *a, **k):
        computed.append(ds.meta.address)
        return real(ds, *a, **k)

    st.system_neighbour_stats = spy
    stats = neighbour_statistics(datasets, 3.0, type_map=TYPE_MAP, mixed_type=mixed,
                                 folder=cache, mode="check")
    return {"stats": (stats.max_neighbours, stats.min_distance2), "computed": computed}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_ranks_take_disjoint_shares_and_agree(tmp_path: Path) -> None:
    systems = _systems(tmp_path / "d")
    cache = str(tmp_path / "cache")
    res = values(run_ranks(_rank_body, 2, systems, cache, False, timeout=120))
    expected = _one_by_one(systems, 3.0, False)
    for r in res:
        assert r["stats"] == (expected.max_neighbours, expected.min_distance2)
    a, b = set(res[0]["computed"]), set(res[1]["computed"])
    assert a and b and not a & b and len(a | b) == len(systems)
    again = values(run_ranks(_rank_body, 2, systems, cache, False, timeout=120))
    assert again[0]["stats"] == res[0]["stats"]
    assert again[0]["computed"] == again[1]["computed"] == []  # every system from the cache


def _overlap_body(rank: int, world_size: int, root: str) -> None:
    datasets = build_systems([root], TYPE_MAP, index_mode="off")
    neighbour_statistics(datasets, 3.0, type_map=TYPE_MAP, mixed_type=False, mode="off")


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_overlapping_atoms_fail_every_rank_with_one_line(tmp_path: Path) -> None:
    systems = _systems(tmp_path / "d")
    coord_file = Path(systems[1]) / "set.001" / "coord.npy"
    coord = np.load(coord_file)
    coord[1, 3:6] = coord[1, 0:3]
    np.save(coord_file, coord)
    outcomes = run_ranks(_overlap_body, 2, str(tmp_path / "d"), timeout=120)
    messages = set()
    for outcome in outcomes:
        assert isinstance(outcome, RankError), outcome
        assert outcome.exc_type == "RemoteError"
        messages.add(outcome.message.splitlines()[0])  # the rest is the remote traceback
    (message,) = messages  # the same first line on both ranks
    assert "OverlappingAtomsError" in message and "frame 3" in message
    assert f"system: {systems[1]}" in message and str(coord_file) in message


def test_cache_hit_miss_stale_refresh(tmp_path: Path) -> None:
    systems = _systems(tmp_path / "d")
    cache = str(tmp_path / "cache")
    import mdloader.loading.statistics as st

    computed: list[str] = []
    real = st.system_neighbour_stats

    def spy(ds, *a, **k):
        computed.append(ds.meta.address)
        return real(ds, *a, **k)

    def run(mode: str = "check", rcut: float = 3.0):
        computed.clear()
        datasets = [DeepmdDataSetForLoader(s, TYPE_MAP) for s in systems]
        return neighbour_statistics(datasets, rcut, type_map=TYPE_MAP, mixed_type=False,
                                    folder=cache, mode=mode)

    st.system_neighbour_stats = spy
    try:
        first = run()
        assert len(computed) == len(systems)
        assert run() == first and computed == []  # hit
        assert run(rcut=3.5) != first and len(computed) == len(systems)  # other settings: miss
        # rewrite one array in place, same shape and size: stale, recomputed, never reused
        time.sleep(0.01)
        coord_file = Path(systems[0]) / "set.000" / "coord.npy"
        coord = np.load(coord_file)
        coord[0] *= 0.5
        np.save(coord_file, coord)
        changed = run()
        assert computed == [systems[0]]
        assert changed == _one_by_one(systems, 3.0, False)
        assert run(mode="refresh") == changed and len(computed) == len(systems)
        assert run(mode="off") == changed and len(computed) == len(systems)
        shutil.rmtree(cache)
        assert run() == changed and len(computed) == len(systems)  # only this run's entries
        entries = sorted(Path(cache).rglob("*.mdlstat"))
        assert len(entries) == len(systems)
        entries[0].write_bytes(b"not msgpack")  # a corrupt entry: warned, recomputed
        assert run() == changed and len(computed) == 1
    finally:
        st.system_neighbour_stats = real


def test_overlap_in_one_process_names_system_file_and_frame(tmp_path: Path) -> None:
    system = make_system(tmp_path, "s", natoms=6, nframes=3, seed=1)
    coord_file = Path(system) / "set.000" / "coord.npy"
    coord = np.load(coord_file)
    coord[2, 3:6] = coord[2, 0:3]
    np.save(coord_file, coord)
    with pytest.raises(OverlappingAtomsError, match=r"frame 2 overlap.*system: .*file: .*coord"):
        neighbour_statistics([DeepmdDataSetForLoader(system, TYPE_MAP)], 3.0,
                             type_map=TYPE_MAP, mixed_type=False, mode="off")



def test_lmdb_frames_without_a_box_are_non_periodic(tmp_path: Path) -> None:
    """An LMDB database of molecules stores frames without cells: they count as non-periodic,
    as DeePMD-kit reads them, and give the numbers of the same systems stored as npy folders."""
    from mdloader.catalog.discover import discover_systems
    from mdloader.testing import make_lmdb

    free = [make_system(tmp_path / "npy", f"m{i}", natoms=n, nframes=3, pbc=False, seed=20 + i)
            for i, n in enumerate((5, 7))]
    database = make_lmdb(tmp_path / "mol.lmdb", free, type_map=TYPE_MAP)
    groups = discover_systems([database])
    from_lmdb = neighbour_statistics([DeepmdDataSetForLoader(g, TYPE_MAP) for g in groups], 3.0,
                                     type_map=TYPE_MAP, mixed_type=False, mode="off")
    assert from_lmdb == _one_by_one(free, 3.0, False)


def test_input_statistics_of_chosen_frames_share_the_all_frames_cache(tmp_path: Path) -> None:
    """``frames`` chooses each system's frames (``None``: all); a system whose choice is all
    frames uses the same cache entries as a run over all frames, a chosen subset its own."""
    systems = _systems(tmp_path / "d")
    cache = str(tmp_path / "cache")
    block = EnvMatSettings(3.0, 0.5, (8, 16), 2)
    chosen = {0: [3, 1], 4: [2, 0]}  # frames of a set each, and of two sets (p0: 2 sets of 2)

    def datasets() -> list[DeepmdDataSetForLoader]:
        out = [DeepmdDataSetForLoader(s, TYPE_MAP) for s in systems]
        for ds in out:
            ds.add_data_requirement([DataRequirementItem("energy", 1, atomic=False,
                                                         must=False, high_prec=True)])
        return out

    import mdloader.loading.statistics as st

    computed: list[tuple[str, object]] = []
    real = st.system_env_sums

    def spy(ds, settings, *, frames=None):
        computed.append((ds.meta.address, None if frames is None else sorted(frames)))
        return real(ds, settings, frames=frames)

    st.system_env_sums = spy
    try:
        sums, samples = input_statistics(datasets(), [block], type_map=TYPE_MAP, folder=cache,
                                         mode="check", frames=chosen.get)
        assert sorted(computed, key=str) == sorted(
            [(s, sorted(chosen[i]) if i in chosen else None) for i, s in enumerate(systems)],
            key=str)
        expected = merge_all(system_env_sums(ds, block, frames=chosen.get(i))
                                     for i, ds in enumerate(datasets()))
        np.testing.assert_allclose(sums[0].total, expected.total, rtol=1e-14)
        np.testing.assert_array_equal(sums[0].number, expected.number)
        for i, (part, ds) in enumerate(zip(samples, datasets())):
            assert part.positions[:, 0].tolist() == [i] * len(part.positions)
            assert part.positions[:, 1].tolist() == sorted(chosen.get(i, range(len(ds))))
        computed.clear()
        input_statistics(datasets(), [block], type_map=TYPE_MAP, folder=cache, mode="check")
        assert sorted(computed) == sorted((systems[i], None) for i in chosen)  # the rest: cached
    finally:
        st.system_env_sums = real


@pytest.mark.parametrize("cause", ["a file", "read-only"])
def test_a_cache_that_cannot_be_written_costs_one_line_per_cause(tmp_path: Path, cause,
                                                                 caplog, monkeypatch) -> None:
    """20 systems, two settings: one warning per cause with the count, not one per entry."""
    systems = [make_system(tmp_path / "d", f"s{i:02d}", natoms=5, nframes=2, seed=i)
               for i in range(20)]
    cache = tmp_path / "cache"
    if cause == "a file":
        cache.write_text("not a folder")
    else:
        cache.mkdir()
        cache.chmod(0o500)
        if os.access(cache, os.W_OK):  # root writes anyway: the write is refused as it would be
            def refused(path, *args, **kwargs):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            monkeypatch.setattr(store, "write_atomic", refused)
    datasets = [DeepmdDataSetForLoader(s, TYPE_MAP) for s in systems]
    try:
        with caplog.at_level("WARNING"):
            for rcut in (3.0, 4.0):
                neighbour_statistics(datasets, rcut, type_map=TYPE_MAP, mixed_type=False,
                                     folder=str(cache), mode="check")
    finally:
        if cause == "read-only":
            cache.chmod(0o700)
    lines = [r.getMessage() for r in caplog.records if "statistics cache" in r.getMessage()]
    assert lines and len(lines) <= 2, lines  # one per cause (a file: reading and saving)
    assert any("20 entries cannot be saved" in line for line in lines), lines
    assert all(str(cache) in line for line in lines)
