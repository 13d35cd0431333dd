"""Systems the statistics tests share: real ones from the repository and generated ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mdloader.testing import make_system

REPO = Path(__file__).resolve().parents[2]
WATER = REPO / "examples" / "water" / "data"
DEEPMD_TESTS = REPO / "tests" / "fixtures" / "deepmd-tests"
MIXED_PBC = DEEPMD_TESTS / "tf" / "finetune" / "data_mixed_type"  # O/H, 4 frames, 192 atoms
MIXED_NOPBC = [DEEPMD_TESTS / "pt" / "property" / "single",  # H/C/N/O, no box
               DEEPMD_TESTS / "pt" / "property" / "double"]


def triclinic(root: Path, name: str = "tri", *, natoms: int = 24, nframes: int = 6,
              seed: int = 3, unwrap: float = 1.5) -> str:
    """A periodic O/H system in tilted, frame-varying boxes with unwrapped coordinates (atoms
    up to ``unwrap`` box lengths outside the cell), so that DeePMD-kit's image range matters."""
    path = make_system(root, name, natoms=natoms, nframes=nframes, seed=seed)
    rng = np.random.default_rng(seed)
    base = np.array([[7.0, 0.0, 0.0], [2.1, 6.5, 0.0], [-1.3, 1.7, 6.8]])
    boxes = np.stack([base * (1 + 0.05 * rng.random()) for _ in range(nframes)])
    frac = rng.random((nframes, natoms, 3)) + rng.integers(-1, 2, (nframes, natoms, 3)) * unwrap
    coord = np.einsum("fad,fdk->fak", frac, boxes)
    np.save(Path(path) / "set.000" / "box.npy", boxes.reshape(nframes, 9))
    np.save(Path(path) / "set.000" / "coord.npy", coord.reshape(nframes, -1))
    return path


def generated(root: Path) -> dict[str, list[str]]:
    """Small generated cases: periodic in small cells (several images), non-periodic, mixed
    type with virtual atoms, three types, and a tilted box with unwrapped coordinates."""
    root = Path(root)
    small = [make_system(root, f"small{i}", natoms=n, nframes=4, nsets=2, seed=i)
             for i, n in enumerate((6, 9))]
    nopbc = [make_system(root, f"nopbc{i}", natoms=n, nframes=3, pbc=False, seed=10 + i)
             for i, n in enumerate((1, 7))]
    mixed = make_system(root, "mixed", natoms=10, nframes=4, mixed_type=True, seed=20,
                        type_map=("O", "H", "C"))
    rat = Path(mixed) / "set.000" / "real_atom_types.npy"
    types = np.load(rat)
    types[:, -2:] = -1  # virtual atoms
    np.save(rat, types)
    three = make_system(root, "three", natoms=12, nframes=3, type_map=("O", "H", "C"),
                        seed=30, dtype=np.float64)
    return {"small": small, "nopbc": nopbc, "mixed": [mixed], "three": [three],
            "tri": [triclinic(root)]}
