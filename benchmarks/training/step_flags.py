"""What the stop-flag exchange of ``mdloader train`` costs per step, exchanged every step, every
10 steps (the default of ``MDLOADER_STOP_CHECK_STEPS``) or never.

    python -m benchmarks.training.step_flags          # W = 2, water and tiny systems, 5 rounds
    python -m benchmarks.training.step_flags --steps 100 --rounds 7

The ranks agree on a stop signal in one all-reduce of a flag over the CPU gloo group
(:mod:`mdloader.train.step`); the check that the averaged gradients are finite runs on every
step in all three cases and is timed alone too. Each run is a fresh ``torchrun --standalone
--nproc_per_node=W`` training the reference model with DDP on the water example (192 atoms,
batch 1) and on generated 6-atom systems (batch 2: the cheapest steps, so the largest share).
Within one run, blocks of steps of the three kinds alternate, so that they see the same machine
load; the table gives the median time per step of each kind and the exchange alone, in a loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks import REPO
from benchmarks.launch import last_json, run_job, torchrun

WATER = [os.path.join(REPO, "examples", "water", "data", f"data_{i}") for i in range(3)]


def child(systems: list[str], batch: int, steps: int, rounds: int) -> None:
    """One rank: train blocks of ``steps`` steps of each kind, alternating, and time the parts."""
    import torch

    from mdloader.config.input_json import DataConfig, LossConfig
    from mdloader.distributed.collectives import any_rank, gather_to_main
    from mdloader.distributed.group import process_group
    from mdloader.loading.feed import Feed
    from mdloader.sampling.loop import TrainingLoop
    from mdloader.sampling.spec import SamplingSpec
    from mdloader.train.job import LABELS
    from mdloader.train.model import RadialPotential
    from mdloader.train.objective import EnergyForceLoss
    from mdloader.train.step import Stepper

    torch.set_num_threads(1)
    with process_group() as world:
        data = DataConfig(systems=tuple(systems), sampling=SamplingSpec(batch))
        feed = Feed.build([data.stream("training", ["O", "H"])], seed=1, world=world,
                          labels=LABELS, num_workers=0, type_map=["O", "H"])
        feed.start(0, TrainingLoop(displays=False))
        stream = feed.stream(None, "training")
        torch.manual_seed(0)
        model = RadialPotential(2, rcut=2.5)  # the 6-atom systems' boxes are 5.6 A
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        stepper = Stepper(model, ddp, torch.optim.Adam(model.parameters(), lr=1e-4),
                                      EnergyForceLoss.from_config(LossConfig(), 1e-3),
                                      stream.dataset.systems, device=torch.device("cpu"))
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        done = 0
        for _ in range(rounds + 1):  # the first round warms up
            for kind, every in KINDS.items():
                stepper.check_every = every
                started = time.perf_counter()
                for _ in range(steps):
                    done += 1
                    stepper.step(next(stream), 1e-4, done, False)
                times[kind].append((time.perf_counter() - started) / steps)
        alone = {"exchange": lambda: any_rank([False], activity="timing"),
                 "gradient check": stepper.gradients_finite}
        rows = gather_to_main({kind: statistics.median(t[1:]) for kind, t in times.items()}
                              | {name: _timed(fn, steps * 10) for name, fn in alone.items()})
        if world.is_main:
            print(json.dumps({"W": world.world_size, **{k: max(r[k] for r in rows)
                                                        for k in rows[0]}}))


KINDS = {"every step": 1, "every 10 steps": 10, "never": 10**9}


def _timed(fn: object, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - started) / n


def run(world: int, systems: list[str], batch: int, steps: int, rounds: int) -> dict:
    cmd = torchrun(sys.executable, world, [
        "-m", "benchmarks.training.step_flags", "--child", "--batch", str(batch), "--steps",
        str(steps), "--rounds", str(rounds), "--systems", *systems])
    return last_json(run_job(cmd, timeout=3600, what=f"W={world}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--systems", nargs="+", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=5, help="timed blocks of each kind")
    args = parser.parse_args()
    if args.child:
        child(args.systems, args.batch, args.steps, args.rounds)
        return
    from mdloader.testing import make_dataset

    print(f"W={args.world}, {args.steps} steps per block, {args.rounds} blocks of each kind "
          f"(medians; load {os.getloadavg()[0]:.1f})")
    print("| data | " + " | ".join(f"stop flag {kind} ms" for kind in KINDS) +
          " | exchange alone ms | gradient check ms |")
    print("|---|" + "---:|" * (len(KINDS) + 2))
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_dataset(tmp, 6, natoms_range=(6, 6), nframes=20)
        for name, systems, batch in (("water, 192 atoms, batch 1", WATER, 1),
                                     ("6 atoms, batch 2", tiny, 2)):
            row = run(args.world, systems, batch, args.steps, args.rounds)
            cells = [f"{1e3 * row[kind]:.2f} ({row[kind] / row['never'] - 1:+.0%})"
                     for kind in KINDS]
            print(f"| {name} | " + " | ".join(cells) + f" | {1e3 * row['exchange']:.3f} | "
                  f"{1e3 * row['gradient check']:.3f} |")


if __name__ == "__main__":
    main()
