"""Statistics passes read a set in chunks of bounded size: the numbers do not depend on the chunk
(bit for bit), errors in a later chunk name their frame and file, and the memory of a pass is
bounded by the chunk, not by the set."""

from __future__ import annotations

import tracemalloc
import weakref
from pathlib import Path

import h5py
import numpy as np
import pytest

from mdloader.catalog.discover import discover_systems
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.formats.lmdb.sources import element_names, system_chunks
from mdloader.data.formats.lmdb.writer import LmdbWriter
from mdloader.data.schema import DataRequirementItem
from mdloader.data.system import build_system_meta
from mdloader.errors import NonFiniteError
from mdloader.stats.env_mat import EnvMatSettings, system_env_sums
from mdloader.stats.frames import frames_by_set, read_chunks, read_frames
from mdloader.stats.merging import merge_all
from mdloader.stats.neighbours import (
    OverlappingAtomsError,
    frames_neighbour_stats,
    system_neighbour_stats,
)
from mdloader.stats.output import system_samples
from mdloader.testing import make_lmdb, make_system

TYPE_MAP = ["O", "H"]
NATOMS = 8
BATCH = 3  # DeePMD-kit batch of these tests, in frames: batch_atoms = BATCH * NATOMS
#: budgets in atom-frames: below one batch, one batch, three and a half batches, unbounded
BUDGETS = [1, BATCH * NATOMS, 7 * BATCH * NATOMS // 2, None]
ENERGY = DataRequirementItem("energy", 1, atomic=False, must=False, high_prec=True)
ENV = EnvMatSettings(6.0, 1.0, (40, 80), 2)


def _set_arrays(address: str, key: str, values: np.ndarray) -> None:
    """Overwrite ``key`` of the one set of an npy or HDF5 system."""
    if "#" not in address:
        np.save(Path(address) / "set.000" / f"{key}.npy", values)
        return
    path, group = address.split("#")
    with h5py.File(path, "a") as fh:
        fh[f"{group.strip('/')}/set.000/{key}.npy"][...] = values


def _edit_npy(path: Path, edit) -> None:
    values = np.load(path)
    edit(values)
    np.save(path, values)


def varying_boxes(root: Path, name: str, *, nframes: int = 37, seed: int = 0,
                  backend: str = "npy") -> str:
    """A periodic system in tilted boxes whose size changes from frame to frame (so DeePMD-kit's
    image range differs between batches), atoms up to two box lengths outside the cell."""
    address = make_system(root, name, natoms=NATOMS, nframes=nframes, seed=seed,
                          dtype=np.float64, backend=backend, h5_file=f"{name}.h5")
    rng = np.random.default_rng(seed)
    base = np.array([[4.0, 0.0, 0.0], [1.2, 3.8, 0.0], [-0.8, 1.0, 4.2]])
    boxes = base[None] * rng.uniform(0.7, 1.6, (nframes, 1, 1))
    frac = rng.random((nframes, NATOMS, 3)) + rng.integers(-2, 3, (nframes, NATOMS, 3))
    _set_arrays(address, "box", boxes.reshape(nframes, 9))
    _set_arrays(address, "coord", np.einsum("fad,fdk->fak", frac, boxes).reshape(nframes, -1))
    return address


def mixed_cells_lmdb(root: Path, runs: list[tuple[int, bool]]) -> tuple[str, list[str]]:
    """One LMDB group whose frames come in runs with and without a cell (``(frames,
    periodic)``); its address and the npy system of each run."""
    sources = [varying_boxes(root / "src", f"run{i}", nframes=n, seed=40 + i) if periodic else
               make_system(root / "src", f"run{i}", natoms=NATOMS, nframes=n, pbc=False,
                           seed=40 + i, dtype=np.float64)
               for i, (n, periodic) in enumerate(runs)]
    _edit_npy(Path(sources[1]) / "set.000" / "coord.npy",
              lambda c: c.__setitem__((slice(1, None), slice(9, 12)), 1000.0))
    with LmdbWriter(root / "mixed.lmdb", TYPE_MAP, overwrite=True) as out:
        sid = out.new_system()
        for source in sources:
            meta = build_system_meta(source)
            for chunk in system_chunks(meta, element_names(meta, TYPE_MAP)):
                out.write(sid, chunk)
    (group,) = discover_systems([str(root / "mixed.lmdb")])
    return group, sources


def _neighbours(ds: DeepmdDataSetForLoader, budget: int | None) -> tuple:
    stats = system_neighbour_stats(ds, 6.0, 2, batch_atoms=BATCH * NATOMS,
                                   chunk_atom_frames=budget)
    return stats.min_distance2.hex(), stats.max_neighbours, [str(f) for f in stats.findings]


def _env(ds: DeepmdDataSetForLoader, budget: int | None) -> tuple:
    sums = system_env_sums(ds, ENV, chunk_atom_frames=budget)
    return (sums.frames, [float(v).hex() for v in sums.number.ravel()],
            [float(v).hex() for v in sums.total.ravel()],
            [float(v).hex() for v in sums.squared.ravel()])


def _samples(ds: DeepmdDataSetForLoader, budget: int | None) -> tuple:
    out = system_samples(ds, 3, chunk_atom_frames=budget)
    return out.counts.tolist(), [v.hex() for v in out.labels.ravel()], out.positions.tolist()


def _all_budgets(ds: DeepmdDataSetForLoader) -> dict[str, list]:
    ds.add_data_requirement([ENERGY])
    return {name: [f(ds, b) for b in BUDGETS]
            for name, f in (("neighbours", _neighbours), ("env", _env), ("samples", _samples))}


@pytest.mark.parametrize("backend", ["npy", "hdf5"])
def test_varying_tilted_boxes_give_the_same_bits_with_every_budget(tmp_path: Path,
                                                                   backend: str) -> None:
    ds = DeepmdDataSetForLoader(varying_boxes(tmp_path, "tri", backend=backend), TYPE_MAP)
    results = _all_budgets(ds)
    for name, per_budget in results.items():
        assert all(r == per_budget[-1] for r in per_budget), name
    # the data is sensitive: chunks that cut DeePMD-kit's batches change the numbers ...
    (fids,) = [f for _, f in frames_by_set(ds, None)]
    cut = merge_all(frames_neighbour_stats(a["coord"], a["atype"], a["box"], 6.0, 2,
                                           batch_frames=BATCH)
                    for _, a, _ in read_chunks(ds, fids, budget=4 * NATOMS))
    assert cut.min_distance2.hex() != results["neighbours"][-1][0]
    # ... and sums of chunks added together differ from sums carried frame by frame
    per_chunk = [system_env_sums(ds, ENV, frames=fids[lo:lo + BATCH].tolist())
                 for lo in range(0, len(fids), BATCH)]
    chunked = per_chunk[0]
    for part in per_chunk[1:]:
        chunked = chunked.merge(part)
    assert [float(v).hex() for v in chunked.total.ravel()] != results["env"][-1][2]


def test_lmdb_with_and_without_cells_gives_the_same_bits_with_every_budget(
        tmp_path: Path) -> None:
    runs = [(7, True), (4, False), (8, True), (2, False), (1, True), (5, True)]
    group, sources = mixed_cells_lmdb(tmp_path, runs)  # atom 3 of run 1 alone in 3 frames
    ds = DeepmdDataSetForLoader(group, TYPE_MAP)
    pieces = [(len(f), a["box"] is not None)
              for _, f in frames_by_set(ds, None) for f, a in read_frames(ds, f)]
    assert pieces == [(7, True), (4, False), (8, True), (2, False), (6, True)]
    results = _all_budgets(ds)
    for name, per_budget in results.items():
        assert all(r == per_budget[-1] for r in per_budget), name
    (finding,) = results["neighbours"][-1][2]  # one per run, whatever the chunks
    assert "3 frame(s) of 4 are affected" in finding and finding.endswith("frame 8")
    # each run is searched as its own source system would be
    alone = merge_all(system_neighbour_stats(DeepmdDataSetForLoader(s, TYPE_MAP), 6.0, 2,
                                             batch_atoms=BATCH * NATOMS) for s in sources[:4])
    whole = system_neighbour_stats(ds, 6.0, 2, batch_atoms=BATCH * NATOMS, frames=range(21))
    assert (whole.min_distance2, whole.max_neighbours) == (alone.min_distance2,
                                                           alone.max_neighbours)


class _Watched:
    """A dataset that checks, at every read, that the arrays of earlier reads are gone."""

    def __init__(self, dataset: DeepmdDataSetForLoader) -> None:
        self.dataset, self.owners = dataset, []

    @property
    def meta(self):
        return self.dataset.meta

    def get_frames(self, fids: list[int]) -> list[dict]:
        assert all(owner() is None for owner in self.owners), "an earlier chunk is held"
        return self.dataset.get_frames(fids)


def test_one_chunk_at_a_time_is_held(tmp_path: Path) -> None:
    """A piece's arrays go when the next is asked for, and a run's incomplete batch carried
    into the next read does not keep the previous chunk alive while it is read."""
    group, _ = mixed_cells_lmdb(tmp_path, [(7, True), (4, False), (8, True)])
    ds = _Watched(DeepmdDataSetForLoader(group, TYPE_MAP))
    (fids,) = [f for _, f in frames_by_set(ds.dataset, None)]
    sizes = []
    for piece_fids, arrays, _ in read_chunks(ds, fids, budget=2 * BATCH * NATOMS, align=BATCH):
        coord = arrays["coord"]
        ds.owners.append(weakref.ref(coord if coord.base is None else coord.base))
        sizes.append(len(piece_fids))
        del coord
    assert sizes == [6, 1, 4, 6, 2]


def test_an_error_in_a_later_chunk_names_its_frame_and_file(tmp_path: Path) -> None:
    system = make_system(tmp_path, "two", natoms=NATOMS, nframes=20, nsets=2, seed=5,
                         dtype=np.float64)
    coord = Path(system) / "set.001" / "coord.npy"

    def overlap(c):  # atom 1 on atom 0 in system frame 17 (frame 7 of set.001)
        c[7, 3:6] = c[7, 0:3]
    _edit_npy(coord, overlap)
    ds = DeepmdDataSetForLoader(system, TYPE_MAP)
    with pytest.raises(OverlappingAtomsError,
                       match=rf"atoms [01] and [01] of frame 17 overlap.*file: {coord}"):
        system_neighbour_stats(ds, 6.0, 2, batch_atoms=BATCH * NATOMS,
                               chunk_atom_frames=BATCH * NATOMS)
    energy = Path(system) / "set.001" / "energy.npy"
    _edit_npy(energy, lambda e: e.__setitem__(5, np.nan))
    ds.add_data_requirement([ENERGY])
    with pytest.raises(NonFiniteError, match=rf"energy of frame 15 is not finite.*file: {energy}"):
        system_samples(ds, 0, chunk_atom_frames=2 * NATOMS)


def test_an_error_in_a_later_chunk_of_an_lmdb_names_its_entry(tmp_path: Path) -> None:
    source = make_system(tmp_path, "src", natoms=NATOMS, nframes=20, seed=6, dtype=np.float64)
    _edit_npy(Path(source) / "set.000" / "coord.npy",
              lambda c: c.__setitem__((13, 4), np.nan))
    (group,) = discover_systems([make_lmdb(tmp_path / "db.lmdb", [source], type_map=TYPE_MAP)])
    ds = DeepmdDataSetForLoader(group, TYPE_MAP)
    entry = rf"{tmp_path / 'db.lmdb' / 'data.mdb'}\[0*13\]"
    for run in (lambda: system_neighbour_stats(ds, 6.0, 2, batch_atoms=BATCH * NATOMS,
                                               chunk_atom_frames=BATCH * NATOMS),
                lambda: system_env_sums(ds, ENV, chunk_atom_frames=2 * NATOMS)):
        with pytest.raises(NonFiniteError,
                           match=rf"coordinates of frame 13 are not finite.*file: {entry}"):
            run()


def _peak(run) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind,backend", [("neighbours", "npy"), ("neighbours", "lmdb"),
                                          ("env", "npy"), ("samples", "lmdb")])
