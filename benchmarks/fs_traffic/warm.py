"""The warm case of the file-system traffic benchmark: mdloader's feed reading training batches
from the page cache, per batch, without tracing (:mod:`benchmarks.fs_traffic.run` measures
calls and bytes under ``strace``, which slows every call).

One command::

    python -m benchmarks.fs_traffic.warm            # 200 water systems, npy/HDF5/LMDB
    python -m benchmarks.fs_traffic.warm --formats npy --direct \
        --out RESULTS/fs_traffic/direct.jsonl      # MDLOADER_DIRECT_READS=0 and 1, appended

For each format: a one-stream feed with no DataLoader workers (the reads in this process), a
warm-up of ``--warmup`` batches (every file read once), then the median over ``--repeats`` runs
of ``--batches`` batches of the wall time per batch. The same command run against another
checkout of mdloader (``PYTHONPATH``) compares two read paths on the same data and machine.
``--direct`` measures each format twice, through the page cache and with
``MDLOADER_DIRECT_READS=1`` (O_DIRECT: every read goes to storage, the price of the mode on a
data set that would fit in memory); ``--out`` appends one ``warm`` record per measurement to a
results file of the family, whose section shows them.
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--direct", action="store_true",
                   help="each format with MDLOADER_DIRECT_READS=0, then =1")
    p.add_argument("--out", default=None, help="a results file to append warm records to")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    root = ensure_water(args.nsys, base=args.data_base, nframes=WATER_NFRAMES)
    formats = [f for f in args.formats.split(",") if f]
    data = ensure_formats(root, tuple(formats))
    before = os.environ.get("MDLOADER_DIRECT_READS")
    modes = ("0", "1") if args.direct else (before or "0",)
    for fmt in formats:
        for mode in modes:
            os.environ["MDLOADER_DIRECT_READS"] = mode  # read when a file is first opened
            try:
                runs = measure(data[fmt], args.warmup, args.batches, args.repeats)
            finally:
                if before is None:
                    del os.environ["MDLOADER_DIRECT_READS"]
                else:
                    os.environ["MDLOADER_DIRECT_READS"] = before
            load = os.getloadavg()[0]
            print(f"{fmt:5s} warm, MDLOADER_DIRECT_READS={mode}: "
                  f"{1e3 * statistics.median(runs):.3f} ms per batch (median of "
                  f"{args.repeats} x {args.batches} batches; range "
                  f"{1e3 * min(runs):.3f}-{1e3 * max(runs):.3f}; 1-minute load {load:.1f})",
                  flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps({
                        "kind": "warm", "format": fmt, "direct_reads": mode == "1",
                        "nsys": args.nsys, "warmup": args.warmup, "batches": args.batches,
                        "repeats": args.repeats, "ms_per_batch": [1e3 * r for r in runs],
                        "loadavg_1min": round(load, 2)}) + "\n")
    return 0


def measure(address: str, warmup: int, batches: int, repeats: int) -> list[float]:
    """Seconds per batch of each of ``repeats`` runs of ``batches`` batches after a warm-up."""
    from mdloader.data.formats import release_handles

    release_handles()  # files opened anew, under the mode asked for
    draw, close, _systems = mdloader_source(address, 0)
    for _ in range(warmup):
        draw()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batches):
            draw()
        runs.append((time.perf_counter() - t0) / batches)
    close()
    return runs


if __name__ == "__main__":
    sys.exit(main())
