"""Balanced steps in a real job: ``mdloader train`` under ``torchrun`` on 2 gloo ranks, mixed sizes.

    python -m benchmarks.sampling.balance_train                 # 2 rounds of 40- and 240-step runs
    python -m benchmarks.sampling.balance_train --rounds 3 --short 40 --long 440

The reference trainer (``mdloader train``, the RadialPotential model, DDP on CPU) trains
generated systems of 3..200 atoms (``batch_size: auto``, ``prob_sys_size``), once as today and
once with ``balance_window: 32``. Each configuration runs a short and a long job; the time per
step is (long - short) / (long steps - short steps), so start-up cancels. The configurations
alternate within each round so that they see the same machine load; medians are printed, next
to the per-step busiest/mean batch cost of the batches the ranks actually trained (from the
sampler, without reading data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmarks.launch import run_job, torchrun

WORLD, WINDOW, RCUT = 2, 32, 2.0


def write_input(folder: str, systems: list[str], balance: int) -> str:
    data = {"systems": systems, "batch_size": "auto", "auto_prob": "prob_sys_size"}
    if balance:
        data["balance_window"] = balance
    config = {"model": {"type_map": ["O", "H"]},
              "learning_rate": {"type": "exp", "decay_steps": 100, "start_lr": 1e-3,
                                "stop_lr": 1e-4},
              "loss": {"type": "ener"},
              "training": {"training_data": data, "seed": 1, "disp_freq": 10**6,
                           "save_freq": 10**6, "numb_steps": 10}}
    path = os.path.join(folder, f"input_{balance}.json")
    with open(path, "w") as fh:
        json.dump(config, fh)
    return path


def run(config: str, steps: int, out: str) -> float:
    cmd = torchrun(sys.executable, WORLD, [
        "-m", "mdloader", "train", config, "--numb-steps", str(steps), "--rcut", str(RCUT),
        "--num-workers", "0", "-o", out])
    started = time.perf_counter()
    run_job(cmd, timeout=3600, what=config)
    return time.perf_counter() - started


def cost_ratio(systems: list[str], balance: int, steps: int) -> float:
    """sum over steps of the busiest rank's batch atoms / sum of the mean, for these steps."""
    from mdloader import DpLoaderSet, get_weighted_sampler
    from mdloader.sampling.spec import SamplingSpec
    from mdloader.world import World

    keys = []
    for rank in range(WORLD):
        ls = DpLoaderSet(systems, "auto", ["O", "H"], seed=1,
                         spec=SamplingSpec("auto", balance_window=balance),
                         world=World(rank=rank, world_size=WORLD))
        sampler = get_weighted_sampler(ls, "prob_sys_size", num_samples=steps)
        atoms = np.array([s.meta.natoms for s in ls.systems]) * ls.batch_sizes
        keys.append([atoms[k.sid] for k in iter(sampler)])
    cost = np.array(keys)
    return float(cost.max(axis=0).sum() / cost.mean(axis=0).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--short", type=int, default=40)
    parser.add_argument("--long", type=int, default=240)
    parser.add_argument("--systems", type=int, default=24)
    args = parser.parse_args()
    from mdloader.testing import make_dataset

    with tempfile.TemporaryDirectory() as tmp:
        systems = make_dataset(os.path.join(tmp, "data"), args.systems,
                               natoms_range=(3, 200), nframes=40)
        configs = {0: write_input(tmp, systems, 0), WINDOW: write_input(tmp, systems, WINDOW)}
        per_step: dict[int, list[float]] = {0: [], WINDOW: []}
        for _ in range(args.rounds):
            for balance, config in configs.items():
                short = run(config, args.short, os.path.join(tmp, f"s{balance}"))
                long = run(config, args.long, os.path.join(tmp, f"l{balance}"))
                per_step[balance].append((long - short) / (args.long - args.short))
        names = {0: "today (independent draws)", WINDOW: f"balanced, balance_window {WINDOW}"}
        print(f"W={WORLD} gloo, {args.systems} systems of 3..200 atoms, batch_size auto, "
              f"rcut {RCUT}; {args.rounds} round(s) of {args.short}- and {args.long}-step runs "
              f"(load {os.getloadavg()[0]:.1f})")
        print("| sampler | ms per step (median) | runs | busiest/mean batch atoms |")
        print("|---|---:|---|---:|")
        for balance, times in per_step.items():
            print(f"| {names[balance]} | {1e3 * statistics.median(times):.1f} | "
                  f"{', '.join(f'{1e3 * t:.1f}' for t in times)} | "
                  f"{cost_ratio(systems, balance, args.long):.3f} |")
        ratio = statistics.median(per_step[0]) / statistics.median(per_step[WINDOW])
        print(f"today / balanced time per step: {ratio:.2f}")


if __name__ == "__main__":
    main()
