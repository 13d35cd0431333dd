"""One interpreter's windows of the main-process cost benchmark (:mod:`benchmarks.main_cost.run`).

A *window* draws batches the way a trainer does and times, per batch, the trainer thread's CPU
inside the ``next()`` call (``time.thread_time()``: what the loader costs the thread that
trains) and the wall clock over the window (batches per second). Three loaders:

* ``mdloader``: a :class:`~mdloader.loading.feed.Feed` with one training stream, read as
  ``mdloader train`` reads it (``next(stream)`` inside :meth:`Feed.training_step`) and as
  ``mdloader dp`` does (``next(feed.draws(None))``, the stream checked by
  :class:`~mdloader.integrations.deepmd.stopping.NonFiniteBatches`); and, on npy data, the
  plain-numpy reference (:func:`benchmarks.throughput.measure.raw_read`: the same frames read
  with plain numpy in this process);
* ``deepmd``: DeePMD-kit 3.2.0's own loader as its trainer makes it (``training.py``): a
  ``DpLoaderSet`` under a ``DataLoader(batch_size=None, num_workers=K)`` cycled in a generator;
  on LMDB its ``LmdbDataset`` and ``LmdbBatchDataLoader``.

Every window starts its loader afresh (workers forked, ``warmup`` batches drawn untimed), so
repetitions see independent starts. The interpreter prints its records as one JSON object on its
last output line (:func:`benchmarks.launch.last_json`).

Usage: ``python -m benchmarks.main_cost.measure --impl mdloader --data 192:npy=ROOT --data
192:hdf5=FILE --workers 0,2`` (``ATOMS:FORMAT=ADDRESS``: the label the records carry).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

SEED = 7
#: The stall report's period (``disp_freq``) in the windows: a report every step would charge
#: every step with a report's cost (0.3 ms here), which no trainer pays.
DISP_FREQ = 100
PATHS = ("train", "dp")


def window(draw: Callable[[], Any], step: Callable[[], Any] = contextlib.nullcontext, *,
           warmup: int, seconds: float, max_batches: int) -> dict[str, float]:
    """Draw ``warmup`` batches, then batches for ``seconds`` (at most ``max_batches``), each
    inside ``step()``; the trainer thread's CPU inside ``draw`` and in the whole loop, the
    process's CPU (all its threads) and the wall clock, per batch."""
    for _ in range(warmup):
        with step():
            draw()
    count, inside = 0, 0.0
    t0, loop0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
    while True:
        with step():
            c0 = time.thread_time()
            draw()
            inside += time.thread_time() - c0
        count += 1
        if count >= max_batches or time.perf_counter() - t0 >= seconds:
            break
    wall = time.perf_counter() - t0
    loop, proc = time.thread_time() - loop0, time.process_time() - proc0
    return {"batches": count, "wall_s": wall, "batches_per_s": count / wall,
            "cpu_us_per_batch": 1e6 * inside / count, "step_cpu_us_per_batch": 1e6 * loop / count,
            "process_cpu_us_per_batch": 1e6 * proc / count}


# -- mdloader --------------------------------------------------------------------------------------

def mdloader_feed(address: str, workers: int, batch_size: Any = "auto") -> Any:
    """A feed of one training stream over the systems at ``address``, as both trainers build
    theirs (:data:`mdloader.train.job.LABELS`, one rank)."""
    from mdloader.loading.build import Section
    from mdloader.loading.feed import Feed, StreamSpec
    from mdloader.sampling.spec import SamplingSpec
    from mdloader.train.job import LABELS
    from mdloader.world import World

    spec = StreamSpec(Section.of(None, "training", [address]), SamplingSpec(batch_size=batch_size))
    return Feed.build([spec], seed=SEED, world=World(), labels=LABELS, num_workers=workers)


@contextlib.contextmanager
def mdloader_source(feed: Any, path: str) -> Iterator[Callable[[], Any]]:
    """Within, the draw of one batch as ``mdloader train`` (``path="train"``) or ``mdloader
    dp`` (``"dp"``) draws it, the feed started afresh."""
    from mdloader.integrations.deepmd.stopping import NonFiniteBatches
    from mdloader.sampling.loop import TrainingLoop

    feed.start(feed.step, TrainingLoop(displays=False, disp_freq=DISP_FREQ))
    try:
        stream = feed.stream(None, "training")
        stream.check = NonFiniteBatches(feed) if path == "dp" else None
        source = feed.draws(None) if path == "dp" else stream
        yield lambda: next(source)
    finally:
        feed.close()


Data = dict[tuple[int, str], str]
"""(atoms, format) -> the address of the data set."""


