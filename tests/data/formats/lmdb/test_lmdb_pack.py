"""``mdloader pack`` and the LMDB writer: one system id per source system in mdloader's order,
npy/HDF5/dpdata sources, bounded chunks, and an atomic finish (its progress:
``tests/cli/test_command_progress.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest

from mdloader.catalog.discover import discover_systems
from mdloader.cli.main import main
from mdloader.cli.pack import pack
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats.lmdb import writer as lmdb_writer
from mdloader.data.formats.lmdb.sources import frame_bytes, system_chunks
from mdloader.data.system import build_system_meta
from mdloader.errors import ConfigError, DataError, MissingDataError
from mdloader.testing import make_system


def _metadata(db: str) -> dict:
    env = lmdb.open(db, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return msgpack.unpackb(txn.get(b"__metadata__"), raw=False)
    finally:
        env.close()


def test_each_source_system_keeps_its_own_id_in_mdloader_order(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    # two systems of the same formula: dpdata's MultiSystems writer would merge them
    for name, seed in (("b", 1), ("a", 2), ("c", 3)):
        make_system(src, name, natoms=4 if name != "c" else 5, nframes=2 + seed, seed=seed)
    db = str(tmp_path / "out.lmdb")
    assert main(["pack", str(src), db]) == 0
    assert capsys.readouterr().out.strip() == f"{db}\t3 systems\t12 frames\ttype_map O H"
    meta = _metadata(db)
    assert meta["frame_system_ids"] == [0] * 4 + [1] * 3 + [2] * 5  # a, b, c: discovery order
    assert meta["frame_nlocs"] == [4] * 7 + [5] * 5 and meta["nframes"] == 12
    groups = discover_systems(db)
    assert [len(DeepmdDataSetForLoader(g, ["O", "H"])) for g in groups] == [4, 3, 5]
    first = DeepmdDataSetForLoader(groups[1], ["O", "H"])[0]  # system b, frame 0, file order
    np.testing.assert_allclose(first["coord"].reshape(-1),
                               np.load(src / "b" / "set.000" / "coord.npy")[0], rtol=1e-6)


def test_hdf5_sources_and_an_explicit_type_map(tmp_path: Path) -> None:
    h5 = tmp_path / "data.h5"
    for name in ("s0", "s1"):
        make_system(tmp_path, name, backend="hdf5", h5_file="data.h5", nsets=2, nframes=5)
    report = pack([str(h5)], str(tmp_path / "h.lmdb"), type_map=["H", "O", "C"])
    assert report.type_map == ("H", "O", "C") and report.nframes == (5, 5)
    assert _metadata(report.dest)["type_map"] == ["H", "O", "C"]
    group = discover_systems(report.dest)[0]
    assert DeepmdDataSetForLoader(group, ["H", "O", "C"])[0]["atype"].tolist() == [1, 0] * 3
    # read with another model map, the stored ids are remapped by element name
    assert DeepmdDataSetForLoader(group, ["O", "H", "C"])[0]["atype"].tolist() == [0, 1] * 3


def test_a_dpdata_format_source(tmp_path: Path) -> None:
    system = make_system(tmp_path, "s", natoms=3, nframes=4, dtype=np.float64)
    report = pack([system], str(tmp_path / "d.lmdb"), fmt="deepmd/npy")
    assert report.nframes == (4,) and report.systems[0].startswith(system)
    frame = DeepmdDataSetForLoader(discover_systems(report.dest)[0], ["O", "H"])[0]
    np.testing.assert_allclose(frame["energy"], np.load(f"{system}/set.000/energy.npy")[0])
    with pytest.raises(ConfigError, match=r"sources: --from reads one input, got 2"):
        pack([system, system], str(tmp_path / "e.lmdb"), fmt="deepmd/npy")


def test_sources_that_cannot_be_packed(tmp_path: Path) -> None:
    make_system(tmp_path / "src", "a", type_map=None)
    with pytest.raises(DataError, match=r"the system has no type_map.raw: give the element "
                                        r"names \(--type-map\)"):
        pack([str(tmp_path / "src")], str(tmp_path / "x.lmdb"))
    assert not os.path.exists(tmp_path / "x.lmdb")
    db = pack([str(tmp_path / "src")], str(tmp_path / "x.lmdb"), type_map=["O", "H"]).dest
    with pytest.raises(ConfigError, match=r"is already an LMDB database; pack reads npy and HDF5"):
        pack([db], str(tmp_path / "y.lmdb"))
    with pytest.raises(ConfigError, match=r"dest: \S+/x.lmdb already exists \(pass overwrite"):
        pack([str(tmp_path / "src")], db, type_map=["O", "H"])
    make_system(tmp_path / "bad", "b", broken="no_coord")
    with pytest.raises(MissingDataError, match="the set has no coord.npy"):
        pack([str(tmp_path / "bad")], str(tmp_path / "z.lmdb"))


def test_chunks_and_commits_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    system = make_system(tmp_path, "s", natoms=10, nframes=50)
    meta = build_system_meta(system)
    assert frame_bytes(meta) == 8 * (30 + 9 + 1 + 30 + 9)
    chunks = list(system_chunks(meta, ("O", "H"), chunk_bytes=frame_bytes(meta) * 7))
    assert [c.nframes for c in chunks] == [7] * 7 + [1]
    commits = []
    original = lmdb_writer.LmdbWriter._commit
    monkeypatch.setattr(lmdb_writer.LmdbWriter, "_commit",
                        lambda self, extra=(): (commits.append(len(self._pending)),
                                                original(self, extra))[1])
    with lmdb_writer.LmdbWriter(tmp_path / "b.lmdb", ["O", "H"], commit_bytes=3000) as out:
        sid = out.new_system()
        for chunk in chunks:
            out.write(sid, chunk)
    assert max(commits) < 50 and sum(commits) == 50 and len(commits) > 5


def test_a_crash_leaves_nothing_that_looks_complete(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    make_system(tmp_path / "src", "a", nframes=5)
    make_system(tmp_path / "src", "b", nframes=5)
    dest = tmp_path / "out.lmdb"
    calls = []

    def failing(self: lmdb_writer.LmdbWriter, sid: int, chunk: object) -> None:
        calls.append(sid)
        if len(calls) == 2:
            raise KeyboardInterrupt
        original(self, sid, chunk)

    original = lmdb_writer.LmdbWriter.write
    monkeypatch.setattr(lmdb_writer.LmdbWriter, "write", failing)
    with pytest.raises(KeyboardInterrupt):
        pack([str(tmp_path / "src")], str(dest))
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no database, no partial folder
    # a partial folder of a writer that died (its process is gone) is removed by the next one
    stale = tmp_path / ".out.lmdb.partial-999999999-0"
    stale.mkdir()
    (stale / "data.mdb").write_bytes(b"")
    monkeypatch.setattr(lmdb_writer.LmdbWriter, "write", original)
    pack([str(tmp_path / "src")], str(dest))
    assert sorted(os.listdir(tmp_path)) == ["out.lmdb", "src"]
    assert _metadata(str(dest))["nframes"] == 10


def test_overwrite_replaces_only_when_complete(tmp_path: Path) -> None:
    make_system(tmp_path / "src", "a", nframes=3)
    dest = str(tmp_path / "out.lmdb")
    pack([str(tmp_path / "src")], dest)
    make_system(tmp_path / "src", "b", nframes=4)
    pack([str(tmp_path / "src")], dest, overwrite=True)
    assert _metadata(dest)["nframes"] == 7
    assert sorted(os.listdir(tmp_path)) == ["out.lmdb", "src"]


def test_a_database_replaced_while_a_process_reads_it_is_described_anew(tmp_path: Path) -> None:
    """The process's open environment maps the old file: it must not serve the new description
    from it, nor the old frames."""
    make_system(tmp_path / "src", "a", nframes=3)
    dest = str(tmp_path / "out.lmdb")
    pack([str(tmp_path / "src")], dest)
    (group,) = discover_systems(dest)
    assert len(DeepmdDataSetForLoader(build_system_meta(group)).get_batch([2])["fid"]) == 1
    make_system(tmp_path / "src2", "a", nframes=5, seed=9)
    pack([str(tmp_path / "src2")], dest, overwrite=True)
    (group,) = discover_systems(dest)
    again = DeepmdDataSetForLoader(build_system_meta(group))
    assert len(again) == 5
    source = np.load(tmp_path / "src2" / "a" / "set.000" / "coord.npy")[4].reshape(-1, 3)
    assert np.allclose(again.get_batch([4])["coord"][0].numpy(), source)
