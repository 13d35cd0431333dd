"""``MDLOADER_DIRECT_READS=1`` on HDF5: a contiguous, unfiltered dataset's rows read by offset with
O_DIRECT give the frames h5py gives; chunked and compressed datasets are read by h5py; a file
truncated under a kept descriptor is a clear error; forked workers read with their own
descriptors."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.direct_io import direct_folder

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats import hdf5, release_handles
from mdloader.errors import CorruptFileError
from mdloader.testing import make_system
from tests.data.formats.test_npy_direct_reads import FORCE, ROWS, _same


def frames(address: str) -> list[dict[str, np.ndarray]]:
    release_handles()
    ds = DeepmdDataSetForLoader(address, ["O", "H"])
    ds.add_data_requirement(FORCE)
    return ds.get_frames(ROWS)


@pytest.fixture
def address(tmp_path: Path) -> str:
    # 7 atoms: a force row of 84 B, rows straddle 512 B blocks
    with direct_folder(tmp_path) as folder:
        yield make_system(folder, "sys", natoms=7, nframes=50, keys=("energy", "force"),
                          backend="hdf5")
        release_handles()


@pytest.fixture
def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets of the direct reads of rows this process makes."""
    offsets: list[int] = []
    real = hdf5.read_at

    def spy(held: hdf5.KeptDescriptor, path: str, view: memoryview, at: int) -> int:
        offsets.append(at)
        return real(held, path, view, at)

    monkeypatch.setattr(hdf5, "read_at", spy)
    return offsets


def test_contiguous_datasets_are_read_by_offset_as_h5py_reads_them(
        address: str, direct_reads: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "0")
    buffered = frames(address)
    assert not direct_reads and hdf5.direct_file_count() == 0
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "1")
    _same(buffered, frames(address))
    assert hdf5.direct_file_count() == 1
    # coord, box, force: one read per run of the rows asked for (0, 3-5, 17, 48-49) of each
    assert len(direct_reads) == 3 * 4


def _rewrite(address: str, **layout: object) -> str:
    """The system's file written again with every frame dataset stored as ``layout`` says."""
    path, _, group = address.partition("#")
    copy = path + ".rewritten.h5"
    with h5py.File(path, "r") as src, h5py.File(copy, "w") as dst:
        def visit(name: str, obj: object) -> None:
            if isinstance(obj, h5py.Dataset):
                frame_data = "/set." in "/" + name
                dst.create_dataset(name, data=obj[()], **(layout if frame_data else {}))
        src.visititems(visit)
    return f"{copy}#{group}"


@pytest.mark.parametrize("layout", [{"chunks": True}, {"compression": "gzip"},
                                    {"chunks": True, "shuffle": True, "fletcher32": True}],
                         ids=["chunked", "gzip", "filters"])
def test_chunked_and_filtered_datasets_are_read_by_h5py(
        address: str, layout: dict[str, object], direct_reads: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "0")
    buffered = frames(address)
    rewritten = _rewrite(address, **layout)
    with h5py.File(rewritten.partition("#")[0], "r") as fh:
        force = fh["sys/set.000/force.npy"]
        assert force.chunks is not None and hdf5.direct_offset(force) is None
        assert hdf5.direct_offset(fh["sys/type.raw"]) is not None  # written contiguous
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "1")
    _same(buffered, frames(rewritten))
    assert not direct_reads and hdf5.direct_file_count() == 0


