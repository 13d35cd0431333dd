"""Node-local staging (``MDLOADER_STAGE_DIR``) measured: copy speed against ``cp -r``, bytes and
calls on the shared tree over several passes, and the time to the first batch.

One command::

    python -m benchmarks.staging.run                       # 200 water systems (~2 min)
    python -m benchmarks.staging.run --nsys 2000 --out RESULTS/staging/n2000.jsonl

(``RESULTS``: ``benchmarks/results``.) The data: ``--nsys`` water systems of 192 atoms
(:func:`benchmarks.data.ensure_water`), also as one HDF5 file and one LMDB database
(:func:`benchmarks.data.ensure_formats`). For each format:

* ``copy``: the seconds ``cp -r`` and the stager (:func:`mdloader.catalog.staging.stage`) take to
  copy the same sources into an empty folder of ``--dest`` (default ``/dev/shm``), the tree
  warm in the page cache and evicted (``posix_fadvise DONTNEED``), ``--repeats`` times each
  (median); ``speed_ratio`` is cp's seconds over the stager's (the goal: at least 0.8);
* ``shared``: one process builds the systems with staging on, then reads every frame
  ``--passes`` times with 2 npy files kept open (``MDLOADER_MAX_OPEN_FILES=2``), under
  ``strace -f -y``: the bytes its calls read from files under the shared tree, per pass and
  over the job, against the bytes of the tree (the goal: at most 1.05x), and the opens and path
  lookups under the tree after staging (the goal: none); ``read_bytes`` of ``/proc/self/io``
  with the tree evicted first says the same from the storage side;
* ``first_batch``: seconds from the start of the build to the first batch, without staging, with
  a cold stage folder, and with fresh copies (a restart).

Records go to a JSON-lines file; the table for ``docs/benchmarks.md`` is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import REPO, RESULTS
from benchmarks.data import ensure_formats, ensure_water
from benchmarks.startup.evict import evict, warm

DEFAULT_OUT = os.path.join(RESULTS, "staging", "staging.jsonl")
CALLS = "openat,stat,lstat,newfstatat,statx,read,pread64,copy_file_range,sendfile"
MARKER = "/mdloader-staging-bench-marker"

CHILD = r"""
import json, os, sys, time
start = time.monotonic()
from mdloader.loading.build import build_systems
address, passes = sys.argv[1], int(sys.argv[2])
datasets = build_systems([address], None, progress=False)
built = time.monotonic()
first = datasets[0][0]
first_at = time.monotonic()
try:
    os.stat(sys.argv[3])  # the marker in the trace: staging is over
except OSError:
    pass
frames = 0
for _ in range(passes):
    for d in datasets:
        for i in range(len(d)):
            d[i]
            frames += 1
with open("/proc/self/io") as fh:
    io = dict(line.split(": ") for line in fh.read().splitlines())
print(json.dumps({"build_seconds": built - start, "first_batch_seconds": first_at - start,
                  "frames": frames, "read_bytes": int(io["read_bytes"])}))
"""


def tree_bytes(path: str) -> int:
    """Bytes of the files of ``path`` (a file or a folder)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(b, n)) for b, _, names in os.walk(path)
               for n in names)


def source_of(address: str) -> str:
    """What the stager copies for the ``systems`` entry ``address``: the file or folder."""
    return address.partition("#")[0]


def _timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def copy_speed(source: str, sources: list[str], cache: str, repeats: int,
               threads: int, dest: str | None) -> dict[str, Any]:
    """Median seconds of ``cp -r`` and of the stager on the same sources, ``cache`` warm/cold."""
    from mdloader.catalog.staging import stage

    times: dict[str, list[float]] = {"cp": [], "stage": []}
    for _ in range(repeats):
        for tool in ("cp", "stage"):
            target = tempfile.mkdtemp(prefix="mdl-stage-bench-", dir=dest)
            (evict if cache == "cold" else warm)(source)
            if tool == "cp":
                times[tool].append(_timed(lambda t=target: subprocess.run(
                    ["cp", "-r", *sources, t], check=True)))
            else:
                times[tool].append(_timed(lambda t=target: stage(sources, t, threads=threads)))
            shutil.rmtree(target)
    cp_s, st_s = statistics.median(times["cp"]), statistics.median(times["stage"])
    return {"cp_seconds": cp_s, "stage_seconds": st_s, "speed_ratio": cp_s / st_s,
            "threads": threads}


