"""An LMDB database under the loader: groups are systems for every sampling rule, exact resume
with and without workers, one environment per process (bounded, reopened after a fork), and a
2-rank gloo build where only rank 0 touches the database."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.distributed_utils import run_ranks, values
from support.fs_audit import count_data_touches

from mdloader import DpLoaderSet, get_weighted_sampler
from mdloader.data.formats import address_sort_key
from mdloader.data.formats.lmdb import environment as lmdb_io
from mdloader.data.formats.lmdb import metadata as lmdb_metadata
from mdloader.data.formats.lmdb.frame_runs import FrameRuns, decode_runs, encode_runs, run_bounds
from mdloader.data.formats.lmdb.groups import _restore_group, group_frames
from mdloader.loading.build import build_systems_with_report
from mdloader.loading.stateful_loader import StatefulLoader
from mdloader.testing import make_lmdb, make_system

TYPE_MAP = ["O", "H"]


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("lmdb")
    systems = [make_system(root / "src", f"s{i}", natoms=3 + i % 3, nframes=6 + 2 * i, seed=i)
               for i in range(5)]
    return make_lmdb(root / "train.lmdb", systems)


# -- pure pieces ------------------------------------------------------------------------------
def test_frame_runs_round_trip_and_stay_small() -> None:
    idx = np.array([3, 4, 5, 9, 10, 300, 70000])
    starts, lengths = run_bounds(idx)
    assert starts.tolist() == [3, 9, 300, 70000] and lengths.tolist() == [3, 2, 1, 1]
    blob = encode_runs(starts, lengths)
    # first start 3 (uint8), then pairs in uint32: the gap before 70000 needs it
    assert blob[0] == 2 and len(blob) == 1 + 1 + 8 * 4
    assert [x.tolist() for x in decode_runs(blob)] == [starts.tolist(), lengths.tolist()]
    runs = FrameRuns.of(idx)
    assert runs.keys([0, 2, 3, 6]).tolist() == [3, 5, 9, 70000] and runs.nruns == 4
    assert runs.all_keys().tolist() == idx.tolist()
    one = FrameRuns.of(np.arange(10**6, 2 * 10**6))
    assert len(pickle.dumps(one)) < 120 and one.keys([5]).tolist() == [10**6 + 5]


def test_grouping_one_million_frames_gives_a_small_description() -> None:
    rng = np.random.default_rng(0)
    sizes = rng.integers(10, 200, size=10_000)
    sids = np.repeat(np.arange(len(sizes)), sizes)
    nlocs = rng.integers(3, 25, size=len(sizes))[sids]
    nlocs[::7] = 99  # some systems mix two atom counts: interleaved frames, many runs
    groups = group_frames(nlocs, sids)
    assert sum(r.nframes for r in groups.values()) == len(sids)
    assert list(groups) == sorted(groups)
    key = next(iter(groups))
    np.testing.assert_array_equal(groups[key].all_keys(),
                                  np.flatnonzero((sids == key[0]) & (nlocs == key[1])))
    described = [_restore_group(r.nframes, r.blob, "012d", (1, 0)) for r in groups.values()]
    per_frame = len(pickle.dumps(described)) / len(sids)
    assert per_frame < 1.5, per_frame  # one run per group would be ~0.2


def test_group_addresses_sort_by_number() -> None:
    names = ["/d/x.lmdb#system=10,natoms=3", "/d/x.lmdb#system=9,natoms=12",
             "/d/x.lmdb#system=9,natoms=4", "/d/a_dir", "/d/y.h5#/g"]
    assert sorted(names, key=address_sort_key) == [
        "/d/a_dir", "/d/x.lmdb#system=9,natoms=4", "/d/x.lmdb#system=9,natoms=12",
        "/d/x.lmdb#system=10,natoms=3", "/d/y.h5#/g"]


# -- the loader -------------------------------------------------------------------------------
def test_groups_are_systems_for_batch_sizes_and_probabilities(database: str) -> None:
    ls = DpLoaderSet(database, "auto:12", TYPE_MAP, seed=3)
    assert [s._natoms for s in ls.systems] == [3, 4, 5, 3, 4]
    assert ls.batch_sizes.tolist() == [4, 3, 3, 4, 3]
    assert ls.nframes.tolist() == [6, 8, 10, 12, 14]
    probs = ls.probabilities("prob_sys_size;0:2:0.5;2:5:0.5")
    assert probs[:2].sum() == pytest.approx(0.5)
    assert ls.probabilities([0.2, 0.2, 0.2, 0.2, 0.2], sys_prob=True).tolist() == [0.2] * 5
    filtered = DpLoaderSet(database, "filter:4", TYPE_MAP, seed=3)
    assert [s.system.rpartition("#")[2] for s in filtered.systems] == [
        "system=0,natoms=3", "system=1,natoms=4", "system=3,natoms=3", "system=4,natoms=4"]
    batch = ls[2]
    assert batch["sid"] == 2 and tuple(batch["coord"].shape) == (3, 5, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume(database: str, workers: int) -> None:
    def make() -> StatefulLoader:
        ls = DpLoaderSet(database, 2, TYPE_MAP, seed=11)
        ls[0]  # the main process opens the database before the workers fork
        return StatefulLoader(ls, get_weighted_sampler(ls, "prob_sys_size", num_samples=9),
                              num_workers=workers)

    def stream(loader: StatefulLoader) -> Any:
        while True:
            for batch in loader:
                yield int(batch["sid"]), tuple(batch["fid"]), float(batch["energy"].sum())

    reference = make()
    it = stream(reference)
    for _ in range(7):
        next(it)
    state = reference.state_dict()
    expected = [next(it) for _ in range(12)]
    restored = make()
    restored.load_state_dict(state)
    rest = stream(restored)
    assert [next(rest) for _ in range(12)] == expected


def test_open_databases_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dbs = [make_lmdb(tmp_path / f"d{i}.lmdb", [make_system(tmp_path / f"s{i}", "a", seed=i)])
           for i in range(3)]
    monkeypatch.setenv("MDLOADER_MAX_OPEN_LMDB", "2")
    ls = DpLoaderSet(dbs, 1, TYPE_MAP, seed=1)
    for sid in range(3):
        ls[sid]
    assert lmdb_io.open_count() == 2
    for sid in (0, 1, 2, 0):  # reopening an evicted database works
        assert ls[sid]["fid"]


# -- the distributed build -------------------------------------------------------------------
def _counting_lmdb_opens(root: str) -> tuple[dict[str, int], Any]:
    """``lmdb.open`` runs in C, out of sight of the audit hook: count it separately."""
    import lmdb

    counts, stop = count_data_touches(root)
    counts["lmdb_open"] = 0
    original = lmdb.open

    def counted(path: str, *args: Any, **kwargs: Any) -> Any:
        counts["lmdb_open"] += os.path.abspath(path).startswith(root)
        return original(path, *args, **kwargs)

    lmdb.open = counted

    def undo() -> None:
        stop()
        lmdb.open = original

    return counts, undo


def _build_rank(rank: int, world: int, root: str, db: str) -> dict[str, Any]:
    scanned = lmdb_metadata.scanned_frames()
    counts, stop = _counting_lmdb_opens(root)
    try:
        datasets, report = build_systems_with_report(db, TYPE_MAP, timeout=60)
    finally:
        stop()
    batch = datasets[-1].get_batch([0, 1])  # reading after the build is allowed on every rank
    return {"metas": pickle.dumps([d.meta for d in datasets]), "touches": counts,
            "scanned": lmdb_metadata.scanned_frames() - scanned, "bytes": report.payload_bytes,
            "nframes": report.nframes, "fid": batch["fid"]}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nlocs", ["recorded", "missing"])
def test_two_ranks_only_rank0_reads_the_database(tmp_path: Path, nlocs: str) -> None:
    systems = [make_system(tmp_path / "src", f"s{i}", natoms=3 + i, nframes=4, seed=i)
               for i in range(4)]
    drop = ["frame_nlocs"] if nlocs == "missing" else []
    db = make_lmdb(tmp_path / "data" / "d.lmdb", systems, drop_metadata=drop)
    got = values(run_ranks(_build_rank, 2, str(tmp_path / "data"), db))
    assert got[0]["metas"] == got[1]["metas"] and got[0]["fid"] == got[1]["fid"] == [12, 13]
    assert got[0]["touches"]["lmdb_open"] >= 1
    assert got[1]["touches"] == {"open": 0, "list": 0, "stat": 0, "h5open": 0, "lmdb_open": 0}
    assert got[0]["scanned"] == (16 if nlocs == "missing" else 0) and got[1]["scanned"] == 0
    # 40 bytes a frame here (4 groups of 4 frames), plus, once per packet, the database's stamp
    # (inode, size, mtime, ctime: about 30 bytes) that every read checks and the table's format
    # names with a format id per row (about 30 bytes)
    assert got[0]["bytes"] == got[1]["bytes"] and got[0]["bytes"] < 40 * got[0]["nframes"] + 64


def test_many_groups_are_described_in_this_process(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Describing a group is a lookup in the index discovery read: spawning processes for
    20 000+ groups would cost seconds and a metadata read in each of them."""
    from mdloader.catalog import describe

    db = make_lmdb(tmp_path / "d.lmdb", [make_system(tmp_path / "src", f"s{i:02d}", nframes=1,
                                                     seed=i) for i in range(60)])
    monkeypatch.setattr(describe, "PROCESS_MIN", 10)
    monkeypatch.setattr(describe, "_in_processes", lambda *a: pytest.fail("spawned a pool"))
    datasets = build_systems_with_report(db, TYPE_MAP, num_workers=2)[0]
    assert len(datasets) == 60 and datasets[59].get_batch([0])["fid"] == [59]
