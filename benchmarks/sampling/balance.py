"""Balanced steps: per-step busiest-rank cost over the mean, today's sampler vs balanced.

    python -m benchmarks.sampling.balance                      # W = 8, 64, 512, 4096; k = 8, 32, 64
    python -m benchmarks.sampling.balance --worlds 8 64 --windows 8 32 --freq-steps 20000

Pure simulation in one process, no data read: today's step ``t`` is column ``t`` of the per-rank
system streams of :mod:`mdloader.sampling.order` (rank ``r`` trains its own draw), the balanced
step ``t`` is column ``t`` of the per-rank balanced draws of
:func:`mdloader.sampling.balance.balanced_draws` (each rank computed alone). A batch costs its
atoms (``natoms * batch_size``, cost model ``atoms``). Two data sets:

- ``mixed``: 1000 systems, natoms uniform in 3..200, equal frames, ``batch_size: auto`` (32),
  ``prob_sys_size``;
- ``water``: ``examples/water/data`` (4 systems of 192 atoms): every batch costs the same.

Columns: ``mean`` is the mean over steps of max/mean, ``time`` is sum(max) / sum(mean) (the
slowdown against perfectly even steps), ``p99`` the 99th percentile of max/mean, ``bound`` the
guarantee 1 + (max - min) / (k * mean cost) of the draws. Last, the per-system counts of one
rank over ``--freq-steps`` steps against the probabilities: chi-square per degree of freedom,
balanced (stratified: below 1) and unbalanced (multinomial: about 1).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks import REPO
from mdloader.sampling.balance import Strata, balanced_draws, batch_costs
from mdloader.sampling.batching import batches_per_rank, resolve_batch_sizes
from mdloader.sampling.order import stream_draws, weights_to_cdf
from mdloader.sampling.probability import prob_sys_size

SEED = 2024
WATER = Path(REPO) / "examples" / "water" / "data"


def mixed_set(nsys: int = 1000, nframes: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """(natoms, nframes) of the mixed data set."""
    natoms = np.random.default_rng(SEED).integers(3, 201, nsys)
    return natoms, np.full(nsys, nframes)


def water_set() -> tuple[np.ndarray, np.ndarray]:
    """(natoms, nframes) of the water example, read from the npy headers."""
    systems = sorted(p for p in WATER.iterdir() if (p / "type.raw").is_file())
    natoms = [len((p / "type.raw").read_text().split()) for p in systems]
    nframes = [sum(np.load(s / "coord.npy", mmap_mode="r").shape[0]
                   for s in sorted(p.glob("set.*"))) for p in systems]
    return np.array(natoms), np.array(nframes)


def setup(natoms: np.ndarray, nframes: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """(cdf, per-system batch cost) with batch_size auto and prob_sys_size on ``world`` ranks."""
    sizes = resolve_batch_sizes("auto", natoms).batch_sizes
    cdf = weights_to_cdf(prob_sys_size(batches_per_rank(nframes, sizes, world)))
    return cdf, batch_costs("atoms", natoms, sizes)


def draws(cdf: np.ndarray, world: int, steps: int) -> np.ndarray:
    """Today's per-rank draws: ``[W, steps]``."""
    return np.stack([stream_draws(SEED, r, 0, steps, cdf) for r in range(world)])


def balanced_sids(cdf: np.ndarray, costs: np.ndarray, world: int, steps: int,
                  k: int) -> np.ndarray:
    """The balanced draws of every rank, ``[steps, W]``, each rank computed alone."""
    strata = Strata.of(cdf, costs)
    return np.stack([balanced_draws(SEED, r, 0, steps, strata, k) for r in range(world)], axis=1)


def stats(step_costs: np.ndarray) -> tuple[float, float, float]:
    """(mean, time, p99) of the per-step busiest-rank cost over the mean."""
    mx, mean = step_costs.max(axis=1), step_costs.mean(axis=1)
    r = mx / mean
    return float(r.mean()), float(mx.sum() / mean.sum()), float(np.percentile(r, 99))


