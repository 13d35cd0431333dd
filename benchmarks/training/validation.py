"""Full validation on W ranks against one rank: wall time of one pass over every validation frame.

    python -m benchmarks.training.validation            # water example, W = 1, 2, 4, 3 repetitions
    python -m benchmarks.training.validation --worlds 1 2 --reps 5 --threads 1

Each measurement is a fresh ``torchrun --standalone --nproc_per_node=W`` (gloo, CPU) running
``mdloader train``'s full validation (:class:`mdloader.train.validation.Validation`) with the
reference model, seeded identically on every rank; a first pass warms the caches and the second
is timed, from a barrier to the reduced result. The world sizes alternate in order on every
repetition so that they see the same machine load; the table gives medians, the speed-up over
one rank and the target ``1 / (0.8 W)`` of one rank's time, and the CPU seconds of the
busiest rank (on a machine with fewer free cores than ranks, the wall time cannot show the
split; the CPU time does). Every run also checks that
the reduced RMSEs equal the one-rank values within 1e-12 relative and that every frame was
validated once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks import REPO
from benchmarks.launch import last_json, rank_env, run_job, torchrun

WATER = [os.path.join(REPO, "examples", "water", "data", f"data_{i}") for i in range(4)]


def child(systems: list[str], threads: int) -> None:
    """One rank: build the validation data, warm up, time one full pass; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from mdloader.config.input_json import DataConfig
    from mdloader.distributed.collectives import gather_to_main
    from mdloader.distributed.group import process_group
    from mdloader.loading.feed import Feed
    from mdloader.sampling.loop import TrainingLoop
    from mdloader.sampling.spec import SamplingSpec
    from mdloader.train.job import LABELS
    from mdloader.train.model import RadialPotential
    from mdloader.train.validation import Validation

    torch.set_num_threads(threads)
    with process_group() as world:
        data = DataConfig(systems=tuple(systems),
                          sampling=SamplingSpec(1, json_path="training.validation_data"))
        feed = Feed.build([data.stream("validation", ["O", "H"])], seed=1, world=world,
                          labels=LABELS, num_workers=0, type_map=["O", "H"])
        feed.start(0, TrainingLoop())
        valid = Validation(feed, numb_btch=1)
        torch.manual_seed(0)
        model = RadialPotential(2)

        def predict(batch: dict) -> tuple[dict, dict]:
            out = model(batch["coord"], batch["atype"], batch["box"], create_graph=False)
            label = {k: batch[k].to(torch.float64) for k in ("energy", "force")}
            return {k: v.detach() for k, v in out.items()}, label

        valid.full(predict, step=0)
        if world.distributed:
            dist.barrier()
        started, cpu = time.perf_counter(), time.process_time()
        result = valid.full(predict, step=1)
        seconds = time.perf_counter() - started
        cpus = gather_to_main(time.process_time() - cpu)
        if world.is_main:
            print(json.dumps({"W": world.world_size, "seconds": seconds, "frames": result.frames,
                              "cpu": max(cpus), "rmse_e": result.rmse_e,
                              "rmse_f": result.rmse_f}))


def run(world: int, systems: list[str], threads: int) -> dict:
    cmd = torchrun(sys.executable, world, [
        "-m", "benchmarks.training.validation", "--child", "--threads", str(threads),
        "--systems", *systems])
    env = rank_env() | {"OMP_NUM_THREADS": str(threads)}
    return last_json(run_job(cmd, timeout=1800, env=env, what=f"W={world}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--systems", nargs="+", default=WATER)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.systems, args.threads)
        return 0
    runs: dict[int, list[dict]] = {w: [] for w in args.worlds}
    for rep in range(args.reps):
        for world in (args.worlds if rep % 2 == 0 else args.worlds[::-1]):
            runs[world].append(run(world, args.systems, args.threads))
    base = runs[args.worlds[0]][0]
    one = statistics.median(r["seconds"] for r in runs[args.worlds[0]])
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"{base['frames']} frames, {args.threads} torch thread(s) per rank")
    print("| W | full pass s (median) | speed-up | target speed-up 0.8 W | met? | CPU s of the "
          "busiest rank | rmse_e equal | rmse_f equal |")
    print("|---:|---:|---:|---:|:---:|---:|:---:|:---:|")
    for world in args.worlds:
        median = statistics.median(r["seconds"] for r in runs[world])
        cpu = statistics.median(r["cpu"] for r in runs[world])
        speedup = one / median
        same = [all(abs(r[k] - base[k]) <= 1e-12 * abs(base[k]) and r["frames"] == base["frames"]
                    for r in runs[world]) for k in ("rmse_e", "rmse_f")]
        print(f"| {world} | {median:.2f} | {speedup:.2f}x | {0.8 * world:.1f}x | "
              f"{'yes' if speedup >= 0.8 * world else 'no'} | {cpu:.2f} | "
              f"{'yes' if same[0] else 'NO'} | "
              f"{'yes' if same[1] else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
