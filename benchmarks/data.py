"""The benchmarks' synthetic data sets, each made once under a data base and reused.

Four kinds, one place:

* ``npy`` (:func:`ensure_dataset`): ``nsys`` O/H systems of 3–24 atoms with 20 frames each (one
  ``set.000`` holding coord, box, energy, force), deterministic in ``seed``; the generator is
  :func:`mdloader.testing.make_dataset`, so benchmarks, tests and docs share one definition of a
  system. It lives in ``<base>/nsys<N>_seed<S>/`` (``nsys<N>_f<F>_seed<S>`` with other frames).
* ``water`` (:func:`ensure_water`): DeePMD-kit-like water, ``nsys`` systems of 192 atoms (64 O,
  128 H) with 8 frames each, drawn from the frames of ``examples/water/data``: every frame is a
  real frame moved rigidly (a random translation, wrapped into the cubic box, and one of the 48
  symmetries of the cube) plus a small jitter, so neighbour lists and statistics see physical
  distances (the smallest distance stays above 0.8 Å; checked). It lives in
  ``<base>/water192_n<N>_seed<S>/``. With ``cells=c`` each frame is tiled into a c×c×c
  supercell (192·c³ atoms, ``water<natoms>_n<N>_seed<S>``): a larger system of the same water.
* ``formats`` (:func:`ensure_formats`): an npy data set and the same systems as one HDF5 file
  (one group per system, DeePMD-kit's HDF5 layout, the arrays copied as they are) and as one
  LMDB database (``mdloader pack``), beside it.
* ``lmdb`` (:func:`ensure_lmdb`): the npy data set packed with ``mdloader pack`` into ``….lmdb``,
  and a copy ``….no-nlocs.lmdb`` whose ``__metadata__`` lacks ``frame_nlocs``.
* a synthetic system index (:func:`synthesize_index`) of many systems that exist only in the
  index, and unwrapped water-like systems (:func:`water_like`) for the neighbour statistics.

The npy and water data sets are generated into a ``.partial`` folder renamed at the end; the
two databases of ``lmdb`` are packed and copied in place (an interrupted run's are overwritten).
Each has a manifest *beside* the tree (so reading it is not a file-system call under the tree),
written last, that marks it complete, so an interrupted run is redone.

Usage: ``python -m benchmarks.data npy --nsys 100 2000``, ``python -m benchmarks.data water
--nsys 200``, ``python -m benchmarks.data lmdb --nsys 10000 --nframes 100`` (``--base DIR``).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import REPO

DEFAULT_BASE = os.environ.get("MDLOADER_BENCH_DATA") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mdloader", "bench-data")
NFRAMES = 20
NATOMS_RANGE = (3, 24)
TYPE_MAP = ["O", "H"]
EXAMPLE = os.path.join(REPO, "examples", "water", "data")
NATOMS, WATER_NFRAMES = 192, 8
JITTER = 0.01  # Å, standard deviation per coordinate
MIN_DIST = 0.8  # Å; the example's smallest O-H distance is about 0.92 Å

log = logging.getLogger("benchmarks.data")


def _published(root: str, make: Callable[[str], dict[str, Any]]) -> str:
    """``root``, made by ``make(partial)`` and renamed into place unless its manifest exists."""
    manifest = root + ".json"
    if os.path.isfile(manifest) and os.path.isdir(root):
        return root
    partial = root + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.monotonic()
    info = make(partial)
    os.rename(partial, root)
    info["generated_s"] = round(time.monotonic() - t0, 2)
    with open(manifest, "w") as fh:
        json.dump(info, fh)
    log.info("generated %s in %.1f s", root, info["generated_s"])
    return root


# --- npy: O/H systems of 3-24 atoms ---------------------------------------------------------

def _folder(base: str, stem: str, seed: int, nframes: int, default_frames: int) -> str:
    """``<base>/<stem>[_f<F>]_seed<S>``: the frame count appears only when not the default."""
    frames = "" if nframes == default_frames else f"_f{nframes}"
    return os.path.join(base, f"{stem}{frames}_seed{seed}")


def dataset_path(base: str, nsys: int, seed: int, nframes: int = NFRAMES) -> str:
    return _folder(base, f"nsys{nsys}", seed, nframes, NFRAMES)


def ensure_dataset(nsys: int, *, base: str = DEFAULT_BASE, seed: int = 0,
                   nframes: int = NFRAMES) -> str:
    """The root of the npy data set, generated first when its manifest is missing."""

    def make(partial: str) -> dict[str, Any]:
        from mdloader.testing import make_dataset

        os.makedirs(partial)
        make_dataset(partial, nsys, natoms_range=NATOMS_RANGE, nframes=nframes, seed=seed,
                     keys=("energy", "force"))
        return {"nsys": nsys, "seed": seed, "nframes": nframes,
                "natoms_range": list(NATOMS_RANGE), "type_map": TYPE_MAP,
                "keys": ["coord", "box", "energy", "force"], "bytes": _tree_bytes(partial)}

    return _published(dataset_path(base, nsys, seed, nframes), make)


def _tree_bytes(root: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


# --- water: frames of the water example, moved rigidly ---------------------------------------

def _pool() -> dict[str, np.ndarray]:
    """Every frame of the example (all systems, all sets) and the shared type/box."""
    parts: dict[str, list[np.ndarray]] = {"coord": [], "box": [], "energy": [], "force": []}
    for set_dir in sorted(glob.glob(os.path.join(EXAMPLE, "data_*", "set.*"))):
        for key in parts:
            parts[key].append(np.load(os.path.join(set_dir, f"{key}.npy")))
    pool = {k: np.concatenate(v) for k, v in parts.items()}
    pool["type"] = np.loadtxt(os.path.join(EXAMPLE, "data_0", "type.raw"), dtype=np.int64)
    return pool


def _cube_symmetries() -> list[np.ndarray]:
    """The 48 orthogonal matrices mapping the cube onto itself (axis permutations and signs)."""
    mats = []
    for perm in itertools.permutations(range(3)):
        for signs in itertools.product((1.0, -1.0), repeat=3):
            m = np.zeros((3, 3))
            m[range(3), perm] = signs
            mats.append(m)
    return mats


def min_distance(coord: np.ndarray, box_length: float) -> float:
    """The smallest distance between two atoms of one frame (minimum image, cubic box)."""
    d = coord[:, None, :] - coord[None, :, :]
    d -= box_length * np.round(d / box_length)
    r = np.sqrt((d * d).sum(-1))
    np.fill_diagonal(r, np.inf)
    return float(r.min())


def make_system(pool: dict[str, np.ndarray], rng: np.random.Generator,
                mats: list[np.ndarray], nframes: int = WATER_NFRAMES,
                cells: int = 1) -> dict[str, np.ndarray]:
    """The frames of one system: distinct real frames moved rigidly, with jitter, each tiled
    into a ``cells``³ supercell (the checked minimum-image distances carry over to it)."""
    idx = rng.choice(len(pool["energy"]), nframes, replace=False)
    coords, forces = [], []
    for i in idx:
        length = float(pool["box"][i, 0])
        m = mats[rng.integers(len(mats))]
        c = pool["coord"][i].reshape(NATOMS, 3).astype(np.float64) @ m.T
        c = c + rng.uniform(0, length, 3) + rng.normal(0, JITTER, c.shape)
        c = np.mod(c, length)
        if min_distance(c, length) < MIN_DIST:
            raise RuntimeError("generated water frame has overlapping atoms")
        f = pool["force"][i].reshape(NATOMS, 3).astype(np.float64) @ m.T
        shifts = length * np.array(list(itertools.product(range(cells), repeat=3)))
        coords.append((c[None] + shifts[:, None]).reshape(-1))
        forces.append(np.tile(f, (cells ** 3, 1)).reshape(-1))
    dtype = pool["coord"].dtype
    return {"coord": np.asarray(coords, dtype), "force": np.asarray(forces, dtype),
            "box": pool["box"][idx] * cells, "energy": pool["energy"][idx] * cells ** 3}


def water_path(base: str, nsys: int, seed: int, nframes: int = WATER_NFRAMES,
               cells: int = 1) -> str:
    return _folder(base, f"water{NATOMS * cells ** 3}_n{nsys}", seed, nframes, WATER_NFRAMES)


def ensure_water(nsys: int, *, base: str = DEFAULT_BASE, seed: int = 0,
                 nframes: int = WATER_NFRAMES, cells: int = 1) -> str:
    """The root of the water data set (frames tiled ``cells``³ times), generated first when its
    manifest is missing."""

    def make(partial: str) -> dict[str, Any]:
        pool, mats = _pool(), _cube_symmetries()
        rng = np.random.default_rng(seed)
        width = len(str(nsys - 1))
        for s in range(nsys):
            sys_dir = os.path.join(partial, f"sys.{s:0{width}d}")
            os.makedirs(os.path.join(sys_dir, "set.000"))
            np.savetxt(os.path.join(sys_dir, "type.raw"), np.tile(pool["type"], cells ** 3),
                       fmt="%d")
            with open(os.path.join(sys_dir, "type_map.raw"), "w") as fh:
                fh.write("O\nH\n")
            for key, arr in make_system(pool, rng, mats, nframes, cells).items():
                np.save(os.path.join(sys_dir, "set.000", f"{key}.npy"), arr)
        return {"nsys": nsys, "seed": seed, "natoms": NATOMS * cells ** 3, "nframes": nframes,
                "cells": cells, "source": "examples/water/data", "jitter_A": JITTER,
                "min_dist_A": MIN_DIST}

    return _published(water_path(base, nsys, seed, nframes, cells), make)


def water_like(root: Path, nsys: int, nframes: int, seed: int = 0) -> list[str]:
    """``nsys`` systems of 64 molecules (192 atoms) at water density, coordinates unwrapped."""
    rng = np.random.default_rng(seed)
    side = (192 / 3 * 29.9) ** (1 / 3)  # 29.9 A^3 per molecule
    paths = []
    for s in range(nsys):
        path = root / f"sys.{s:04d}"
        (path / "set.000").mkdir(parents=True)
        (path / "type.raw").write_text(" ".join(["0"] * 64 + ["1"] * 128) + "\n")
        (path / "type_map.raw").write_text("O\nH\n")
        grid = (np.stack(np.meshgrid(*[np.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3)
                + 0.5) * side / 4
        coords = []
        for _ in range(nframes):
            oxygen = grid + rng.normal(scale=0.3, size=grid.shape)
            d1, d2 = rng.normal(size=(2, 64, 3))
            h1 = oxygen + 0.96 * d1 / np.linalg.norm(d1, axis=1, keepdims=True)
            h2 = oxygen + 0.96 * d2 / np.linalg.norm(d2, axis=1, keepdims=True)
            atoms = np.concatenate([oxygen, h1, h2])
            atoms += rng.integers(-1, 2, atoms.shape) * side  # unwrapped
            coords.append(atoms.reshape(-1))
        np.save(path / "set.000" / "coord.npy", np.array(coords))
        np.save(path / "set.000" / "box.npy", np.tile(np.diag([side] * 3).reshape(1, 9),
                                                      (nframes, 1)))
        np.save(path / "set.000" / "energy.npy", rng.normal(size=nframes))
        paths.append(str(path))
    return paths


# --- formats: the same systems as npy, HDF5 and LMDB -----------------------------------------

H5_FILE = "data.h5"


def ensure_formats(npy_root: str,
                   formats: tuple[str, ...] = ("npy", "hdf5", "lmdb")) -> dict[str, str]:
    """Format -> the address of the systems of the npy data set at ``npy_root`` in it: ``npy``
    the data set itself, ``hdf5`` one HDF5 file (``<npy_root>.hdf5/data.h5``), ``lmdb`` one
    database (``<npy_root>.lmdb``, packed with ``mdloader pack``); each written once."""

    def packed(partial: str) -> dict[str, Any]:
        from mdloader.cli.pack import pack

        report = pack([npy_root], partial, overwrite=True, progress=False)
        return {"source": os.path.basename(npy_root), "frames": report.total_frames}

    makers = {"npy": lambda: npy_root,
              "hdf5": lambda: os.path.join(_published(
                  npy_root + ".hdf5", lambda partial: _copy_to_h5(npy_root, partial)), H5_FILE),
              "lmdb": lambda: _published(npy_root + ".lmdb", packed)}
    unknown = sorted(set(formats) - set(makers))
    if unknown:
        raise ValueError(f"unknown formats {unknown}: expected some of {sorted(makers)}")
    return {f: makers[f]() for f in formats}


def _copy_to_h5(npy_root: str, folder: str) -> dict[str, Any]:
    """Every system folder under ``npy_root`` as a group of ``folder/data.h5``: the same
    relative paths, ``type.raw`` as integers, ``type_map.raw`` as byte strings, every array as
    it is (DeePMD-kit's HDF5 layout, as ``mdloader convert --to deepmd/hdf5`` writes it)."""
    import h5py

    os.makedirs(folder)
    systems = sorted(d for d in os.listdir(npy_root)
                     if os.path.isfile(os.path.join(npy_root, d, "type.raw")))
    with h5py.File(os.path.join(folder, H5_FILE), "w") as fh:
        for name in systems:
            src, group = os.path.join(npy_root, name), fh.create_group(name)
            group.create_dataset("type.raw", data=np.loadtxt(os.path.join(src, "type.raw"),
                                                             dtype=np.int64, ndmin=1))
            with open(os.path.join(src, "type_map.raw")) as tm:
                group.create_dataset("type_map.raw", data=np.array(tm.read().split(), dtype="S"))
            for set_dir in sorted(glob.glob(os.path.join(src, "set.*"))):
                for array in sorted(glob.glob(os.path.join(set_dir, "*.npy"))):
                    group.create_dataset(os.path.relpath(array, src), data=np.load(array))
    return {"source": os.path.basename(npy_root), "systems": len(systems)}


# --- lmdb: the npy data set packed, with and without frame_nlocs ----------------------------

def ensure_lmdb(nsys: int, nframes: int, *, base: str = DEFAULT_BASE,
                seed: int = 0) -> dict[str, str]:
    """Paths of the npy data set and of its two databases, generated when missing."""
    npy = ensure_dataset(nsys, base=base, seed=seed, nframes=nframes)
    paths = {"npy": npy, "lmdb": npy + ".lmdb", "lmdb_no_nlocs": npy + ".no-nlocs.lmdb"}
    manifest = npy + ".lmdb.json"
    if os.path.isfile(manifest):
        return paths
    from mdloader.cli.pack import pack

    t0 = time.monotonic()
    report = pack([npy], paths["lmdb"], overwrite=True, progress=True)
    packed = time.monotonic() - t0
    shutil.rmtree(paths["lmdb_no_nlocs"], ignore_errors=True)
    shutil.copytree(paths["lmdb"], paths["lmdb_no_nlocs"])
    _drop_frame_nlocs(paths["lmdb_no_nlocs"])
    info = {"nsys": nsys, "nframes_per_system": nframes, "frames": report.total_frames,
            "pack_s": round(packed, 1),
            "bytes": os.path.getsize(os.path.join(paths["lmdb"], "data.mdb"))}
    with open(manifest, "w") as fh:
        json.dump(info, fh)
    return paths


def _drop_frame_nlocs(path: str) -> None:
    import lmdb
    import msgpack

    env = lmdb.open(path, map_size=os.path.getsize(os.path.join(path, "data.mdb")) * 2)
    try:
        with env.begin(write=True) as txn:
            meta = msgpack.unpackb(txn.get(b"__metadata__"), raw=False)
            meta.pop("frame_nlocs")
            txn.put(b"__metadata__", msgpack.packb(meta, use_bin_type=True))
    finally:
        env.close()


# --- a system index of systems that exist only in the index ---------------------------------

def synthesize_index(root: str, nsys: int, cache_dir: str, seed: int = 0) -> str:
    """Write the index of ``nsys`` synthetic systems under ``root``; its path.

    The descriptions are made column by column (no file, no per-system description) with the
    shapes of the npy data set, and saved where mdloader looks for the index of ``root`` with the
    benchmark's type map; read in ``trust`` mode, nothing under ``root`` is touched.
    """
    from mdloader.catalog.index import index_header, index_request
    from mdloader.catalog.index_file import SavedIndex, write_index
    from mdloader.catalog.table import SystemTable
    from mdloader.data.formats.base import restore_set

    rng = np.random.default_rng(seed)
    natoms = rng.integers(NATOMS_RANGE[0], NATOMS_RANGE[1] + 1, size=nsys)
    width = len(str(nsys - 1))
    names = "".join(f"sys.{i:0{width}d}" for i in range(nsys)).encode()
    sizes = list(range(NATOMS_RANGE[0], NATOMS_RANGE[1] + 1))
    sets = tuple(restore_set("set.000", NFRAMES, ("box", "coord", "energy", "force"),
                             (9, 3 * n, 1, 3 * n)) for n in sizes)
    types = np.concatenate([np.arange(n) % 2 for n in natoms]).astype(np.int8)
    small = np.min_scalar_type
    columns = {
        "folder_id": np.zeros(nsys, np.uint8),
        "name_len": np.full(nsys, 4 + width, small(4 + width)),
        "natoms": natoms.astype(np.uint8), "types": types,
        "type_map_id": np.zeros(nsys, np.uint8), "flags": np.ones(nsys, np.uint8),
        "nsets": np.ones(nsys, np.uint8), "set_ids": (natoms - NATOMS_RANGE[0]).astype(np.uint8),
        "idx_map_id": np.zeros(nsys, np.uint8)}
    table = SystemTable(columns, names, (root.rstrip("/") + "/",), (tuple(TYPE_MAP),), sets,
                        (None,))
    request = index_request(root, None, TYPE_MAP, cache_dir=cache_dir)
    saved = SavedIndex(table, time.time_ns())
    write_index(request.path, saved, index_header(request, saved))
    return request.path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("kind", choices=("npy", "water", "lmdb"))
    p.add_argument("--nsys", type=int, nargs="+",
                   help="systems per data set (default: 10000 for lmdb, 100 and 2000 otherwise)")
    p.add_argument("--nframes", type=int, help="frames per system (default: the kind's)")
    p.add_argument("--base", default=DEFAULT_BASE)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    nsys = args.nsys or ([10000] if args.kind == "lmdb" else [100, 2000])
    for n in nsys:
        if args.kind == "npy":
            print(ensure_dataset(n, base=args.base, seed=args.seed,
                                 nframes=args.nframes or NFRAMES))
        elif args.kind == "water":
            print(ensure_water(n, base=args.base, seed=args.seed,
                               nframes=args.nframes or WATER_NFRAMES))
        else:
            print(json.dumps(ensure_lmdb(n, args.nframes or 100, base=args.base,
                                         seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