_FD = re.compile(r'^\d+\s+(\w+)\((\d+)<([^>]*)>(?:, (?:NULL|\[[^\]]*\]|\d+), (\d+)<([^>]*)>)?'
                 r'.*\)\s+=\s+(-?\d+)')
_SENDFILE = re.compile(r'^\d+\s+sendfile\(\d+<[^>]*>, \d+<([^>]*)>.*\)\s+=\s+(-?\d+)')
_RESUMED = re.compile(r'^(\d+)\s+<\.\.\. (\w+) resumed>.*\)\s+=\s+(-?\d+)')
_PATH = re.compile(r'^\d+\s+(\w+)\((?:AT_FDCWD(?:<[^>]*>)?, )?"([^"]*)"')


def parse_trace(path: str, root: str) -> dict[str, Any]:
    """Bytes read from files under ``root``, and opens/lookups under it before and after the
    marker, from an ``strace -f -y`` file."""
    prefix = root.rstrip("/") + "/"

    def under(name: str) -> bool:
        return name == root or name.startswith(prefix)

    out = {"bytes": 0, "opens_before": 0, "lookups_before": 0, "opens_after": 0,
           "lookups_after": 0}
    after = False
    pending: dict[tuple[str, str], str] = {}
    with open(path) as fh:
        for line in fh:
            named = _PATH.match(line)
            if named is not None:
                call, name = named.groups()
                if name == MARKER:
                    after = True
                    continue
                if under(name):
                    key = "opens" if call == "openat" else "lookups"
                    out[f"{key}_{'after' if after else 'before'}"] += 1
                continue
            pid = line.split(None, 1)[0]
            resumed = _RESUMED.match(line)
            if resumed is not None:  # a call another thread interrupted: its start said the file
                source = pending.pop((pid, resumed.group(2)), None)
                if source and under(source) and int(resumed.group(3)) > 0:
                    out["bytes"] += int(resumed.group(3))
                continue
            sent = _SENDFILE.match(line)
            if sent is not None:
                if under(sent.group(1)) and int(sent.group(2)) > 0:
                    out["bytes"] += int(sent.group(2))
                continue
            if " sendfile(" in line and line.rstrip().endswith("<unfinished ...>"):
                both = re.findall(r"\d+<([^>]*)>", line)
                pending[(pid, "sendfile")] = both[1] if len(both) > 1 else ""
                continue
            fd = _FD.match(line.replace(" <unfinished ...>", ") = 0"))
            if fd is None or fd.group(1) not in ("read", "pread64", "copy_file_range",
                                                 "sendfile"):
                continue
            call, _, first, _, second, result = fd.groups()
            source = second if call == "sendfile" else first
            if line.rstrip().endswith("<unfinished ...>"):
                pending[(pid, call)] = source
            elif source and under(source) and int(result) > 0:
                out["bytes"] += int(result)
    return out


