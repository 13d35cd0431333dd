"""Memory of the neighbour statistics: whole-set reads against chunked reads, same data, one run.

Generates one water-like system (192 atoms, unwrapped coordinates, ``--frames`` frames in one
set) as an npy folder and as an LMDB database, and runs ``neighbour_statistics`` (one rank, cache
off) on each in a fresh process, once reading every set at once (``chunk_atom_frames=None``, as
before chunked reads) and once in chunks of ``mdloader.stats.frames.CHUNK_ATOM_FRAMES``
atom-frames. Prints wall and CPU seconds, peak RSS and peak anonymous RSS (sampled every 20 ms;
file-backed pages of mapped npy files are not in it) above the process's RSS before the pass,
and the ratios, and checks that both give the same numbers.

    python -m benchmarks.statistics.memory --frames 20000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import REPO

CHILD = r"""
import functools, json, os, sys, threading, time
from mdloader.data.dataset import DeepmdDataSetForLoader
import mdloader.loading.statistics as st

address, whole = sys.argv[1], sys.argv[2] == "whole"
if whole:
    st.system_neighbour_stats = functools.partial(st.system_neighbour_stats,
                                                  chunk_atom_frames=None)

def status(key):
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith(key + ":")) / 1024

peak_anon, stop = [0.0], threading.Event()
def poll():
    while not stop.is_set():
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.02)

ds = DeepmdDataSetForLoader(address, ["O", "H"])
base_rss, base_anon = status("VmRSS"), status("RssAnon")
sampler = threading.Thread(target=poll, daemon=True)
sampler.start()
wall, cpu = time.perf_counter(), time.process_time()
stats = st.neighbour_statistics([ds], 6.0, type_map=["O", "H"], mixed_type=False, mode="off",
                                progress=False)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
stop.set()
sampler.join()
print("RESULT " + json.dumps({
    "seconds": wall, "cpu": cpu, "rss": status("VmHWM") - base_rss,
    "anon": peak_anon[0] - base_anon, "min2": stats.min_distance2.hex(),
    "max": list(stats.max_neighbours), "load": os.getloadavg()[0]}))
"""


def measure(address: str, variant: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", CHILD, address, variant], env=env,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(proc.stdout + proc.stderr)
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=20000)
    args = parser.parse_args()
    from benchmarks.data import water_like
    from mdloader.catalog.discover import discover_systems
    from mdloader.stats.frames import CHUNK_ATOM_FRAMES
    from mdloader.testing import make_lmdb

    with tempfile.TemporaryDirectory(prefix="stats-memory-") as tmp:
        (npy,) = water_like(Path(tmp) / "npy", 1, args.frames)
        (group,) = discover_systems([make_lmdb(Path(tmp) / "db.lmdb", [npy],
                                               type_map=["O", "H"])])
        rows = {(fmt, variant): measure(address, variant)
                for fmt, address in (("npy", npy), ("LMDB", group))
                for variant in ("whole", "chunks")}
    print(f"neighbour_statistics, one system of {args.frames} frames x 192 atoms, rcut 6, one "
          f"rank; chunks of {CHUNK_ATOM_FRAMES} atom-frames; MiB above the RSS before the pass")
    print(f"{'':16}{'wall s':>8}{'cpu s':>8}{'peak RSS':>10}{'peak anon':>11}{'load':>6}")
    for (fmt, variant), r in rows.items():
        print(f"{fmt + ' ' + variant:16}{r['seconds']:8.1f}{r['cpu']:8.1f}{r['rss']:10.0f}"
              f"{r['anon']:11.0f}{r['load']:6.1f}")
    for fmt in ("npy", "LMDB"):
        whole, chunks = rows[(fmt, "whole")], rows[(fmt, "chunks")]
        same = (whole["min2"], whole["max"]) == (chunks["min2"], chunks["max"])
        print(f"{fmt}: whole / chunks: cpu {whole['cpu'] / chunks['cpu']:.2f}, peak RSS "
              f"{whole['rss'] / max(chunks['rss'], 1):.1f}, peak anon "
              f"{whole['anon'] / max(chunks['anon'], 1):.1f}; same numbers: {same}")


if __name__ == "__main__":
    main()
