"""DeePMD-kit-like water systems for the time-to-first-step benchmark, made once and reused.

``nsys`` systems of 192 atoms (64 O, 128 H) with 8 frames each (or ``nframes``), drawn from the
frames of the repository's ``examples/water/data`` (DeePMD-kit's water example): every frame is a
real frame moved rigidly (a random translation, wrapped into the cubic box, and one of the 48
symmetries of the cube applied to coordinates and forces) plus a small jitter, so neighbour lists
and statistics see physical distances (the smallest O-H distance stays above 0.8 Å; checked).

A dataset lives in ``<base>/water192_n<N>_seed<S>/`` (``water192_n<N>_f<F>_seed<S>`` with another
number of frames; systems ``sys.<i>``, one ``set.000``); a manifest beside it marks it complete,
as :mod:`benchmarks.generate` does.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import shutil
import time

import numpy as np

from benchmarks.generate import DEFAULT_BASE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "water", "data")
NATOMS, NFRAMES = 192, 8
JITTER = 0.01  # Å, standard deviation per coordinate
MIN_DIST = 0.8  # Å; the example's smallest O-H distance is about 0.92 Å


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
                mats: list[np.ndarray], nframes: int = NFRAMES) -> dict[str, np.ndarray]:
    """The frames of one system: distinct real frames moved rigidly, with jitter."""
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
        coords.append(c.reshape(-1))
        forces.append((pool["force"][i].reshape(NATOMS, 3).astype(np.float64) @ m.T).reshape(-1))
    dtype = pool["coord"].dtype
    return {"coord": np.asarray(coords, dtype), "force": np.asarray(forces, dtype),
            "box": pool["box"][idx], "energy": pool["energy"][idx]}


def dataset_path(base: str, nsys: int, seed: int, nframes: int = NFRAMES) -> str:
    frames = "" if nframes == NFRAMES else f"_f{nframes}"
    return os.path.join(base, f"water192_n{nsys}{frames}_seed{seed}")


def ensure_water(nsys: int, *, base: str = DEFAULT_BASE, seed: int = 0,
                 nframes: int = NFRAMES) -> str:
    """The root of the dataset, generated first when its manifest is missing."""
    root = dataset_path(base, nsys, seed, nframes)
    manifest = root + ".json"
    if os.path.isfile(manifest) and os.path.isdir(root):
        return root
    partial = root + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.monotonic()
    pool, mats = _pool(), _cube_symmetries()
    rng = np.random.default_rng(seed)
    width = len(str(nsys - 1))
    for s in range(nsys):
        sys_dir = os.path.join(partial, f"sys.{s:0{width}d}")
        os.makedirs(os.path.join(sys_dir, "set.000"))
        np.savetxt(os.path.join(sys_dir, "type.raw"), pool["type"], fmt="%d")
        with open(os.path.join(sys_dir, "type_map.raw"), "w") as fh:
            fh.write("O\nH\n")
        for key, arr in make_system(pool, rng, mats, nframes).items():
            np.save(os.path.join(sys_dir, "set.000", f"{key}.npy"), arr)
    os.rename(partial, root)
    info = {"nsys": nsys, "seed": seed, "natoms": NATOMS, "nframes": nframes,
            "source": "examples/water/data", "jitter_A": JITTER, "min_dist_A": MIN_DIST,
            "generated_s": round(time.monotonic() - t0, 2)}
    with open(manifest, "w") as fh:
        json.dump(info, fh)
    return root
