"""Node-local staging in one process: every format read from its copy, copies checked against the
shared tree's stamps, reused while fresh, bounded, published atomically, listed and pruned."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from support.fs_audit import count_data_touches

from mdloader.catalog.staging import (
    Manifest,
    copy_path,
    manifest_path,
    stage,
    staged_copies,
)
from mdloader.cli.cache import prune_cache, show_cache
from mdloader.errors import StagingError
from mdloader.loading.build import build_systems
from mdloader.testing import make_dataset, make_lmdb, make_system


def _data(root: Path, backend: str) -> list[str]:
    if backend == "lmdb":
        made = make_dataset(root / "src", 3, nframes=6, seed=3)
        return [make_lmdb(root / "data" / "train.lmdb", made)]
    return make_dataset(root / "data", 3, nframes=6, seed=3, backend=backend)


def _frames(datasets) -> list[dict]:
    out = []
    for dataset in datasets:
        out.extend(dataset[i] for i in range(len(dataset)))
    return out


@pytest.mark.parametrize("backend", ["npy", "hdf5", "lmdb"])
def test_every_format_reads_the_same_frames_from_its_copy(tmp_path: Path, backend: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    systems = _data(tmp_path, backend)
    monkeypatch.setenv("MDLOADER_INDEX", "off")
    shared = build_systems(systems, ["O", "H"])
    expected = _frames(shared)
    monkeypatch.setenv("MDLOADER_STAGE_DIR", str(tmp_path / "stage"))
    staged = build_systems(systems, ["O", "H"])
    data_root = str(tmp_path / "data")
    assert all(d.meta.address.startswith(str(tmp_path / "stage")) for d in staged)
    counts, stop = count_data_touches(data_root)
    try:
        got = _frames(staged)
    finally:
        stop()
    assert counts == {"open": 0, "list": 0, "stat": 0, "h5open": 0}
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_a_fresh_copy_is_reused_and_a_changed_file_staged_again(tmp_path: Path) -> None:
    paths = make_dataset(tmp_path / "data", 2, nframes=4, seed=1)
    stage_dir = str(tmp_path / "stage")
    first = stage(paths, stage_dir)
    size = sum(f.stat().st_size for f in (tmp_path / "data").rglob("*") if f.is_file())
    assert (first.copied, first.reused, first.bytes_copied) == (2, 0, size)
    again = stage(paths, stage_dir)
    assert (again.copied, again.reused, again.bytes_copied) == (0, 2, 0)
    energy = Path(paths[1]) / "set.000" / "energy.npy"
    np.save(energy, np.arange(4, dtype=np.float32) + 100)  # same shape, other values
    third = stage(paths, stage_dir)
    assert (third.copied, third.reused, third.copied_sources) == (1, 1, [paths[1]])
    copied = Path(copy_path(stage_dir, paths[1])) / "set.000" / "energy.npy"
    np.testing.assert_array_equal(np.load(copied), np.arange(4, dtype=np.float32) + 100)


def test_a_file_added_or_a_copy_damaged_is_staged_again(tmp_path: Path) -> None:
    paths = make_dataset(tmp_path / "data", 1, nframes=4, seed=1)
    stage_dir = str(tmp_path / "stage")
    stage(paths, stage_dir)
    np.save(Path(paths[0]) / "set.000" / "extra.npy", np.zeros(4))
    assert stage(paths, stage_dir).copied == 1
    copied = Path(copy_path(stage_dir, paths[0])) / "set.000" / "coord.npy"
    os.truncate(copied, 10)
    assert stage(paths, stage_dir).copied == 1
    assert copied.stat().st_size == (Path(paths[0]) / "set.000" / "coord.npy").stat().st_size


def test_a_copy_without_its_manifest_is_never_trusted(tmp_path: Path) -> None:
    """A stager killed between the copy's rename and its manifest leaves an untrusted copy."""
    paths = make_dataset(tmp_path / "data", 1, nframes=4, seed=1)
    stage_dir = str(tmp_path / "stage")
    stage(paths, stage_dir)
    os.unlink(manifest_path(stage_dir, paths[0]))
    assert stage(paths, stage_dir).copied == 1
    assert not [n for n in os.listdir(stage_dir) if n.endswith(".tmp")]


