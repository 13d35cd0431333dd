"""One traced interpreter of the file-system traffic benchmark (:mod:`benchmarks.fs_traffic.run`).

It draws training batches the way a trainer does, in three stretches: ``--warmup`` batches,
then two measured windows of ``--batches`` batches each, ``cold`` (the harness evicts the data
tree from the page cache once, before the window) and ``per-pass`` (evicted again before every
pass of ``--pass-batches`` batches: a data set larger than the page cache, whose pages are gone
by the time a loader comes back to them); then ``--tail`` batches more, unmeasured, so that the
workers' read-ahead at the end of the second window reads real draws.

Two loaders, on the same draws:

* ``mdloader``: a :class:`~mdloader.loading.feed.Feed` with one training stream
  (:data:`mdloader.train.job.LABELS`, ``batch_size: auto``, one rank), read inside
  :meth:`~mdloader.loading.feed.Feed.training_step`. It writes the draws it made (system name,
  frame ids) to ``--draws``;
* ``deepmd``: DeePMD-kit 3.2.0's own loader replaying those draws. On npy and HDF5 its
  ``DpLoaderSet`` of the same systems, in mdloader's order, under the trainer's outer
  ``DataLoader(batch_size=None, num_workers=K)``; each item sets the drawn system's inner
  DataLoader to the drawn frames and calls ``DpLoaderSet.__getitem__`` (DeePMD-kit's own frame
  read, ``DeepmdDataSetForLoader`` → ``DeepmdData.get_item_torch``; only the choice of the frames
  is replaced). On LMDB its ``LmdbDataset`` and ``LmdbBatchDataLoader`` with a sampler yielding
  the drawn frame keys.

The harness owns the page cache: before a window or pass this process writes ``@fst evict`` on
its standard output and waits for ``ok`` on its standard input, so the eviction's own opens are
made by the untraced harness. Around each window it emits the strace markers
``fst-<window>-begin``/``-end`` (:func:`benchmarks.probes.marker`) and reads ``/proc/<pid>/io``
of itself and of every process below it (DataLoader workers, decoders). Its record is the line
``@fst result <json>``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks import probes

SEED = 7
Draw = tuple[str, list[int]]  # (system name, frame ids)
IO_FIELDS = ("read_bytes",)


def set_nofile(limit: str) -> int:
    """Set the soft ``RLIMIT_NOFILE`` to ``limit`` (``high``: the hard limit); the limit set."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if limit == "high" else int(limit)
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


def ask(word: str) -> None:
    """Ask the harness to act (``evict``) and wait until it has."""
    print(f"@fst {word}", flush=True)
    answer = sys.stdin.readline().strip()
    if answer != "ok":
        raise RuntimeError(f"the harness answered {answer!r} to {word!r}")


def process_io(pid: int | str) -> dict[str, int]:
    """``/proc/<pid>/io`` fields of :data:`IO_FIELDS` (empty when the process is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/io") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name in IO_FIELDS:
                    out[name] = int(value)
    except OSError:
        pass
    return out


def tree_io() -> dict[int, dict[str, int]]:
    """:func:`process_io` of this process and of every process below it."""
    import psutil

    pids = [os.getpid()] + [c.pid for c in psutil.Process().children(recursive=True)]
    return {pid: io for pid in pids if (io := process_io(pid))}


def io_delta(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]]
             ) -> dict[str, int]:
    """What the processes alive at the end did since ``before`` (a process born in between
    counts from zero), summed; ``processes`` is how many were summed."""
    out = {name: 0 for name in IO_FIELDS}
    for pid, io in after.items():
        for name in IO_FIELDS:
            out[name] += io.get(name, 0) - before.get(pid, {}).get(name, 0)
    out["processes"] = len(after)
    return out


def window(name: str, draw: Callable[[], Any], batches: int, pass_batches: int,
           per_pass: bool) -> dict[str, Any]:
    """One measured window: evicted before it (and before every pass when ``per_pass``), its
    markers, and the I/O of the process tree over it."""
    ask("evict")
    before = tree_io()
    t0 = probes.marker(f"fst-{name}-begin", 0)
    for i in range(batches):
        if per_pass and i and i % pass_batches == 0:
            ask("evict")
        draw()
    t1 = probes.marker(f"fst-{name}-end", 0)
    return {"window": name, "batches": batches, "wall_s": round(t1 - t0, 3),
            "io": io_delta(before, tree_io())}


# -- mdloader ------------------------------------------------------------------------------------

def mdloader_source(address: str, workers: int
                    ) -> tuple[Callable[[], Draw], Callable[[], None], list[str]]:
    """The draw of one training batch from a one-stream feed, the feed's close, and the system
    addresses in the feed's order (what a batch's ``sid`` indexes)."""
    from mdloader.loading.build import Section
    from mdloader.loading.feed import Feed, StreamSpec
    from mdloader.sampling.loop import TrainingLoop
    from mdloader.sampling.spec import SamplingSpec
    from mdloader.train.job import LABELS
    from mdloader.world import World

    spec = StreamSpec(Section.of(None, "training", [address]), SamplingSpec(batch_size="auto"))
    feed = Feed.build([spec], seed=SEED, world=World(), labels=LABELS, num_workers=workers)
    feed.start(0, TrainingLoop(displays=False))
    stream = feed.stream(None, "training")
    systems = [s.system for s in stream.dataset.systems]
    names = [system_name(s) for s in systems]

    def draw() -> Draw:
        with feed.training_step():
            batch = next(stream)
        return names[int(batch["sid"])], [int(f) for f in batch["fid"]]

    return draw, feed.close, systems


def system_name(address: str) -> str:
    """The name both loaders know a system by: its folder or HDF5 group (``sys.12``), or an
    LMDB database's system address as mdloader writes it."""
    return address.rstrip("/").rsplit("/", 1)[-1] if "#system=" not in address else address


