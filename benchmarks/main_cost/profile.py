"""Where the main process spends its time per batch: mdloader's stream with DataLoader workers
under cProfile, and the pieces timed alone.

Two views of the trainer thread's CPU per batch, on npy data with 2 workers:

* **cProfile**, its clock the thread's CPU time (``cProfile.Profile(time.thread_time)``), switched
  on after the workers started, so only the main thread is profiled: the time of a ``next()``
  split into parts by the cumulative time of the functions that do them (:data:`PARTS`), for
  ``mdloader train``'s stream and ``mdloader dp``'s. The profiler adds a fixed cost to every
  Python call, so the shares lean towards the parts that make many calls; the profiled and
  unprofiled totals are both reported.
* **Alone**: each piece timed in a loop without the profiler (:func:`alone`), and the floor of a
  torch DataLoader with 2 workers whose dataset returns a plain integer (what any loader built
  on one pays per item).
* **Batches per DataLoader item** (:func:`grouped`): the stream's own dataset and sampler read
  through a bare DataLoader with 2 workers whose item is 1, 2 or 4 batches: what the per-item
  cost of the DataLoader becomes when a worker sends several batches at once (a sketch of a
  change to the pool, measured outside it; medians of 3 windows by default).

Usage: ``python -m benchmarks.main_cost.profile --data NPY_ROOT`` prints one JSON object on its
last line (:mod:`benchmarks.main_cost.run` records it).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.main_cost.measure import mdloader_feed, mdloader_source, window
from mdloader.loading.pool import end_workers

#: A function as cProfile names it: (file, first line, name); builtins are ("~", 0, text).
Key = tuple[str, int, str]


def key(func: Callable[..., Any]) -> Key:
    code = func.__code__
    return code.co_filename, code.co_firstlineno, code.co_name


def builtin(text: str) -> Key:
    return "~", 0, f"<built-in method {text}>"


def functions() -> dict[str, Key]:
    """The functions the parts are cut along, by a short name."""
    from multiprocessing.queues import Queue

    import torch.autograd.profiler as torch_profiler
    import torch.utils.data.dataloader as dl

    from mdloader import transport
    from mdloader.integrations.deepmd.stopping import NonFiniteBatches
    from mdloader.loading import feed, pool, stalls

    rf = torch_profiler.record_function
    base, multi = dl._BaseDataLoaderIter, dl._MultiProcessingDataLoaderIter
    return {
        "Stream.__next__": key(feed.Stream.__next__),
        "TrainingDraws.__next__": key(feed.TrainingDraws.__next__),
        "DataLoader.__next__": key(base.__next__),
        "record_function.__init__": key(rf.__init__),
        "record_function.__enter__": key(rf.__enter__),
        "record_function.__exit__": key(rf.__exit__),
        "_try_put_index": key(multi._try_put_index),
        "PoolKeys.__iter__": key(pool.PoolKeys.__iter__),
        "Queue.put": key(Queue.put), "Queue.get": key(Queue.get),
        "pickle.loads": builtin("_pickle.loads"),
        "_rebuild_batch": key(transport._rebuild_batch),
        "StallMeter.start_wait": key(stalls.StallMeter.start_wait),
        "StallMeter.end_wait": key(stalls.StallMeter.end_wait),
        "NonFiniteBatches.__call__": key(NonFiniteBatches.__call__),
    }


def cumulative(stats: dict[Key, Any], k: Key) -> float:
    """Seconds in ``k`` and what it called (0 when it was not called)."""
    return stats[k][3] if k in stats else 0.0


def parts(stats: dict[Key, Any], names: dict[str, Key], root: str) -> list[tuple[str, float]]:
    """The cumulative seconds of ``root`` split into disjoint parts, named for the reader."""
    ct = {n: cumulative(stats, k) for n, k in names.items()}
    record = sum(ct[f"record_function.{m}"] for m in ("__init__", "__enter__", "__exit__"))
    keys, put = ct["PoolKeys.__iter__"], ct["Queue.put"]
    loads, rebuild = ct["pickle.loads"], ct["_rebuild_batch"]
    get = ct["Queue.get"] - loads
    index_rest = ct["_try_put_index"] - keys - put
    torch_parts = record + keys + put + index_rest + get + loads
    dataloader_rest = ct["DataLoader.__next__"] - torch_parts
    meter = ct["StallMeter.start_wait"] + ct["StallMeter.end_wait"]
    check = ct["NonFiniteBatches.__call__"]
    own = ct[root] - ct["DataLoader.__next__"] - meter - check
    return [
        ("torch: `record_function` around `DataLoader.__next__`", record),
        ("torch: index put, the rest (`_try_put_index`)", index_rest),
        ("multiprocessing: `Queue.put` of the index", put),
        ("mdloader: the next key (`PoolKeys.__iter__`, the sampler)", keys),
        ("multiprocessing: `Queue.get` (poll, receive, locks)", get),
        ("unpickling the batch (`pickle.loads`)", loads - rebuild),
        ("mdloader: arrays back to tensors (`_rebuild_batch`: `torch.from_numpy`)", rebuild),
        ("torch: the rest of `DataLoader.__next__`", dataloader_rest),
        ("mdloader: the stall meter (`start_wait`, `end_wait`: `payload_bytes`)", meter),
        ("mdloader: `NonFiniteBatches` (the `mdloader dp` check)", check),
        ("mdloader: the stream and the pool (`Stream.__next__`, `next_batch`, `_receive`)", own),
    ]


def profiled(feed: Any, path: str, batches: int) -> dict[str, Any]:
    """One path's parts under cProfile (thread CPU clock), after an unprofiled window."""
    names = functions()
    root = "TrainingDraws.__next__" if path == "dp" else "Stream.__next__"
    with mdloader_source(feed, path) as draw:
        plain = window(draw, feed.training_step, warmup=20, seconds=1e9, max_batches=batches)
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        for _ in range(batches):
            with feed.training_step():
                draw()
        prof.disable()
    prof.create_stats()
    stats = prof.stats  # type: ignore[attr-defined]
    total = cumulative(stats, names[root])
    return {"unprofiled_us_per_batch": plain["cpu_us_per_batch"],
            "profiled_us_per_batch": 1e6 * total / batches,
            "parts": [{"part": name, "us_per_batch": 1e6 * s / batches,
                       "share": s / total if total else None}
                      for name, s in parts(stats, names, root)]}


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds of this thread's CPU per call of ``fn``."""
    c0 = time.thread_time()
    for _ in range(calls):
        fn()
    return 1e6 * (time.thread_time() - c0) / calls