def test_the_bound_refuses_in_one_line_naming_folder_and_bytes(tmp_path: Path) -> None:
    paths = make_dataset(tmp_path / "data", 2, nframes=4, seed=1)
    stage_dir = str(tmp_path / "stage")
    stage(paths[:1], stage_dir)
    held = staged_copies(stage_dir)[0].bytes
    need = sum(f.stat().st_size for f in Path(paths[1]).rglob("*") if f.is_file())
    with pytest.raises(StagingError) as info:
        stage(paths, stage_dir, limit_bytes=held + need - 1)
    message = str(info.value)
    assert "\n" not in message
    assert (f"node-local staging needs {need} bytes in {stage_dir}, {need - 1} available "
            f"(MDLOADER_STAGE_BYTES={held + need - 1}, {held} held by other copies)") in message
    assert stage(paths, stage_dir, limit_bytes=held + need).copied == 1


def test_a_file_source_hdf5_is_staged_whole(tmp_path: Path) -> None:
    make_system(tmp_path / "data", "a", backend="hdf5", h5_file="x.h5")
    source = str(tmp_path / "data" / "x.h5")
    stage_dir = str(tmp_path / "stage")
    report = stage([source], stage_dir)
    assert report.bytes_copied == os.path.getsize(source)
    assert Path(copy_path(stage_dir, source)).read_bytes() == Path(source).read_bytes()
    manifest = Manifest.read(manifest_path(stage_dir, source))
    assert manifest is not None and list(manifest.files) == [""]


def test_mdloader_cache_lists_and_prunes_the_stage_folder(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    paths = make_dataset(tmp_path / "data", 2, nframes=4, seed=1)
    stage_dir = tmp_path / "stage"
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MDLOADER_STAGE_DIR", str(stage_dir))
    stage(paths, str(stage_dir))
    shown = show_cache()
    assert "stage: 2 entries" in shown and str(stage_dir) in shown
    removed = prune_cache(older_than=0)
    assert sorted(e.owner for e in removed if e.kind == "stage") == sorted(paths)
    assert staged_copies(str(stage_dir)) == []
    assert os.listdir(stage_dir) == []


def test_a_node_is_torchruns_agent_else_counted_from_the_rank() -> None:
    from mdloader.world import World

    agent = World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                            "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1"})
    assert (agent.node, agent.local_rank) == (1, 0)
    counted = World.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                              "LOCAL_WORLD_SIZE": "4"})
    assert counted.node == 1


def test_the_copy_of_a_table_names_the_stage_folder_and_keeps_the_rest(tmp_path: Path) -> None:
    from mdloader.catalog.staging import relocate
    from mdloader.catalog.table import SystemTable
    from mdloader.loading.build import build_systems

    paths = make_dataset(tmp_path / "data", 3, nframes=4, seed=2)
    table: SystemTable = build_systems(paths, ["O", "H"]).table
    moved = relocate(table, str(tmp_path / "stage"))
    assert moved.addresses() == [copy_path(str(tmp_path / "stage"), p) for p in paths]
    assert [m.sets for m in moved] == [m.sets for m in table]
    assert (moved.natoms() == table.natoms()).all() and (moved.nframes() == table.nframes()).all()


@pytest.mark.parametrize("size", [100, (1 << 20) + 100])  # one buffer, and the kernel's copy
def test_a_file_that_changes_between_its_survey_and_its_copy_is_refused(tmp_path: Path,
                                                                         size: int) -> None:
    from mdloader.catalog.staging import copy_file
    from mdloader.persist import FileStamp

    source = tmp_path / "force.npy"
    source.write_bytes(b"x" * size)
    surveyed = FileStamp.of(os.stat(source))
    with open(source, "ab") as fh:  # a writer appends after the survey
        fh.write(b"y" * 10)
    with pytest.raises(StagingError, match=r"force\.npy changed while it was staged"):
        copy_file(str(source), str(tmp_path / "copy.npy"), surveyed)
    before, written = copy_file(str(source), str(tmp_path / "again.npy"))
    assert before.size == written.size == size + 10
    assert (tmp_path / "again.npy").read_bytes() == source.read_bytes()