def test_memory_of_a_pass_is_bounded_by_the_chunk(tmp_path: Path, kind: str,
                                                  backend: str) -> None:
    natoms, nframes, budget = 32, 2000, 2 ** 12  # chunks of 128 frames
    address = make_system(tmp_path, "many", natoms=natoms, nframes=nframes, seed=7,
                          dtype=np.float64)
    if backend == "lmdb":
        (address,) = discover_systems([make_lmdb(tmp_path / "many.lmdb", [address],
                                                 type_map=TYPE_MAP)])
    ds = DeepmdDataSetForLoader(address, TYPE_MAP)
    ds.add_data_requirement([ENERGY])
    run = {"neighbours": lambda b: system_neighbour_stats(ds, 3.0, 2, chunk_atom_frames=b),
           "env": lambda b: system_env_sums(ds, EnvMatSettings(3.0, 1.0, (10, 20), 2),
                                            chunk_atom_frames=b),
           "samples": lambda b: system_samples(ds, 0, chunk_atom_frames=b)}[kind]
    run(budget)  # open files and maps first: only the pass itself is traced
    chunk = _peak(lambda: read_frames(ds, np.arange(budget // natoms)))
    bound = 4 * chunk
    chunked, whole = _peak(lambda: run(budget)), _peak(lambda: run(None))
    assert chunked < bound < whole, (chunked, chunk, whole)
