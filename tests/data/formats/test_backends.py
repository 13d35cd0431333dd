"""Storage formats behind one interface: a toy format added through the registry alone trains,
the built-ins are registered, and an address no format knows is named clearly."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mdloader.config.input_json import LossConfig
from mdloader.data.formats import (
    Backend,
    FrameReader,
    Location,
    backend_of,
    backends,
    get_backend,
    parse_address,
    register_backend,
    unregister_backend,
)
from mdloader.data.formats.base import SetMeta, SystemMeta, frame_ids
from mdloader.data.formats.capabilities import (
    Diagnostics,
    EntryExpansion,
    FolderWalk,
    Freshness,
)
from mdloader.data.formats.diagnostics import box_blocks, deep_check
from mdloader.errors import DataError, MissingDataError, UnknownFormatError
from mdloader.loading.loader import DpLoaderSet
from mdloader.testing import make_lmdb, make_system
from mdloader.train.model import RadialPotential
from mdloader.train.objective import EnergyForceLoss
from mdloader.train.step import Stepper

KEYS = ("coord", "box", "energy", "force")


class NpzReader(FrameReader):
    """Frames of one ``.npz`` system, atoms already sorted by type."""

    def __init__(self, meta: SystemMeta) -> None:
        self.meta = meta

    def frames(self, fids: Sequence[int]) -> list[dict[str, Any]]:
        meta = self.meta
        ids = frame_ids(fids, meta.nframes, meta.address)
        with np.load(meta.location.path) as data:
            arrays = {k: np.asarray(data[k])[ids] for k in KEYS}
        out = []
        for j, fid in enumerate(ids.tolist()):
            frame: dict[str, Any] = {
                "coord": arrays["coord"][j].reshape(meta.natoms, 3),
                "box": arrays["box"][j].reshape(9),
                "energy": arrays["energy"][j].reshape(1),
                "force": arrays["force"][j].reshape(meta.natoms, 3),
                "atype": meta.atom_types.copy(), "natoms": meta.natoms_vec()}
            frame.update({f"find_{k}": np.float32(1.0) for k in KEYS})
            frame["type"], frame["fid"] = frame["atype"], fid
            out.append(frame)
        return out


class NpzBackend(Backend):
    """A toy format: one ``.npz`` file per system (``types``, ``type_map`` and per-frame
    ``coord``, ``box``, ``energy``, ``force``)."""

    def parse(self, address: str) -> Location | None:
        if "#" in address or not address.endswith(".npz"):
            return None
        return Location(self.name, address, "")

    def describe(self, loc: Location, type_map: Sequence[str] | None,
                 problems: list[DataError], listing: Any = None) -> SystemMeta:
        try:
            data = np.load(loc.path)
        except FileNotFoundError as exc:
            raise MissingDataError("no such npz file", system=loc.address,
                                   file=loc.path) from exc
        with data:
            names = [str(n) for n in data["type_map"]]
            model = list(type_map) if type_map else names
            types = np.asarray([model.index(names[t]) for t in data["types"]], dtype=np.int32)
            nframes = len(data["coord"])
        types.flags.writeable = False
        n = len(types)
        sets = (SetMeta("frames", nframes, KEYS, (3 * n, 9, 1, 3 * n)),)
        return SystemMeta(address=loc.address, backend=loc.backend, atom_types=types,
                          type_map=tuple(model), pbc=True, mixed_type=False, sets=sets)

    def reader(self, meta: SystemMeta, requirements: Sequence[Any],
               origin: str | None = None) -> NpzReader:
        return NpzReader(meta)


def _npz(path: Path, natoms: int, nframes: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    cell = 6.0
    types = np.sort(np.arange(natoms) % 2)
    np.savez(path, types=types, type_map=np.array(["O", "H"]),
             coord=rng.random((nframes, natoms * 3)) * cell,
             box=np.tile(np.diag([cell] * 3).reshape(1, 9), (nframes, 1)),
             energy=rng.normal(size=(nframes, 1)),
             force=rng.normal(size=(nframes, natoms * 3)))
    return str(path)


@pytest.fixture
def npz_format() -> Iterator[NpzBackend]:
    backend = NpzBackend()
    register_backend("npz", backend)
    try:
        yield backend
    finally:
        unregister_backend("npz")


def test_a_format_added_through_the_registry_alone_trains(tmp_path: Path,
                                                          npz_format: NpzBackend) -> None:
    data = tmp_path / "data"
    data.mkdir()
    paths = [_npz(data / f"s{i}.npz", natoms=n, nframes=4, seed=i) for i, n in enumerate((4, 6))]
    assert parse_address(paths[0]) == Location("npz", paths[0], "")
    assert backend_of(paths[0]) is npz_format and backends()[0] is npz_format

    loaders = DpLoaderSet(paths, batch_size=2, type_map=["O", "H"], seed=3, index_mode="off")
    assert [len(s) for s in loaders.systems] == [4, 4]
    batch = loaders.systems[1].get_batch([3, -1])
    assert batch["fid"] == [3, 3] and tuple(batch["coord"].shape) == (2, 6, 3)

    meta = loaders.systems[0].meta
    assert not isinstance(npz_format, Diagnostics)  # the core alone: the defaults read it
    assert deep_check(meta) == []
    assert [(start, rows.shape) for _, start, rows in box_blocks(meta)] == [(0, (4, 9))]

    torch.manual_seed(0)  # one step of the reference model on a batch of the toy format
    model = RadialPotential(2, rcut=2.5, nbasis=4, hidden=(8,))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = EnergyForceLoss.from_config(LossConfig(), start_lr=1e-3)
    stepper = Stepper(model, model, optimizer, loss, loaders.systems,
                      device=torch.device("cpu"), check_every=1000)
    batch = {**loaders.systems[0].get_batch([0, 1]), "sid": 0}
    before = [p.detach().clone() for p in model.parameters()]
    outcome = stepper.step(batch, 1e-3, 1, False)
    assert not outcome.skipped and np.isfinite(outcome.mse["mse"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_each_real_format_is_registered(tmp_path: Path) -> None:
    for name in ("npy", "hdf5", "lmdb"):
        assert get_backend(name).name == name
    system = make_system(tmp_path / "npy", "s", nframes=2)
    db = make_lmdb(tmp_path / "d.lmdb", [system])
    assert backend_of(system).name == "npy"
    assert backend_of(str(tmp_path / "f.h5")).name == "hdf5"
    assert backend_of(str(tmp_path / "f.h5") + "#/a/b").name == "hdf5"
    assert backend_of(f"{db}#system=0,natoms=6").name == "lmdb"
    assert backend_of(db).name == "lmdb"
    assert get_backend("lmdb").pbc_per_frame and not get_backend("lmdb").indexable
    assert isinstance(get_backend("npy"), FolderWalk) and not get_backend("hdf5").pbc_per_frame


def test_each_real_format_has_the_capabilities_its_clients_use() -> None:
    npy, hdf5, lmdb = (get_backend(name) for name in ("npy", "hdf5", "lmdb"))
    assert [isinstance(b, FolderWalk) for b in (npy, hdf5, lmdb)] == [True, False, False]
    assert [isinstance(b, EntryExpansion) for b in (npy, hdf5, lmdb)] == [False, True, True]
    assert [isinstance(b, Freshness) for b in (npy, hdf5, lmdb)] == [True, True, False]
    assert all(isinstance(b, Diagnostics) for b in (npy, hdf5, lmdb))


def test_a_format_with_part_of_a_capability_is_refused_naming_what_it_lacks() -> None:
    class HalfChecked(NpzBackend):
        def deep_check(self, meta: object) -> list[str]:  # Diagnostics without its other three
            return []

    with pytest.raises(TypeError, match=r"'half' implements only part of Diagnostics \(missing "
                                        r"box_blocks, frame_file, notes\)"):
        register_backend("half", HalfChecked())
    assert "half" not in [b.name for b in backends()]


def test_an_unknown_address_is_named() -> None:
    with pytest.raises(UnknownFormatError, match=r"no storage format recognises the address"):
        backend_of("#/grp")
    with pytest.raises(UnknownFormatError, match=r"'zip'.*file: /data/a\.zip"):
        backend_of(Location("zip", "/data/a.zip", ""))
    with pytest.raises(UnknownFormatError, match=r"no storage format is registered as 'zip'"):
        get_backend("zip")
    assert issubclass(UnknownFormatError, DataError)