class _Integers:
    """A dataset whose item is its key: a DataLoader's cost with nothing to read or send."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> int:
        return i


def alone(feed: Any, calls: int) -> list[dict[str, Any]]:
    """The pieces of a batch's way through the main process, each timed alone (µs per call)."""
    import torch
    from torch.utils.data import DataLoader

    from mdloader.integrations.deepmd.stopping import NonFiniteBatches
    from mdloader.loading.stalls import payload_bytes
    from mdloader.transport import TransportBatch

    with mdloader_source(feed, "train") as draw:
        batch = draw()
    stream = feed.stream(None, "training")
    message = multiprocessing.reduction.ForkingPickler.dumps(
        (0, (0, TransportBatch(batch), (1, 0, 0))))
    arrays = [v.numpy() for v in batch.values() if torch.is_tensor(v)]
    check = NonFiniteBatches(feed)
    queue: Any = multiprocessing.get_context("fork").Queue()

    def record() -> None:
        with torch.autograd.profiler.record_function("enumerate(DataLoader)"):
            pass

    floor = iter(DataLoader(_Integers(), batch_size=None, num_workers=2))
    for _ in range(100):
        next(floor)
    rows = [
        ("floor", "a DataLoader with 2 workers, items of one integer (the floor)",
         _per_call(lambda: next(floor), calls)),
        ("record_function", "`record_function` enter and exit", _per_call(record, calls)),
        ("unpickle", "unpickling the batch as a worker sends it (`pickle.loads`, "
         "`torch.from_numpy` included)",
         _per_call(lambda: pickle.loads(message), calls)),
        ("from_numpy", f"`torch.from_numpy` of its {len(arrays)} arrays",
         _per_call(lambda: [torch.from_numpy(a) for a in arrays], calls)),
        ("next_key", "the next key (`sampler.next_key`)",
         _per_call(stream.sampler.next_key, calls)),
        ("queue_put", "`Queue.put` of an index", _per_call(lambda: queue.put((0, (0, 0))), calls)),
        ("payload_bytes", "`payload_bytes` (the stall meter)",
         _per_call(lambda: payload_bytes(batch), calls)),
        ("nonfinite", "`NonFiniteBatches` on the batch",
         _per_call(lambda: check(stream, batch), calls)),
    ]
    end_workers(floor)
    queue.close()
    return [{"id": ident, "piece": name, "us": us} for ident, name, us in rows]


class _Grouped:
    """A dataset whose item is the batches of a list of keys, each leaving as a
    :class:`~mdloader.transport.TransportBatch`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, keys: list[Any]) -> list[Any]:
        from mdloader.transport import TransportBatch

        return [TransportBatch(self.dataset[k]) for k in keys]


class _KeyGroups:
    """A sampler of lists of ``size`` keys of ``sampler``, endless."""

    def __init__(self, sampler: Any, size: int) -> None:
        self.sampler, self.size = sampler, size

    def __iter__(self) -> Any:
        while True:
            yield [self.sampler.next_key() for _ in range(self.size)]


def grouped(feed: Any, sizes: tuple[int, ...], seconds: float,
            reps: int = 3) -> list[dict[str, Any]]:
    """Main-thread CPU per batch and batches per second through a bare DataLoader (2 workers)
    whose item is ``size`` batches of the stream, for each size: medians of ``reps`` windows,
    the sizes alternating."""
    from torch.utils.data import DataLoader

    from mdloader.transport import identity

    stream = feed.stream(None, "training")
    runs: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
    for _ in range(reps):
        for size in sizes:
            items = iter(DataLoader(_Grouped(stream.dataset),
                                    sampler=_KeyGroups(stream.sampler, size), batch_size=None,
                                    num_workers=2, collate_fn=identity))
            held: list[Any] = []

            def draw(items: Any = items, held: list[Any] = held) -> Any:
                if not held:
                    held.extend(next(items))
                return held.pop(0)

            runs[size].append(window(draw, warmup=40, seconds=seconds, max_batches=1 << 30))
            end_workers(items)
    return [{"batches_per_item": size,
             **{f: statistics.median(r[f] for r in rs)
                for f in ("cpu_us_per_batch", "batches_per_s")}} for size, rs in runs.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", required=True, help="an npy data set root")
    p.add_argument("--batches", type=int, default=2000, help="profiled batches per path")
    p.add_argument("--calls", type=int, default=2000, help="calls per piece timed alone")
    p.add_argument("--seconds", type=float, default=1.0, help="window per group size")
    p.add_argument("--reps", type=int, default=3, help="windows per group size (medians)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    feed = mdloader_feed(args.data, 2)
    out = {"workers": 2, "format": "npy", "batches": args.batches,
           "paths": {path: profiled(feed, path, args.batches) for path in ("train", "dp")},
           "alone": alone(feed, args.calls),
           "grouped": grouped(feed, (1, 2, 4), args.seconds, args.reps)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
