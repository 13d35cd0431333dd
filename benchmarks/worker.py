"""The one rank worker: one rank of one benchmark launch, started by :mod:`benchmarks.launch`.

Two suites share one life cycle (collective probe, imports, ``init_process_group("gloo")``,
one JSON record per rank in ``<out>.rank<r>.json``, a last barrier):

* ``build`` (:mod:`benchmarks.throughput.run`, :mod:`benchmarks.startup.run`): the memory
  baseline after the imports; then discovery as the loader's entry point does it and
  ``DpLoaderSet(...)`` between two barriers, bracketed by strace markers; then (unless
  ``--build-only``) throughput through the outer DataLoader for each ``--num-workers`` value
  and the raw-read limit of the batches drawn with ``num_workers=0``;
* ``lmdb`` (:mod:`benchmarks.lmdb.run`): *ready*, from a barrier to the first batch out of the
  loader, with the frames each rank read to learn atom counts (``frame_nlocs`` missing) and the
  bytes it broadcast; then (unless ``--build-only``) batches/s for each ``--num-workers``
  (DataLoader workers for mdloader, decoder processes for DeePMD-kit), with the resident memory
  of the rank and of its worker processes at the end of each window.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks import probes


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    suites = p.add_subparsers(dest="suite", required=True)
    build = suites.add_parser("build", help="build + broadcast, then outer-DataLoader throughput")
    build.add_argument("--data", required=True, help="data set root (a directory of systems)")
    build.add_argument("--batch-size", default="auto")
    build.add_argument("--seed", type=int, default=1)
    build.add_argument("--seconds", type=float, default=3.0,
                       help="timed window per throughput run")
    build.add_argument("--max-batches", type=int, default=20000)
    build.add_argument("--rep", type=int, default=0, help="repetition label copied to the record")
    lmdb = suites.add_parser("lmdb", help="LMDB: ready time, then batches/s")
    lmdb.add_argument("--data", required=True, help="an LMDB database, or an npy root (mdloader)")
    lmdb.add_argument("--seconds", type=float, default=4.0)
    for suite in (build, lmdb):
        suite.add_argument("--impl", required=True, choices=("mdloader", "deepmd"))
        suite.add_argument("--out", required=True,
                           help="output prefix; <out>.rank<r>.json is written")
        suite.add_argument("--num-workers", default="0,2")
        suite.add_argument("--build-only", action="store_true")
    return p.parse_args(argv)


def _barrier(dist: Any) -> float:
    dist.barrier()
    return time.monotonic()


def build_phase(adapter: Any, args: argparse.Namespace, rank: int, dist: Any,
                coll: probes.CollectiveLog) -> tuple[Any, dict[str, Any]]:
    """Discovery + build + broadcast between two barriers, with memory before and after."""
    rss0 = probes.proc_status_kib("VmRSS")
    read0 = probes.read_bytes()
    peak_reset = probes.reset_peak_rss()
    probes.marker("build-begin", rank)
    t0 = _barrier(dist)
    systems = adapter.discover(args.data, rank)
    t_disc = time.monotonic()
    loader_set = adapter.build(systems, _batch_size(args.batch_size), args.seed, rank)
    t_built = time.monotonic()
    read1 = probes.read_bytes()
    t1 = _barrier(dist)
    probes.marker("build-end", rank)
    rec = {
        "t0": t0, "t_discovered": t_disc, "t_built": t_built, "t1": t1,
        "discovery_s": t_disc - t0, "constructor_s": t_built - t_disc, "total_s": t1 - t0,
        "rss_base_kib": rss0, "rss_after_kib": probes.proc_status_kib("VmRSS"),
        "peak_kib": probes.proc_status_kib("VmHWM"), "peak_reset": peak_reset,
        "read_bytes": read1 - read0 if read0 >= 0 and read1 >= 0 else None,
        "nsys": len(loader_set.systems),
        "nframes": _nframes(loader_set),
        **coll.summary(since=t0),
        "impl_report": dict(adapter.report),
    }
    rec["rss_growth_kib"] = rec["rss_after_kib"] - rss0
    rec["peak_growth_kib"] = rec["peak_kib"] - rss0
    return loader_set, rec


def _nframes(loader_set: Any) -> int:
    """Frames in the set-up's systems, without making a dataset object per system."""
    frames = getattr(loader_set, "nframes", None)
    if frames is not None and not callable(frames):
        return int(sum(frames))
    return int(sum(len(s) for s in loader_set.systems))


def _batch_size(text: str) -> Any:
    return int(text) if text.isdigit() else text