def shared_reads(address: str, passes: int, stage_dir: str | None,
                 strace: bool) -> dict[str, Any]:
    """The child job (build, first batch, ``passes`` passes), under strace when asked."""
    root = source_of(address)
    env = dict(os.environ, PYTHONPATH=REPO, MDLOADER_INDEX="off", MDLOADER_MAX_OPEN_FILES="2",
               OMP_NUM_THREADS="1")
    env.pop("MDLOADER_STAGE_DIR", None)
    if stage_dir is not None:
        env["MDLOADER_STAGE_DIR"] = stage_dir
    cmd = [sys.executable, "-c", CHILD, address, str(passes), MARKER]
    trace = tempfile.mktemp(prefix="mdl-stage-trace-")
    if strace:
        cmd = ["strace", "-f", "-qq", "-y", "-e", f"trace={CALLS}", "-o", trace, *cmd]
    evict(root)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    record = json.loads(done.stdout.strip().splitlines()[-1])
    if strace:
        record.update(parse_trace(trace, root))
        os.unlink(trace)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nsys", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--formats", default="npy,hdf5,lmdb")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--dest", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where the copies go (the node-local folder; default /dev/shm)")
    args = parser.parse_args(argv)
    strace = shutil.which("strace") is not None
    npy_root = ensure_water(args.nsys)
    addresses = ensure_formats(npy_root, tuple(args.formats.split(",")))
    records: list[dict[str, Any]] = [{
        "kind": "meta", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
        "nsys": args.nsys, "repeats": args.repeats, "passes": args.passes,
        "threads": args.threads, "dest": args.dest,
        "fs_tool": f"strace -f -y -e trace={CALLS}" if strace else None}]
    for fmt, address in addresses.items():
        if fmt == "npy":
            sources = [os.path.join(address, n) for n in sorted(os.listdir(address))
                       if os.path.isdir(os.path.join(address, n))]
        else:
            sources = [source_of(address)]
        nbytes = sum(tree_bytes(s) for s in sources)
        for cache in ("warm", "cold"):
            rec = {"kind": "copy", "format": fmt, "cache": cache, "bytes": nbytes,
                   "files": sum(1 if os.path.isfile(s) else sum(len(n) for _, _, n in
                                                               os.walk(s)) for s in sources),
                   **copy_speed(source_of(address), sources, cache, args.repeats,
                                args.threads, args.dest)}
            records.append(rec)
            print(json.dumps(rec), flush=True)
        timed: dict[str, float] = {}
        for traced in (False, True) if strace else (False,):
            stage_dir = tempfile.mkdtemp(prefix="mdl-stage-bench-", dir=args.dest)
            try:
                if not traced:  # the times, without strace's slowing down
                    timed["plain"] = shared_reads(address, 1, None, False)["first_batch_seconds"]
                cold = shared_reads(address, args.passes, stage_dir, traced)
                fresh = shared_reads(address, args.passes, stage_dir, traced)
            finally:
                shutil.rmtree(stage_dir)
            if not traced:
                timed["cold"] = cold["first_batch_seconds"]
                timed["fresh"] = fresh["first_batch_seconds"]
        for label, rec in (("cold stage folder", cold), ("fresh copies (a restart)", fresh)):
            out = {"kind": "shared", "format": fmt, "run": label, "tree_bytes": nbytes,
                   "passes": args.passes, **{k: v for k, v in rec.items() if "seconds" not in k}}
            if "bytes" in rec:
                out["bytes_over_tree"] = rec["bytes"] / nbytes
            records.append(out)
            print(json.dumps(out), flush=True)
        rec = {"kind": "first_batch", "format": fmt, "plain": timed["plain"],
               "cold_stage": timed["cold"], "fresh_stage": timed["fresh"]}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    print("\n".join(table(records)))
    return 0


def table(records: list[dict[str, Any]]) -> list[str]:
    """The Markdown table of a run's records."""
    lines = ["| format | copy: cp -r / stager speed, warm | cold | shared-tree bytes / tree "
             "bytes, 1st job | restart | opens, lookups under the tree after staging | "
             "first batch s: no staging | cold stage | fresh copies |",
             "|---|---|---|---|---|---|---|---|---|"]
    formats = list(dict.fromkeys(r["format"] for r in records if "format" in r))
    for fmt in formats:
        mine = [r for r in records if r.get("format") == fmt]
        copy = {r["cache"]: r for r in mine if r["kind"] == "copy"}
        shared = {r["run"].split()[0]: r for r in mine if r["kind"] == "shared"}
        first = next(r for r in mine if r["kind"] == "first_batch")

        def ratio(run: str, shared: dict[str, Any] = shared) -> str:
            r = shared.get(run, {})
            return f"{r['bytes_over_tree']:.3f}" if "bytes_over_tree" in r else "n/a"

        after = [(shared[k].get("opens_after"), shared[k].get("lookups_after")) for k in shared]
        lines.append(
            f"| {fmt} | {copy['warm']['speed_ratio']:.2f} | {copy['cold']['speed_ratio']:.2f} | "
            f"{ratio('cold')} | {ratio('fresh')} | "
            f"{', '.join(f'{o}, {lk}' for o, lk in after)} | {first['plain']:.2f} | "
            f"{first['cold_stage']:.2f} | {first['fresh_stage']:.2f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