def test_a_file_truncated_under_direct_reads_is_an_error_naming_it(
        address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The descriptors stay open; the file loses the end of ``force``'s rows: the next read of
    them is a short read, a CorruptFileError naming the system and the dataset."""
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "1")
    release_handles()
    ds = DeepmdDataSetForLoader(address, ["O", "H"])
    ds.add_data_requirement(FORCE)
    ds.get_frames([0, 1])
    path = address.partition("#")[0]
    with h5py.File(path, "r") as fh:
        force = fh["sys/set.000/force.npy"]
        force_at, row_bytes = force.id.get_offset(), force.dtype.itemsize * force.shape[1]
    os.truncate(path, force_at + 10 * row_bytes + 5)  # rows 0-9 whole, row 10 cut
    assert np.asarray(ds.get_frames([9])[0]["force"]).size == 21
    with pytest.raises(CorruptFileError, match=r"shrank while it was read.*"
                                               r"sys/set\.000/force\.npy") as caught:
        ds.get_frames([10])
    assert "sys" in str(caught.value) and path in str(caught.value)


def test_a_file_truncated_under_h5py_reads_is_an_error_not_zeros(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through h5py (the default), HDF5 fills a read past the file's end with zeros: a file
    truncated while open used to train on zero forces without a word. The size of the open
    file is compared with its size at open at every read (one fstat, no path lookup)."""
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "0")
    address = make_system(tmp_path, "sys", natoms=7, nframes=50, keys=("energy", "force"),
                          backend="hdf5")
    release_handles()
    ds = DeepmdDataSetForLoader(address, ["O", "H"])
    ds.add_data_requirement(FORCE)
    ds.get_frames([0, 1])
    path = address.partition("#")[0]
    with h5py.File(path, "r") as fh:
        force = fh["sys/set.000/force.npy"]
        force_at, row_bytes = force.id.get_offset(), force.dtype.itemsize * force.shape[1]
    os.truncate(path, force_at + 10 * row_bytes + 5)
    with pytest.raises(CorruptFileError, match=r"HDF5 file shrank while it was read.*"
                                               r"sys/set\.000/\w+\.npy; expected: \d+ bytes "
                                               r"\(when it was opened\); found: \d+ bytes"):
        ds.get_frames([30])  # the first dataset read after the truncation names itself
    release_handles()


def _read_in_child(address: str) -> list[dict[str, np.ndarray]]:
    ds = DeepmdDataSetForLoader(address, ["O", "H"])
    ds.add_data_requirement(FORCE)
    got = ds.get_frames(ROWS)
    return [{k: np.asarray(v) for k, v in f.items()} for f in got] + [
        {"direct_files": np.asarray(hdf5.direct_file_count())}]


def test_forked_workers_read_with_their_own_descriptors(
        address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent holds a direct descriptor before the fork; each child closes its inherited
    copy and opens its own, and reads the same frames."""
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "0")
    buffered = [{k: np.asarray(v) for k, v in f.items()} for f in frames(address)]
    monkeypatch.setenv("MDLOADER_DIRECT_READS", "1")
    frames(address)
    assert hdf5.direct_file_count() == 1
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_read_in_child, [address] * 4, chunksize=1)
    for got in results:
        assert int(got[-1]["direct_files"]) == 1
        _same(buffered, got[:-1])
    _same(buffered, frames(address))  # the parent's descriptor still reads


def test_only_contiguous_unfiltered_datasets_of_numbers_have_an_offset(tmp_path: Path) -> None:
    """Compact, external, not yet written and string datasets are left to h5py."""
    values = np.arange(12, dtype=np.float64).reshape(3, 4)
    with h5py.File(tmp_path / "layouts.h5", "w") as fh:
        fh.create_dataset("contiguous", data=values)
        plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        plist.set_layout(h5py.h5d.COMPACT)
        space = h5py.h5s.create_simple(values.shape)
        h5py.h5d.create(fh.id, b"compact", h5py.h5t.IEEE_F64LE, space, plist).write(
            h5py.h5s.ALL, h5py.h5s.ALL, values)
        fh.create_dataset("external", data=values,
                          external=[(str(tmp_path / "raw.bin"), 0, values.nbytes)])
        fh.create_dataset("unwritten", shape=(3, 4), dtype=np.float64)
        fh.create_dataset("names", data=np.array([b"O", b"H"]))
        offsets = {name: hdf5.direct_offset(fh[name]) for name in fh}
    assert offsets.pop("contiguous") is not None
    assert offsets == dict.fromkeys(("compact", "external", "unwritten", "names"))
