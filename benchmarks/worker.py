"""One rank of one benchmark run, launched by ``torchrun`` (see :mod:`benchmarks.run`).

Phases, each fenced by barriers so that every rank measures the same window:

1. imports and ``init_process_group("gloo")``, then the memory baseline (the peak counter is reset);
2. build: discovery as the loader's entry point does it, then ``DpLoaderSet(...)``; strace
   markers bracket this phase;
3. (unless ``--build-only``) throughput through the outer DataLoader for each ``--num-workers``
   value, then the raw-read limit of the batches drawn with ``num_workers=0``.

Each rank writes one JSON object to ``<out>.rank<r>.json``.
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
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--impl", required=True, choices=("mdloader", "deepmd"))
    p.add_argument("--data", required=True, help="dataset root (a directory of systems)")
    p.add_argument("--out", required=True, help="output prefix; <out>.rank<r>.json is written")
    p.add_argument("--batch-size", default="auto")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--num-workers", default="0,2")
    p.add_argument("--seconds", type=float, default=3.0, help="timed window per throughput run")
    p.add_argument("--max-batches", type=int, default=20000)
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--rep", type=int, default=0, help="repetition label copied to the record")
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
    from benchmarks import throughput as tp

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


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t_start = time.monotonic()
    coll = probes.install_collective_probe()
    import torch.distributed as dist

    from benchmarks.impls import ADAPTERS

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
    with open(f"{args.out}.rank{rank}.json", "w") as fh:
        json.dump(rec, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
