"""The warm case of the file-system traffic benchmark: mdloader's feed reading training batches
from the page cache, per batch, without tracing (:mod:`benchmarks.fs_traffic.run` measures
calls and bytes under ``strace``, which slows every call).

One command::

    python -m benchmarks.fs_traffic.warm            # 200 water systems, npy/HDF5/LMDB

For each format: a one-stream feed with no DataLoader workers (the reads in this process), a
warm-up of ``--warmup`` batches (every file read once), then the median over ``--repeats`` runs
of ``--batches`` batches of the wall time per batch. The same command run against another
checkout of mdloader (``PYTHONPATH``) compares two read paths on the same data and machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks.data import DEFAULT_BASE, WATER_NFRAMES, ensure_formats, ensure_water
from benchmarks.fs_traffic.measure import mdloader_source


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nsys", type=int, default=200)
    p.add_argument("--formats", default="npy,hdf5,lmdb")
    p.add_argument("--warmup", type=int, default=2400)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--data-base", default=os.path.join(DEFAULT_BASE, "fs_traffic"))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    root = ensure_water(args.nsys, base=args.data_base, nframes=WATER_NFRAMES)
    formats = [f for f in args.formats.split(",") if f]
    data = ensure_formats(root, tuple(formats))
    for fmt in formats:
        draw, close, _systems = mdloader_source(data[fmt], 0)
        for _ in range(args.warmup):
            draw()
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.batches):
                draw()
            runs.append((time.perf_counter() - t0) / args.batches)
        close()
        print(f"{fmt:5s} warm: {1e3 * statistics.median(runs):.3f} ms per batch (median of "
              f"{args.repeats} x {args.batches} batches; range "
              f"{1e3 * min(runs):.3f}-{1e3 * max(runs):.3f}; 1-minute load "
              f"{os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