def throughput_phase(adapter: Any, loader_set: Any, args: argparse.Namespace,
                     dist: Any) -> dict[str, Any]:
    """Outer-DataLoader throughput per num_workers, then the raw-read limit."""
    from benchmarks.throughput import measure as tp

    adapter.add_requirements(loader_set)
    out: dict[str, Any] = {}
    drawn0: list[tuple[int, list[int]]] = []
    for nw in [int(x) for x in args.num_workers.split(",") if x != ""]:
        sampler = adapter.sampler(loader_set)
        _barrier(dist)
        res, drawn = tp.measure_loader(loader_set, sampler, nw, args.seconds, args.max_batches)
        out[f"nw{nw}"] = res
        if nw == 0 or not drawn0:
            drawn0 = drawn
    paths = [s.system for s in loader_set.systems]
    _barrier(dist)
    out["raw"] = tp.raw_read(paths, drawn0, min_seconds=min(args.seconds, 2.0))
    _barrier(dist)
    return out


def ready_phase(impl: Any, args: argparse.Namespace, rank: int, world: int, dist: Any,
                coll: probes.CollectiveLog) -> tuple[Any, dict[str, Any]]:
    """From a barrier to the first batch out of the loader: times, frames read for atom counts,
    bytes broadcast and memory."""
    rss0 = probes.proc_status_kib("VmRSS")
    scanned = impl.scanned()
    dist.barrier()
    t0 = time.monotonic()
    data = impl.build(args.data, rank, world)
    built = time.monotonic()
    first = next(impl.batches(data, 0))
    ready = time.monotonic()
    dist.barrier()
    return data, {"build_s": built - t0, "ready_s": ready - t0,
                  "frames_scanned": impl.scanned() - scanned, **coll.summary(since=t0),
                  "rss_base_mib": rss0 / 1024, "memory_ready_mib": probes.memory_mib(),
                  "first_batch_frames": int(first["coord"].shape[0])}


def lmdb_throughput_phase(impl: Any, data: Any, args: argparse.Namespace,
                          dist: Any) -> dict[str, Any]:
    """Batches/s per ``--num-workers`` value, with the memory of the rank and of its workers."""
    out = {}
    for workers in [int(x) for x in args.num_workers.split(",") if x]:
        dist.barrier()
        t_start = time.monotonic()
        it = impl.batches(data, workers)
        next(it)
        t0, cpu0 = time.monotonic(), time.process_time()
        nb = nf = 0
        while time.monotonic() - t0 < args.seconds:
            batch = next(it)
            nb, nf = nb + 1, nf + int(batch["coord"].shape[0])
        elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
        out[f"nw{workers}"] = {
            "first_batch_s": t0 - t_start, "batches": nb, "batches_per_s": nb / elapsed,
            "frames_per_s": nf / elapsed, "cpu_us_per_batch": 1e6 * cpu / max(nb, 1),
            "memory_mib": probes.memory_mib(),
            "workers_memory_mib": probes.children_memory_mib()}
        del it
    dist.barrier()
    return out


def build_suite(args: argparse.Namespace, coll: probes.CollectiveLog, dist: Any) -> dict[str, Any]:
    """The ``build`` suite's record (the loader imported before the process group)."""
    from benchmarks.impls import ADAPTERS

    t_start = time.monotonic()
    adapter = ADAPTERS[args.impl]()
    adapter.load()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _barrier(dist)
    rec: dict[str, Any] = {"kind": "timed", "impl": args.impl, "rep": args.rep,
                           "rank": rank, "world": world, "pid": os.getpid(),
                           "data": probes.shown(args.data), "batch_size": args.batch_size,
                           "import_s": time.monotonic() - t_start,
                           "loadavg_1min": os.getloadavg()[0]}
    loader_set, build = build_phase(adapter, args, rank, dist, coll)
    rec["build"] = build
    rec["nsys"] = build["nsys"]
    if not args.build_only:
        rec["throughput"] = throughput_phase(adapter, loader_set, args, dist)
    return rec


def lmdb_suite(args: argparse.Namespace, coll: probes.CollectiveLog, dist: Any) -> dict[str, Any]:
    """The ``lmdb`` suite's record."""
    from benchmarks.impls import LMDB_ADAPTERS

    impl = LMDB_ADAPTERS[args.impl]()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data, rec = ready_phase(impl, args, rank, world, dist, coll)
    rec.update({"impl": args.impl, "rank": rank, "world": world, "data": probes.shown(args.data),
                "loadavg_1min": os.getloadavg()[0]})
    if not args.build_only:
        rec["throughput"] = lmdb_throughput_phase(impl, data, args, dist)
    return rec


SUITES = {"build": build_suite, "lmdb": lmdb_suite}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    coll = probes.install_collective_probe()
    import torch.distributed as dist

    rec = SUITES[args.suite](args, coll, dist)
    with open(f"{args.out}.rank{rec['rank']}.json", "w") as fh:
        json.dump(rec, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
