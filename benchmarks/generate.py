"""Synthetic DeePMD datasets for the benchmarks, made once and reused.

``nsys`` O/H systems of 3–24 atoms with 20 frames each (one ``set.000`` holding coord, box,
energy, force), deterministic in ``seed``: the generator is :func:`mdloader.testing.make_dataset`,
so benchmarks, tests and docs share one definition of a system.

A dataset lives in ``<base>/nsys<N>_seed<S>/``; a manifest ``<base>/nsys<N>_seed<S>.json`` *beside*
the tree (so reading it is not a file-system call under the tree) marks it complete. Generation
writes into a ``.partial`` directory and renames it at the end, so an interrupted run is redone.

Usage: ``python -m benchmarks.generate --nsys 100 2000 [--base DIR] [--seed 0]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time

DEFAULT_BASE = os.environ.get("MDLOADER_BENCH_DATA") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mdloader", "bench-data")
NFRAMES = 20
NATOMS_RANGE = (3, 24)

log = logging.getLogger("benchmarks.generate")


def dataset_path(base: str, nsys: int, seed: int, nframes: int = NFRAMES) -> str:
    frames = "" if nframes == NFRAMES else f"_f{nframes}"
    return os.path.join(base, f"nsys{nsys}{frames}_seed{seed}")


def ensure_dataset(nsys: int, *, base: str = DEFAULT_BASE, seed: int = 0,
                   nframes: int = NFRAMES) -> str:
    """Return the root of the dataset, generating it first when its manifest is missing."""
    from mdloader.testing import make_dataset

    root = dataset_path(base, nsys, seed, nframes)
    manifest = root + ".json"
    if os.path.isfile(manifest) and os.path.isdir(root):
        return root
    partial = root + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(partial)
    t0 = time.monotonic()
    make_dataset(partial, nsys, natoms_range=NATOMS_RANGE, nframes=nframes, seed=seed,
                 keys=("energy", "force"))
    os.rename(partial, root)
    info = {"nsys": nsys, "seed": seed, "nframes": nframes, "natoms_range": list(NATOMS_RANGE),
            "type_map": ["O", "H"], "keys": ["coord", "box", "energy", "force"],
            "generated_s": round(time.monotonic() - t0, 2), "bytes": _tree_bytes(root)}
    with open(manifest, "w") as fh:
        json.dump(info, fh)
    log.info("generated %s in %.1f s", root, info["generated_s"])
    return root


def _tree_bytes(root: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nsys", type=int, nargs="+", default=[100, 2000])
    p.add_argument("--base", default=DEFAULT_BASE)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for n in args.nsys:
        print(ensure_dataset(n, base=args.base, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