def fmt(values: tuple[float, ...]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def steps_for(world: int, budget: int) -> int:
    """Steps simulated at ``world`` ranks: about ``budget`` draws, at least 16 windows of 64."""
    return max(1024, budget // world // 64 * 64)


def table(name: str, natoms: np.ndarray, nframes: np.ndarray, worlds: list[int],
          windows: list[int], budget: int, target: float) -> bool:
    """Print one data set's table; True when every balanced cell meets ``target``."""
    print(f"\n{name}: {len(natoms)} systems, natoms {natoms.min()}..{natoms.max()}, "
          f"frames {nframes.min()}..{nframes.max()}; columns mean / time / p99")
    head = f"{'W':>5} {'steps':>6} | {'today':^20} |"
    head += "".join(f" {f'k={k}':^20} {'bound':>5} |" for k in windows)
    print(head)
    ok = True
    for world in worlds:
        started = time.perf_counter()
        cdf, costs = setup(natoms, nframes, world)
        steps = steps_for(world, budget)
        d = draws(cdf, world, steps)
        row = f"{world:>5} {steps:>6} | {fmt(stats(costs[d].T))} |"
        for k in windows:
            s = stats(costs[balanced_sids(cdf, costs, world, steps, k)])
            c = costs[d]
            bound = 1 + (c.max() - c.min()) / (k * c.mean())
            ok &= s[1] <= target
            row += f" {fmt(s)} {min(bound, 9.99):>5.3f} |"
        print(row + f"  ({time.perf_counter() - started:.1f} s)")
    return ok


def chi2_per_df(counts: np.ndarray, p: np.ndarray) -> float:
    """Pearson's chi-square of ``counts`` against ``p`` over the systems drawn, per degree of
    freedom: about 1 for independent draws, below 1 for stratified ones."""
    n, keep = counts.sum(), p > 0
    expected = n * p[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum() / (keep.sum() - 1))


def frequencies(natoms: np.ndarray, nframes: np.ndarray, worlds: list[int], windows: list[int],
                steps: int) -> float:
    """Print chi-square per degree of freedom of rank 0's counts, balanced and unbalanced, against
    the probabilities; return the largest balanced one."""
    print(f"\nper-system counts of rank 0 over {steps} steps against the probabilities "
          "(chi-square per degree of freedom):")
    worst = 0.0
    for world in worlds:
        cdf, costs = setup(natoms, nframes, world)
        p = np.diff(cdf, prepend=0.0)
        today = chi2_per_df(np.bincount(draws(cdf, 1, steps)[0], minlength=len(p)), p)
        for k in windows:
            ours = np.bincount(balanced_sids(cdf, costs, 1, steps, k)[:, 0], minlength=len(p))
            value = chi2_per_df(ours, p)
            worst = max(worst, value)
            print(f"  W={world:<5} k={k:<3} balanced {value:.3f}   unbalanced {today:.3f}")
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 4096])
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--budget", type=int, default=1 << 20, help="draws simulated per world size")
    ap.add_argument("--freq-steps", type=int, default=100_000)
    ap.add_argument("--freq-worlds", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--target", type=float, default=1.05)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    mixed = table("mixed", *mixed_set(), args.worlds, args.windows, args.budget, args.target)
    table("water", *water_set(), args.worlds, args.windows, args.budget, args.target)
    worst = frequencies(*mixed_set(), args.freq_worlds, args.windows, args.freq_steps)
    dof = len(mixed_set()[0]) - 1
    fits = worst < 1 + 6 * np.sqrt(2 / dof)
    print(f"\nmixed set: time <= {args.target} for every W and k: {mixed}; "
          f"frequencies follow the probabilities: {fits}; "
          f"total {time.perf_counter() - started:.1f} s")
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
