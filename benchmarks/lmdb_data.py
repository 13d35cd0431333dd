"""The LMDB benchmark's databases, made once beside the npy dataset they are packed from.

``<base>/nsys<N>_f<F>_seed<S>`` (npy, :mod:`benchmarks.generate`) is packed with
``mdloader pack`` into ``….lmdb`` (one system id per npy system, ``frame_nlocs`` recorded), and
copied into ``….no-nlocs.lmdb`` whose ``__metadata__`` lacks ``frame_nlocs`` (both loaders must
then read every frame for its atom count: DeePMD-kit on every rank, mdloader on rank 0). A
manifest beside them marks both complete.

Usage: ``python -m benchmarks.lmdb_data --nsys 10000 --nframes 100``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from benchmarks.generate import DEFAULT_BASE, ensure_dataset


def ensure_lmdb(nsys: int, nframes: int, *, base: str = DEFAULT_BASE,
                seed: int = 0) -> dict[str, str]:
    """Paths of the npy dataset and of its two databases, generated when missing."""
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nsys", type=int, default=10000)
    p.add_argument("--nframes", type=int, default=100)
    p.add_argument("--base", default=DEFAULT_BASE)
    args = p.parse_args(argv)
    print(json.dumps(ensure_lmdb(args.nsys, args.nframes, base=args.base)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
