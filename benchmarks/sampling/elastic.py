"""Elastic resume: how big the saved state is, and what a resume on another world size costs.

    python -m benchmarks.sampling.elastic           # 100 000 systems; W = 4, 64, 256 -> W' = 8
    python -m benchmarks.sampling.elastic --nsys 10000 --worlds 4 16 --steps 1000

The state is measured as JSON bytes of the job state (every rank merged), for a job that never
changed its world size and after three elastic resumes. A resume is timed on new rank 0:
replaying the system streams of the old ranks it takes over (``d % W' == 0``) and working out the
pieces of what it is owed (their frames are drawn later, when it draws each system); peak memory
is what ``tracemalloc`` sees numpy allocate. Pure computation in one process: no data files are
read.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc

import numpy as np

from mdloader.sampling.elastic import IDENTITY
from mdloader.sampling.probability import StyleRule
from mdloader.sampling.samplers import STATE_VERSION, WeightedSystemSampler

RULE = StyleRule.of("prob_sys_size")


def sampler(nframes: np.ndarray, batch_sizes: np.ndarray, rank: int,
            world: int) -> WeightedSystemSampler:
    return WeightedSystemSampler(nframes, batch_sizes, RULE, seed=1, rank=rank, world_size=world)


def job_state(template: WeightedSystemSampler, generations: list[list[int]]) -> dict:
    """The merged state of a job whose generations ran ``generations`` (rows [W, k...])."""
    state = template.state_dict()
    return {"version": STATE_VERSION, **{k: state[k] for k in IDENTITY},
            "generations": generations}


def measure(nsys: int, old_world: int, steps: int, new_world: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    nframes = rng.integers(10, 200, nsys)
    batch_sizes = rng.integers(1, 5, nsys)
    template = sampler(nframes, batch_sizes, 0, new_world)
    job = job_state(template, [[old_world, *[steps] * old_world]])
    tracemalloc.start()
    started = time.perf_counter()
    template.load_state_dict(job)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    chain = job_state(template, [[w, *[steps] * w] for w in (old_world, new_world, old_world)]
                      + [[new_world, *[steps] * new_world]])
    return {"nsys": nsys, "W": old_world, "W_new": new_world, "steps": steps,
            "resume_s": seconds, "peak_MiB": peak / 2**20,
            "leftover_frames": template.order.continuation.total,
            "state_B": len(json.dumps(job)), "state_after_3_resumes_B": len(json.dumps(chain))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nsys", type=int, nargs="+", default=[100_000])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 64, 256])
    p.add_argument("--steps", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--new-world", type=int, default=8)
    args = p.parse_args(argv)
    print("| systems | W -> W' | steps per rank | resume s | peak MiB | leftover frames on rank 0 "
          "| job state B | after 3 more resumes B |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for nsys in args.nsys:
        for world in args.worlds:
            for steps in args.steps:
                r = measure(nsys, world, steps, args.new_world)
                print(f"| {r['nsys']:,} | {r['W']} -> {r['W_new']} | {r['steps']:,} | "
                      f"{r['resume_s']:.2f} | {r['peak_MiB']:.0f} | {r['leftover_frames']:,} | "
                      f"{r['state_B']:,} | {r['state_after_3_resumes_B']:,} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