# -- DeePMD-kit ----------------------------------------------------------------------------------

def _identity(batch: Any) -> Any:
    return batch


class ReplayedSystems:
    """DeePMD-kit's ``DpLoaderSet`` read at given draws: item ``i`` points the drawn system's
    inner DataLoader at the drawn frames, then returns ``DpLoaderSet.__getitem__`` of it."""

    def __init__(self, loader_set: Any, draws: list[tuple[int, list[int]]]) -> None:
        self.loader_set, self.draws = loader_set, draws

    def __len__(self) -> int:
        return len(self.draws)

    def __getitem__(self, pos: int) -> Any:
        from deepmd.pt.utils.dataloader import collate_batch
        from torch.utils.data import DataLoader

        sid, fids = self.draws[pos]
        inner = DataLoader(self.loader_set.systems[sid], batch_sampler=[fids], num_workers=0,
                           collate_fn=collate_batch)
        self.loader_set.iters[sid] = iter(inner)
        return self.loader_set[sid]


class ReplayedKeys:
    """A sampler for DeePMD-kit's LMDB loader: the drawn frame keys, one batch each."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def deepmd_source(fmt: str, address: str, workers: int, draws: list[Draw],
                  systems: list[str]) -> tuple[Callable[[], Any], Callable[[], None]]:
    """The draw of one replayed batch from DeePMD-kit's loader, and its close."""
    import torch
    from deepmd.utils.data import DataRequirementItem

    from benchmarks.data import TYPE_MAP
    from benchmarks.impls import _requirements

    if fmt == "lmdb":
        from deepmd.pt.utils.lmdb_dataset import LmdbBatchDataLoader, LmdbDataset

        dataset = LmdbDataset(address, TYPE_MAP, "auto")
        dataset.add_data_requirement(_requirements(DataRequirementItem))
        loader = LmdbBatchDataLoader(dataset, ReplayedKeys([f for _n, f in draws]),
                                     pin_memory=False, num_workers=workers)
        it = iter(loader)
        return lambda: next(it), loader.close
    from deepmd.pt.utils.dataloader import DpLoaderSet
    from torch.utils.data import DataLoader

    loader_set = DpLoaderSet(systems, "auto", TYPE_MAP, seed=SEED)
    loader_set.add_data_requirement(_requirements(DataRequirementItem))
    index = {system_name(s): i for i, s in enumerate(systems)}
    replay = ReplayedSystems(loader_set, [(index[n], f) for n, f in draws])
    outer = DataLoader(replay, batch_size=None, num_workers=workers, drop_last=False,
                       collate_fn=_identity, pin_memory=False)
    with torch.device("cpu"):
        it = iter(outer)
    return lambda: next(it), lambda: None


# -- the run -------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl", required=True, choices=("mdloader", "deepmd"))
    p.add_argument("--format", required=True, choices=("npy", "hdf5", "lmdb"))
    p.add_argument("--address", required=True, help="npy root, HDF5 file or LMDB database")
    p.add_argument("--draws", required=True,
                   help="a folder for the draws (w<K>.json): mdloader writes, DeePMD-kit replays")
    p.add_argument("--workers", default="2,0",
                   help="DataLoader workers, one configuration after the other (2 first: with 0, "
                   "this process keeps maps of the files, which no eviction can drop)")
    p.add_argument("--nofile", default="1024", help="soft ulimit -n, or 'high' (the hard one)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batches", type=int, default=100, help="per measured window")
    p.add_argument("--pass-batches", type=int, default=25)
    p.add_argument("--tail", type=int, default=16)
    return p.parse_args(argv)


def measure(args: argparse.Namespace, workers: int) -> dict[str, Any]:
    """Warm-up, the two windows and the tail with ``workers`` DataLoader workers."""
    draws = os.path.join(args.draws, f"w{workers}.json")
    total = args.warmup + 2 * args.batches + args.tail
    if args.impl == "mdloader":
        source, close, systems = mdloader_source(args.address, workers)
        drawn: list[Draw] = []

        def draw() -> None:
            drawn.append(source())
    else:
        with open(draws) as fh:
            saved = json.load(fh)
        if len(saved["draws"]) < total:
            raise RuntimeError(f"{draws} holds {len(saved['draws'])} draws, {total} needed")
        source, close = deepmd_source(args.format, args.address, workers,
                                      [(n, f) for n, f in saved["draws"]], saved["systems"])
        draw = source  # type: ignore[assignment]
    probes.marker(f"fst-w{workers}-start-begin", 0)  # opens before it are the build's
    for _ in range(args.warmup):
        draw()
    windows = [window(f"w{workers}-cold", draw, args.batches, args.pass_batches, False),
               window(f"w{workers}-per-pass", draw, args.batches, args.pass_batches, True)]
    for _ in range(args.tail):
        draw()
    close()
    frames = None
    if args.impl == "mdloader":
        with open(draws, "w") as fh:
            json.dump({"systems": systems, "draws": drawn}, fh)
        frames = sum(len(f) for _n, f in drawn) / len(drawn)
    return {"workers": workers, "frames_per_batch": frames, "windows": windows}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    nofile = set_nofile(args.nofile)  # before any import opens a file
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    configs = [measure(args, int(w)) for w in args.workers.split(",") if w]
    print("@fst result " + json.dumps({
        "impl": args.impl, "format": args.format, "nofile": nofile, "nofile_asked": args.nofile,
        "nofile_in_run": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "warmup": args.warmup, "pass_batches": args.pass_batches, "configs": configs,
        "run_s": round(time.monotonic() - t0, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
