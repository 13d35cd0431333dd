"""Memory held by each DataLoader worker: mdloader's ``DpLoaderSet`` against DeePMD-kit's.

The outer loader is made as DeePMD-kit's trainer makes it (``DataLoader(loader_set,
sampler=..., batch_size=None, num_workers=K)``); after ``--batches`` batches, while the workers
are alive, it reads ``/proc/<pid>/smaps_rollup`` of the main process and of every worker (RSS,
PSS, USS = private clean + private dirty) and, from inside each worker, how many modules it has
imported. Run it once per implementation, each in the interpreter that has it (DeePMD-kit's in
its own virtual environment); ``--data`` reuses generated systems so both read the same files.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any


def smaps_kib(pid: int) -> dict[str, int]:
    """RSS, PSS, USS (private clean + dirty), private dirty and anonymous KiB of ``pid``."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return {"rss": fields.get("Rss", 0), "pss": fields.get("Pss", 0),
            "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
            "private_dirty": fields.get("Private_Dirty", 0),
            "anonymous": fields.get("Anonymous", 0)}


def private_by_mapping(pid: int, top: int = 12) -> dict[str, int]:
    """Private KiB (clean + dirty) of ``pid`` per mapping name (``/proc/<pid>/smaps``): the
    heap, anonymous maps (numpy's and torch's large allocations, thread stacks), each library
    and file; the ``top`` largest, the rest summed as ``other``."""
    sizes: dict[str, int] = {}
    name = ""
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                name = os.path.basename(parts[5]) if len(parts) > 5 else "[anonymous]"
            elif parts and parts[0] in ("Private_Clean:", "Private_Dirty:"):
                sizes[name] = sizes.get(name, 0) + int(parts[1])
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    out = dict(ranked[:top])
    out["other"] = sum(v for _, v in ranked[top:])
    return out


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (the DataLoader's workers), from ``/proc``."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as fh:
            out += [int(p) for p in fh.read().split()]
    return sorted(out)


def make_data(root: str, nsystems: int, nframes: int) -> list[str]:
    """``nsystems`` npy systems of 3 to 40 atoms under ``root`` (kept if already there)."""
    from mdloader.testing import make_system

    paths = []
    for i in range(nsystems):
        path = os.path.join(root, f"sys{i:05d}")
        if not os.path.isdir(path):
            make_system(root, f"sys{i:05d}", natoms=3 + i % 38, nframes=nframes, seed=i)
        paths.append(path)
    return paths


class ModuleCount:
    """Worker ``__getitem__`` wrapper that notes the worker's ``len(sys.modules)``; with
    ``trace_after``, it also traces the worker's allocations from its first batch on
    (:mod:`tracemalloc`) and, at its ``trace_after``-th batch, writes where the memory still
    allocated was allocated (the largest sites, by file and line)."""

    def __init__(self, inner: Any, out_dir: str, trace_after: int = 0) -> None:
        self.inner, self.out_dir, self.trace_after = inner, out_dir, trace_after
        self.calls = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, idx: Any) -> Any:
        with open(os.path.join(self.out_dir, f"modules.{os.getpid()}"), "w") as fh:
            fh.write(str(len(sys.modules)))
        if self.trace_after:
            import tracemalloc

            if self.calls == 0:
                tracemalloc.start()
            self.calls += 1
            if self.calls == self.trace_after:
                stats = tracemalloc.take_snapshot().statistics("lineno")
                with open(os.path.join(self.out_dir, f"trace.{os.getpid()}"), "w") as fh:
                    json.dump({"total_kib": sum(s.size for s in stats) // 1024,
                               "top": [[str(s.traceback), s.size // 1024, s.count]
                                       for s in stats[:25]]}, fh)
        return self.inner[idx]


class FullCollections:
    """Counts the full (generation 2) collections of this process's garbage collector while
    entered: each one writes the header of every object it visits, so after a fork it turns
    the parent's pages shared with the workers into private copies on both sides."""

    def __init__(self) -> None:
        self.count = 0

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info.get("generation") == 2:
            self.count += 1

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)


def loader_set(impl: str, paths: list[str]) -> tuple[Any, Any]:
    """The implementation's ``DpLoaderSet`` and its training sampler."""
    if impl == "mdloader":
        from mdloader.loading.loader import DpLoaderSet, get_sampler_from_params
    else:
        from deepmd.pt.utils.dataloader import DpLoaderSet, get_sampler_from_params
    ls = DpLoaderSet(paths, 1, ["O", "H"], seed=1, shuffle=True)
    return ls, get_sampler_from_params(ls, {"sys_probs": None, "auto_prob": "prob_sys_size"})


def measure(impl: str, paths: list[str], workers: int, batches: int, out_dir: str,
            trace: bool = False) -> dict:
    """Draw ``batches`` batches with ``workers`` workers, then read every process's memory."""
    from torch.utils.data import DataLoader

    ls, sampler = loader_set(impl, paths)
    main_before = smaps_kib(os.getpid())
    trace_after = max(1, batches // (2 * max(1, workers))) if trace else 0
    dl = DataLoader(ModuleCount(ls, out_dir, trace_after), sampler=sampler, batch_size=None,
                    num_workers=workers, collate_fn=lambda b: b)
    with FullCollections() as full:
        it = iter(dl)
        for _ in range(batches):
            next(it)
    pids = child_pids(os.getpid())
    per_worker = {str(p): smaps_kib(p) for p in pids}
    by_mapping = {str(p): private_by_mapping(p) for p in pids}
    modules, traces = {}, {}
    for p in pids:
        name = os.path.join(out_dir, f"modules.{p}")
        if os.path.exists(name):
            with open(name) as fh:
                modules[str(p)] = int(fh.read())
        name = os.path.join(out_dir, f"trace.{p}")
        if os.path.exists(name):
            with open(name) as fh:
                traces[str(p)] = json.load(fh)
    rec = {"impl": impl, "systems": len(paths), "workers": workers, "batches": batches,
           "main_before_workers_kib": main_before, "main_kib": smaps_kib(os.getpid()),
           "workers_kib": per_worker, "workers_private_by_mapping_kib": by_mapping,
           "worker_modules": modules,
           "main_full_collections": full.count, "worker_allocations": traces,
           "main_modules": len(sys.modules)}
    del it
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("mdloader", "deepmd"), default="mdloader")
    ap.add_argument("--data", required=True, help="folder of the generated systems")
    ap.add_argument("--systems", type=int, default=200)
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--trace", action="store_true",
                    help="trace each worker's allocations (tracemalloc; adds its own memory)")
    ap.add_argument("--out", default=None, help="JSON file for the record")
    args = ap.parse_args(argv)
    os.makedirs(args.data, exist_ok=True)
    paths = sorted(os.path.join(args.data, d) for d in os.listdir(args.data)
                   if d.startswith("sys"))[:args.systems]
    if len(paths) < args.systems:
        paths = make_data(args.data, args.systems, args.frames)
    scratch = os.path.join(args.data, ".modules")
    os.makedirs(scratch, exist_ok=True)
    rec = measure(args.impl, paths, args.workers, args.batches, scratch, args.trace)
    text = json.dumps(rec, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
