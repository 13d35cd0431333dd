"""Shared-file-system traffic per training batch at steady state: mdloader and DeePMD-kit 3.2.0's
own loader on the same draws, side by side in one run.

One command::

    python -m benchmarks.fs_traffic.run            # 200 water systems, npy/HDF5/LMDB (~12 min)
    python -m benchmarks.fs_traffic.run --formats lmdb --warmup 20 \
        --out RESULTS/fs_traffic/lmdb_short_warmup.jsonl    # before maps hold the database
    python -m benchmarks.fs_traffic.run --nsys 32 --cells 2 --warmup 600 --nofile 1024 \
        --out RESULTS/fs_traffic/atoms1536.jsonl    # rows of 18 KiB: bytes near the payload
    python -m benchmarks.fs_traffic.run --nsys 10000 --formats npy --workers 2 --nofile 1024 \
        --warmup 200 --out RESULTS/fs_traffic/n10000.jsonl    # re-opens: the steady state
    python -m benchmarks.fs_traffic.run --nsys 100000 --out RESULTS/fs_traffic/n100000.jsonl
    python -m benchmarks.fs_traffic.run --formats npy --nofile 1024 --direct \
        --out RESULTS/fs_traffic/direct.jsonl    # MDLOADER_DIRECT_READS=1 rows beside
    python -m benchmarks.fs_traffic.run --formats hdf5 --nofile 1024 --direct \
        --out RESULTS/fs_traffic/hdf5_direct.jsonl    # contiguous HDF5 datasets by offset

(``RESULTS``: ``benchmarks/results``.) The data: ``--nsys`` water systems of 192 atoms and 8
frames (:func:`benchmarks.data.ensure_water`), also as one HDF5 file and one LMDB database
(:func:`benchmarks.data.ensure_formats`); one frame per batch (``batch_size: auto``), as users of
water-like data train. For every format and soft ``ulimit -n`` (1024 and the hard limit),
mdloader runs first and records its draws; DeePMD-kit then replays them
(:mod:`benchmarks.fs_traffic.measure`), so both read the same systems and frames. Each loader
runs in its own interpreter under
``strace -f -y -ttt`` (:mod:`benchmarks.fs_traffic.trace` counts the calls under the data tree
and the bytes the reads returned), and reports the bytes its process tree fetched from storage
(``read_bytes`` of ``/proc/<pid>/io``) over two windows after a warm-up: ``cold`` (the tree
evicted from the page cache before the window, with ``posix_fadvise(POSIX_FADV_DONTNEED)`` on
every file: :func:`benchmarks.startup.evict.evict`) and ``per-pass`` (evicted again before every
pass of ``--pass-batches`` batches). After each eviction the harness measures how much of the
tree is still in the page cache (``mincore``): pages a process keeps mapped cannot be evicted
this way. Records go to a JSON-lines file; :mod:`benchmarks.fs_traffic.report` prints the
table and writes its section of ``docs/benchmarks.md``.

``--direct`` adds a third launch, mdloader with ``MDLOADER_DIRECT_READS=1`` (npy rows and rows
of contiguous, unfiltered HDF5 datasets read with O_DIRECT) on the same draws, whose records are
labelled ``mdloader-direct``.

Without a usable ``strace`` (not installed, or ptrace not permitted) the run still measures the
bytes from storage, and the call columns stay empty (``fs_tool`` says so).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from benchmarks import REPO, RESULTS
from benchmarks.data import DEFAULT_BASE, WATER_NFRAMES, ensure_formats, ensure_water
from benchmarks.fs_traffic import trace
from benchmarks.launch import python_for, rank_env
from benchmarks.startup.evict import evict

DEFAULT = os.path.join(RESULTS, "fs_traffic", "fs_traffic.jsonl")
PAYLOAD_KEYS = ("coord", "box", "energy", "force")
DIRECT = "mdloader-direct"  # the label of mdloader's records with MDLOADER_DIRECT_READS=1
STRACE = ["strace", "-f", "-y", "-ttt", "-s", "0", "--seccomp-bpf", "-e",
          f"trace={trace.TRACED}"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nsys", type=int, default=200, help="water systems")
    p.add_argument("--nframes", type=int, default=WATER_NFRAMES, help="frames per system")
    p.add_argument("--cells", type=int, default=1,
                   help="each system a cells³ supercell of 192 atoms (2: 1536 atoms)")
    p.add_argument("--formats", default="npy,hdf5,lmdb")
    p.add_argument("--workers", default="2,0",
                   help="DataLoader workers, measured in this order in one interpreter")
    p.add_argument("--nofile", default="1024,high",
                   help="soft ulimit -n of the measured process ('high': the hard limit)")
    p.add_argument("--impls", default="mdloader,deepmd")
    p.add_argument("--warmup", type=int, default=2400, help="batches before the windows (with "
                   "a pass of all frames, the windows see no first open: the steady state)")
    p.add_argument("--batches", type=int, default=100, help="batches per measured window")
    p.add_argument("--pass-batches", type=int, default=25,
                   help="batches between evictions in the per-pass window")
    p.add_argument("--tail", type=int, default=16, help="batches after the windows")
    p.add_argument("--deepmd-python", default=os.environ.get("MDLOADER_DEEPMD_PYTHON") or
                   os.path.join(REPO, ".venv-deepmd", "bin", "python"),
                   help="an interpreter that imports DeePMD-kit 3.2.0")
    p.add_argument("--data-base", default=os.path.join(DEFAULT_BASE, "fs_traffic"),
                   help="a base of this benchmark's own: another job reading or mapping the "
                   "same files would keep them in the page cache")
    p.add_argument("--timeout", type=float, default=300, help="per launch")
    p.add_argument("--no-strace", action="store_true", help="bytes from storage only")
    p.add_argument("--direct", action="store_true",
                   help="also run mdloader with MDLOADER_DIRECT_READS=1 (O_DIRECT rows), "
                   f"records labelled {DIRECT!r}")
    p.add_argument("--out", default=DEFAULT)
    p.add_argument("--no-report", action="store_true",
                   help="print the table only; leave docs/benchmarks.md as it is")
    return p.parse_args(argv)


def _list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def strace_usable() -> bool:
    """Whether ``strace -f`` can trace a child here (installed, ptrace permitted)."""
    if shutil.which("strace") is None:
        return False
    try:
        done = subprocess.run(["strace", "-f", "-o", os.devnull, "true"], capture_output=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def tree_of(fmt: str, address: str) -> str:
    """The folder whose files a format's address reads (an HDF5 file's folder)."""
    return os.path.dirname(address) if fmt == "hdf5" else address


def payload_per_frame(npy_root: str) -> int:
    """Bytes one frame holds in storage (coord, box, energy, force of one system's set)."""
    first = sorted(d for d in os.listdir(npy_root) if d.startswith("sys."))[0]
    total = 0
    for key in PAYLOAD_KEYS:
        arr = np.load(os.path.join(npy_root, first, "set.000", key + ".npy"), mmap_mode="r")
        total += arr.nbytes // arr.shape[0]
    return total


def resident_bytes(root: str) -> int:
    """Bytes of the files under ``root`` in the page cache now (``mincore`` of a map of each)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            size = os.path.getsize(path)
            if size == 0:
                continue
            with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size,
                                                    access=mmap.ACCESS_COPY) as m:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
                if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0:
                    total += sum(v & 1 for v in vec) * page
    return total


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root) for f in fs)


def row_spans(fmt: str, address: str, systems: list[str]
              ) -> dict[tuple[str, str], tuple[str, int, int]] | None:
    """Where each payload key's rows lie: (system name, key) -> (file, first byte, bytes per
    row), for the formats whose arrays are contiguous in a file (npy, HDF5); else ``None``."""
    from benchmarks.fs_traffic.measure import system_name

    spans = {}
    if fmt == "npy":
        for system in systems:
            for key in PAYLOAD_KEYS:
                path = os.path.join(system, "set.000", key + ".npy")
                arr = np.load(path, mmap_mode="r")
                spans[(system_name(system), key)] = (path, arr.offset,
                                                     arr.nbytes // arr.shape[0])
        return spans
    if fmt == "hdf5":
        import h5py

        with h5py.File(address, "r") as fh:
            for system in systems:
                group = system.partition("#")[2]
                for key in PAYLOAD_KEYS:
                    dset = fh[f"{group}/set.000/{key}.npy"]
                    offset = dset.id.get_offset()
                    if offset is None:  # chunked or compact: no single span
                        return None
                    spans[(system_name(system), key)] = (
                        address, offset, dset.id.get_storage_size() // dset.shape[0])
        return spans
    return None


def page_floor(spans: dict[tuple[str, str], tuple[str, int, int]], draws: list[Any],
               first: int, batches: int, pass_batches: int | None) -> float:
    """Bytes per batch of the 4 KiB pages that the drawn rows span, each page counted once per
    pass (``pass_batches``; ``None``: once in the window): what a reader that fetches exactly
    the pages it needs takes from storage."""
    page = mmap.PAGESIZE
    total, seen = 0, set()
    for i, (name, fids) in enumerate(draws[first:first + batches]):
        if pass_batches and i % pass_batches == 0:
            seen = set()
        for key in PAYLOAD_KEYS:
            path, start, row = spans[(name, key)]
            for fid in fids:
                lo, hi = start + fid * row, start + (fid + 1) * row - 1
                for p in range(lo // page, hi // page + 1):
                    if (path, p) not in seen:
                        seen.add((path, p))
                        total += page
    return total / batches


def floors_of(fmt: str, address: str, draws_dir: str, run: dict[str, Any], args: argparse.Namespace
              ) -> dict[tuple[int, str], float] | None:
    """:func:`page_floor` of each window of mdloader's draws, by (workers, window)."""
    out = {}
    for config in run["configs"]:
        with open(os.path.join(draws_dir, f"w{config['workers']}.json")) as fh:
            saved = json.load(fh)
        spans = row_spans(fmt, address, saved["systems"])
        if spans is None:
            return None
        first = args.warmup
        out[(config["workers"], "cold")] = page_floor(spans, saved["draws"], first,
                                                      args.batches, None)
        out[(config["workers"], "per-pass")] = page_floor(
            spans, saved["draws"], first + args.batches, args.batches, args.pass_batches)
    return out


