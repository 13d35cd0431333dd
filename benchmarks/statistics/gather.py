"""Gathering packets of unequal sizes from every rank to every rank, over gloo: the ways torch
offers, side by side.

Each rank holds one packet; one rank's is ``--big`` bytes, the others' ``--small`` (the shares
of a statistics pass over systems of very different sizes). Ways compared, every one preceded by
an all-gather of the lengths where it needs them:

* ``padded``: one all-gather of every packet padded to the longest (what gloo's all-gather
  needs: equal sizes); every rank holds W x the longest;
* ``object``: ``torch.distributed.all_gather_object`` (pickles, then pads the same way);
* ``broadcasts``: one broadcast per rank of its packet at its own length, launched together;
  every rank holds the sum of the lengths.

It prints, per world size, the median seconds of each way and the bytes each rank receives.
Usage: ``python -m benchmarks.statistics.gather --worlds 2 4 8 --big 4000000 --small 4000``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAYS = ("padded", "object", "broadcasts")


def _lengths(mine: torch.Tensor, world: int) -> list[int]:
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64))
    return [int(s) for s in sizes]


def padded(mine: torch.Tensor, world: int) -> list[torch.Tensor]:
    lengths = _lengths(mine, world)
    longest = max(lengths)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(mine)] = mine
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, buf)
    return [o[:n] for o, n in zip(out, lengths)]


def gathered_objects(mine: torch.Tensor, world: int) -> list[torch.Tensor]:
    out: list[object] = [None] * world
    dist.all_gather_object(out, mine.numpy().tobytes())
    return [torch.frombuffer(bytearray(o), dtype=torch.uint8) for o in out]  # type: ignore[arg-type]


def broadcasts(mine: torch.Tensor, world: int) -> list[torch.Tensor]:
    lengths = _lengths(mine, world)
    rank = dist.get_rank()
    out = [mine if r == rank else torch.empty(n, dtype=torch.uint8)
           for r, n in enumerate(lengths)]
    works = [dist.broadcast(t, src=r, async_op=True) for r, t in enumerate(out)]
    for w in works:
        w.wait()
    return out


def _rank(rank: int, world: int, port: int, big: int, small: int, reps: int,
          queue: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    n = big if rank == world - 1 else small
    mine = torch.full((n,), rank % 251, dtype=torch.uint8)
    times: dict[str, float] = {}
    for name, way in zip(WAYS, (padded, gathered_objects, broadcasts)):
        got = way(mine, world)  # warm-up, and the check
        if [len(g) for g in got] != [big if r == world - 1 else small for r in range(world)] \
                or any(int(g[0]) != r % 251 for r, g in enumerate(got)):
            raise RuntimeError(f"{name}: wrong packets")
        runs = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            way(mine, world)
            runs.append(time.perf_counter() - t0)
        times[name] = statistics.median(runs)
    if rank == 0:
        queue.put(times)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--big", type=int, default=4_000_000)
    ap.add_argument("--small", type=int, default=4_000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    print("| W | " + " | ".join(f"{w} s" for w in WAYS)
          + " | received per rank, padded / exact |")
    print("|---|" + "---|" * (len(WAYS) + 1))
    for world in args.worlds:
        queue = ctx.Queue()
        mp.start_processes(_rank, args=(world, _free_port(), args.big, args.small, args.reps,
                                        queue), nprocs=world, start_method="spawn")
        times = queue.get()
        exact = args.big + (world - 1) * args.small
        print(f"| {world} | " + " | ".join(f"{times[w]:.4f}" for w in WAYS)
              + f" | {world * args.big / 1e6:.1f} MB / {exact / 1e6:.2f} MB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
