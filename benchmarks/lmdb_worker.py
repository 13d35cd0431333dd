"""One rank of the LMDB benchmark, launched by ``torchrun`` (see :mod:`benchmarks.lmdb`).

``--impl`` is ``mdloader`` (an LMDB database or an npy root, through ``DpLoaderSet`` and the
weighted sampler, as ``mdloader dp`` trains) or ``deepmd`` (DeePMD-kit 3.2.0's LMDB path as its
trainer builds it: ``LmdbDataset``, ``DistributedLmdbBatchSampler``, ``LmdbBatchDataLoader``).

1. imports and ``init_process_group("gloo")``, then the memory baseline;
2. *ready*: from a barrier to the first batch out of the loader, with the frames each rank read
   to learn atom counts (``frame_nlocs`` missing) and the bytes it broadcast;
3. (unless ``--build-only``) batches/s for each ``--num-workers`` (DataLoader workers for
   mdloader, decoder processes for DeePMD-kit), with the resident memory of the rank and of its
   worker processes at the end of each window.

Each rank writes one JSON object to ``<out>.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from benchmarks import probes

TYPE_MAP = ["O", "H"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--impl", required=True, choices=("mdloader", "deepmd"))
    p.add_argument("--data", required=True, help="an LMDB database, or an npy root (mdloader)")
    p.add_argument("--out", required=True)
    p.add_argument("--num-workers", default="0,2")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--build-only", action="store_true")
    return p.parse_args(argv)


class Mdloader:
    """mdloader's loader as ``mdloader dp --pt train`` builds it."""

    def __init__(self) -> None:
        import mdloader.loading.loader as loader
        from mdloader.data.formats.lmdb import metadata as lmdb_metadata
        from mdloader.data.schema import DataRequirementItem

        self.loader, self.item, self.meta = loader, DataRequirementItem, lmdb_metadata

    def scanned(self) -> int:
        return self.meta.scanned_frames()

    def build(self, path: str, rank: int, world: int) -> Any:
        ls = self.loader.DpLoaderSet(path, "auto", TYPE_MAP, seed=1)
        ls.add_data_requirement(_requirements(self.item))
        return ls

    def batches(self, ls: Any, workers: int) -> Iterator[Any]:
        from torch.utils.data import DataLoader

        sampler = self.loader.get_sampler_from_params(ls, {"auto_prob": "prob_sys_size"})
        dl = DataLoader(ls, sampler=sampler, batch_size=None, num_workers=workers,
                        collate_fn=_identity)
        while True:
            yield from dl


class Deepmd:
    """DeePMD-kit 3.2.0's LMDB path as ``training.py`` builds it (``seed`` = training seed)."""

    def __init__(self) -> None:
        import deepmd.dpmodel.utils.lmdb_data as lmdb_data
        from deepmd.pt.utils.lmdb_dataset import LmdbBatchDataLoader, LmdbDataset
        from deepmd.utils.data import DataRequirementItem

        self.lmdb_data, self.item = lmdb_data, DataRequirementItem
        self.dataset_cls, self.loader_cls = LmdbDataset, LmdbBatchDataLoader
        self.frames_scanned = 0
        scan = lmdb_data._scan_frame_nlocs

        def counted(env: Any, nframes: int, *args: Any) -> Any:
            self.frames_scanned += nframes
            return scan(env, nframes, *args)

        lmdb_data._scan_frame_nlocs = counted

    def scanned(self) -> int:
        return self.frames_scanned

    def build(self, path: str, rank: int, world: int) -> Any:
        ds = self.dataset_cls(path, TYPE_MAP, "auto")
        ds.add_data_requirement(_requirements(self.item))
        ds.rank_world = (rank, world)
        return ds

    def batches(self, ds: Any, workers: int) -> Iterator[Any]:
        rank, world = ds.rank_world
        sampler = self.lmdb_data.DistributedLmdbBatchSampler(
            ds._reader, rank=rank, world_size=world, shuffle=True, seed=1)
        dl = self.loader_cls(ds, sampler, pin_memory=False, num_workers=workers)
        while True:
            yield from dl


def _identity(batch: Any) -> Any:
    return batch


def _requirements(item: Any) -> list[Any]:
    return [item("energy", ndof=1, atomic=False, must=False, high_prec=True),
            item("force", ndof=3, atomic=True, must=False, high_prec=False)]


def _memory_mib(pid: int | str = "self") -> dict[str, float]:
    """RSS of a process, split into anonymous memory (its own) and file pages (the database's
    and the libraries' pages it maps: shared with every process mapping them)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                name = line.split(":")[0]
                if name in ("VmRSS", "RssAnon", "RssFile"):
                    out[name] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def _children_memory_mib() -> list[dict[str, float]]:
    import psutil

    return [_memory_mib(child.pid) for child in psutil.Process().children(recursive=True)]


def ready_phase(impl: Any, args: argparse.Namespace, rank: int, world: int, dist: Any,
                coll: probes.CollectiveLog) -> tuple[Any, dict[str, Any]]:
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
                  "rss_base_mib": rss0 / 1024, "memory_ready_mib": _memory_mib(),
                  "first_batch_frames": int(first["coord"].shape[0])}


def throughput_phase(impl: Any, data: Any, args: argparse.Namespace, dist: Any) -> dict[str, Any]:
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
            "memory_mib": _memory_mib(),
            "workers_memory_mib": _children_memory_mib()}
        del it
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    coll = probes.install_collective_probe()
    import torch.distributed as dist

    impl = Mdloader() if args.impl == "mdloader" else Deepmd()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data, rec = ready_phase(impl, args, rank, world, dist, coll)
    rec.update({"impl": args.impl, "rank": rank, "world": world, "data": probes.shown(args.data),
                "loadavg_1min": os.getloadavg()[0]})
    if not args.build_only:
        rec["throughput"] = throughput_phase(impl, data, args, dist)
    with open(f"{args.out}.rank{rank}.json", "w") as fh:
        json.dump(rec, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