def launch(python: str, impl: str, fmt: str, address: str, draws: str, nofile: str,
           args: argparse.Namespace, traced: bool, direct: bool = False) -> dict[str, Any]:
    """One measured interpreter, the harness evicting the tree when it asks; its result, the
    trace's counts per window and the residency after each eviction. ``direct``: mdloader
    with ``MDLOADER_DIRECT_READS=1``."""
    tree = tree_of(fmt, address)
    log = tempfile.NamedTemporaryFile(prefix="mdl-fst-", suffix=".strace", delete=False)
    log.close()
    cmd = [python, "-m", "benchmarks.fs_traffic.measure", "--impl", impl, "--format", fmt,
           "--address", address, "--draws", draws, "--workers", args.workers, "--nofile",
           nofile, "--warmup", str(args.warmup), "--batches", str(args.batches),
           "--pass-batches", str(args.pass_batches), "--tail", str(args.tail)]
    if traced:
        cmd = [*STRACE, "-o", log.name, *cmd]
    err = tempfile.TemporaryFile(mode="w+")
    env = rank_env(MDLOADER_DIRECT_READS="1" if direct else "0")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err, text=True,
                            start_new_session=True)
    timer = threading.Timer(args.timeout, lambda: os.killpg(proc.pid, 9))
    timer.start()
    resident, result = [], None
    try:
        for line in proc.stdout or ():
            if line.startswith("@fst evict"):
                evict(tree)
                resident.append(resident_bytes(tree))
                print("ok", file=proc.stdin, flush=True)
            elif line.startswith("@fst result "):
                result = json.loads(line[len("@fst result "):])
        proc.wait()
    finally:
        timer.cancel()
    try:
        if result is None or proc.returncode != 0:
            err.seek(0)
            return {"error": f"exit {proc.returncode}: {err.read()[-2000:]}"}
        with open(log.name, errors="replace") as fh:
            counts = trace.count(fh, tree) if traced else {}
        return {**result, "counts": counts, "resident": resident}
    finally:
        os.remove(log.name)
        err.close()