def mdloader_windows(data: Data, workers: list[int], **kw: Any) -> list[dict[str, Any]]:
    """A window per data set, workers count and path (the two paths alternate), and the
    plain-numpy reference on the frames each npy stream drew."""
    records = []
    for (natoms, fmt), address in data.items():
        for nw in workers:
            feed = mdloader_feed(address, nw)
            for path in PATHS:
                with mdloader_source(feed, path) as draw:
                    res = window(draw, feed.training_step, **kw)
                records.append({"impl": "mdloader", "path": path, "natoms": natoms,
                                "format": fmt, "workers": nw, **res})
        if fmt == "npy":
            records.append({"impl": "numpy", "path": "reference", "natoms": natoms,
                            "format": "npy", "workers": 0,
                            **numpy_reference(address, kw["seconds"])})
    return records


def numpy_reference(root: str, seconds: float, batches: int = 200) -> dict[str, float]:
    """The frames of ``batches`` batches of the npy stream read again with plain numpy in this
    process, for ``seconds``: batches per second and this thread's CPU per batch."""
    from benchmarks.throughput.measure import raw_read

    feed = mdloader_feed(root, 0)
    with mdloader_source(feed, "train") as draw:
        drawn = []
        for _ in range(batches):
            batch = draw()
            drawn.append((int(batch["sid"]), [int(f) for f in batch["fid"]]))
    paths = [s.system for s in feed.stream(None, "training").dataset.systems]
    c0 = time.thread_time()
    rates = raw_read(paths, drawn, min_seconds=seconds)
    count = rates["batches_per_s"] * rates["elapsed_s"]
    return {"batches": round(count), "wall_s": rates["elapsed_s"],
            "batches_per_s": rates["batches_per_s"],
            "cpu_us_per_batch": 1e6 * (time.thread_time() - c0) / count}


# -- DeePMD-kit ------------------------------------------------------------------------------------

def _identity(batch: Any) -> Any:
    return batch


def deepmd_batches(address: str, fmt: str, workers: int) -> Iterator[Any]:
    """DeePMD-kit 3.2.0's training batches of ``address`` as its trainer draws them."""
    import torch

    from benchmarks.impls import DeepmdAdapter, DeepmdLmdb

    if fmt == "lmdb":
        lmdb = DeepmdLmdb()
        yield from lmdb.batches(lmdb.build(address, 0, 1), workers)
        return
    from torch.utils.data import DataLoader

    adapter = DeepmdAdapter()
    adapter.load()
    data = adapter.build(adapter.discover(address, 0), "auto", SEED, 0)
    adapter.add_requirements(data)
    loader = DataLoader(data, sampler=adapter.sampler(data), batch_size=None,
                        num_workers=workers, drop_last=False, collate_fn=_identity,
                        pin_memory=False)
    while True:  # training.py's cycle_iterator
        with torch.device("cpu"):
            it = iter(loader)
        yield from it


def deepmd_windows(data: Data, workers: list[int], **kw: Any) -> list[dict[str, Any]]:
    """A window per data set and workers count."""
    records = []
    for (natoms, fmt), address in data.items():
        for nw in workers:
            batches = deepmd_batches(address, fmt, nw)
            try:
                res = window(lambda b=batches: next(b), **kw)
            finally:
                batches.close()
            records.append({"impl": "deepmd", "path": "deepmd", "natoms": natoms,
                            "format": fmt, "workers": nw, **res})
    return records


IMPLS = {"mdloader": mdloader_windows, "deepmd": deepmd_windows}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl", required=True, choices=tuple(IMPLS))
    p.add_argument("--data", action="append", required=True, metavar="ATOMS:FORMAT=ADDRESS",
                   help="192:npy=ROOT, 192:hdf5=FILE or 192:lmdb=DATABASE (repeated)")
    p.add_argument("--workers", default="0,2")
    p.add_argument("--seconds", type=float, default=0.5, help="timed window")
    p.add_argument("--warmup", type=int, default=20, help="untimed batches first")
    p.add_argument("--max-batches", type=int, default=20000)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    torch.set_num_threads(1)  # the trainer's share of a 2-core machine (mdloader.threads)
    data = {}
    for item in args.data:
        label, address = item.split("=", 1)
        natoms, fmt = label.split(":", 1)
        data[(int(natoms), fmt)] = address
    records = IMPLS[args.impl](data, [int(w) for w in args.workers.split(",") if w],
                               warmup=args.warmup, seconds=args.seconds,
                               max_batches=args.max_batches)
    load = os.getloadavg()[0]
    print(json.dumps({"records": [{**r, "loadavg_1min": load} for r in records]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