def records(run: dict[str, Any], payload: int, frames: float, tree: int, fs_tool: str,
            floors: dict[tuple[int, str], float] | None = None,
            loader: str | None = None) -> list[dict[str, Any]]:
    """One record per window of a launch (each configuration of workers has two), every figure
    per batch; ``floors``: :func:`page_floor` by (workers, window); ``loader``: the loader's
    name in the records (default: the launch's ``impl``)."""
    out = []
    resident = iter(run["resident"])  # one eviction before a window and every later pass
    for config in run["configs"]:
        for win in config["windows"]:
            n, label = win["batches"], win["window"].split("-", 1)[1]
            evictions = [next(resident, None) for _ in range(
                1 if label == "cold" else -(-n // run["pass_batches"]))]
            counts = run["counts"].get(win["window"])
            per = {k: (None if counts is None else counts.get(k, 0) / n)
                   for k in (*trace.COUNTED, "bytes_requested")}
            pages = (None if floors is None else
                     floors.get((config["workers"], label)))
            out.append({
                "kind": "fs_traffic", "impl": loader or run["impl"], "format": run["format"],
                "workers": config["workers"], "nofile": run["nofile"],
                "nofile_asked": run["nofile_asked"], "window": label, "batches": n,
                "pass_batches": run["pass_batches"], "frames_per_batch": frames,
                "payload_bytes_per_batch": payload * frames,
                "per_batch": {**per, "bytes_from_storage": win["io"]["read_bytes"] / n,
                              "bytes_of_pages_spanned": pages},
                "nofile_in_run": run.get("nofile_in_run"),
                "by_call": None if counts is None else counts["by_call"],
                "processes": win["io"]["processes"], "wall_s": win["wall_s"],
                "tree_bytes": tree,
                "resident_after_evict_bytes": max((e for e in evictions if e is not None),
                                                  default=None),
                "fs_tool": fs_tool, "loadavg_1min": round(os.getloadavg()[0], 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    root = ensure_water(args.nsys, base=args.data_base, nframes=args.nframes, cells=args.cells)
    formats = _list(args.formats)
    data = ensure_formats(root, tuple(formats))
    pythons = {impl: python_for(impl, args.deepmd_python) for impl in _list(args.impls)}
    impls = [i for i in ("mdloader", "deepmd") if pythons.get(i)]
    traced = not args.no_strace and strace_usable()
    fs_tool = (f"strace -f -y -e trace={trace.TRACED}" if traced else
               "none: strace not usable here; bytes from storage only")
    payload, frames = payload_per_frame(root), 1.0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t_start = time.monotonic()
    with open(args.out, "w") as fh, tempfile.TemporaryDirectory(prefix="mdl-fst-") as tmp:
        def write(rec: dict[str, Any]) -> None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()

        write({"kind": "meta", "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "cpus": os.cpu_count(), "nsys": args.nsys, "nframes": args.nframes,
               "natoms": 192 * args.cells ** 3,
               "formats": formats, "workers": args.workers, "nofile": args.nofile,
               "impls": impls + ([DIRECT] if args.direct and "mdloader" in impls else []),
               "skipped": [i for i in pythons if i not in impls],
               "warmup": args.warmup, "batches": args.batches,
               "pass_batches": args.pass_batches, "fs_tool": fs_tool,
               "payload_bytes_per_frame": payload, "batch_size": "auto"})
        for fmt in formats:
            tree = tree_bytes(tree_of(fmt, data[fmt]))
            for nofile in _list(args.nofile):
                draws = os.path.join(tmp, f"{fmt}-{nofile}")
                os.makedirs(draws)
                floors = None
                # mdloader first: DeePMD-kit replays its draws; mdloader with direct reads last,
                # drawing the same batches (the same seed) into a folder of its own
                launches = [(impl, impl) for impl in impls]
                if args.direct and "mdloader" in impls:
                    launches.append(("mdloader", DIRECT))
                for impl, label in launches:
                    direct = label == DIRECT
                    where_draws = draws + "-direct" if direct else draws
                    os.makedirs(where_draws, exist_ok=True)
                    run = launch(pythons[impl], impl, fmt, data[fmt], where_draws, nofile, args,
                                 traced, direct=direct)
                    where = f"{label:15s} {fmt:4s} ulimit -n {nofile:5s}"
                    if "error" in run:
                        write({"kind": "error", "impl": label, "format": fmt,
                               "nofile_asked": nofile, **run})
                        print(f"  {where} FAILED", flush=True)
                        break
                    frames = run["configs"][0]["frames_per_batch"] or frames
                    if impl == "mdloader":
                        floors = floors_of(fmt, data[fmt], where_draws, run, args)
                    for rec in records(run, payload, frames, tree, fs_tool, floors, label):
                        write(rec)
                    print(f"  {where} ok ({time.monotonic() - t_start:.0f} s)", flush=True)
    from benchmarks.fs_traffic import report

    print("\n".join(report.table(report.load(args.out)[1])))
    print(f"results: {os.path.relpath(args.out, REPO)}")
    if not args.no_report:
        report.main([args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
