"""``mdloader bench``: time the loader exactly as the training job uses it, per rank.

Each rank builds the feed of the training data (rank 0 discovers and reads headers, the others
receive metadata), then pulls N batches through its pool of DataLoader workers with the stateful
weighted sampler and the same labels the training job requests. Reported per rank: the build
phases (discovery, build, broadcast) and the broadcast bytes from
:class:`~mdloader.loading.build.BuildReport`, the time to the first batch (worker start-up),
batches/frames/atoms per second after the first batch, and the peak resident memory of the rank
and of its DataLoader workers. Rows are gathered on rank 0. A multi-task input is benched task
by task (each task's own stream), not as the job's mix of tasks, which depends on the task
schedule of the trainer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mdloader.cli.arguments import at_least
from mdloader.data.schema import DataRequirementItem
from mdloader.world import World

if TYPE_CHECKING:
    from mdloader.config.input_json import Config
    from mdloader.config.multitask import JobConfig

#: Labels read as the training job reads them, but optional: bench also runs on unlabeled data.
BENCH_LABELS = [DataRequirementItem("energy", 1, atomic=False, must=False, high_prec=True),
                DataRequirementItem("force", 3, atomic=True, must=False)]

COLUMNS = [("rank", "{:>4}", "{:>4d}"), ("nsys", "{:>6}", "{:>6d}"),
           ("setup_s", "{:>8}", "{:>8.2f}"), ("discover_s", "{:>10}", "{:>10.3f}"),
           ("build_s", "{:>8}", "{:>8.3f}"), ("bcast_s", "{:>8}", "{:>8.3f}"),
           ("bcast_MB", "{:>8}", "{:>8.3f}"), ("first_s", "{:>7}", "{:>7.2f}"),
           ("batch/s", "{:>8}", "{:>8.1f}"), ("frame/s", "{:>8}", "{:>8.1f}"),
           ("atom/s", "{:>10}", "{:>10.0f}"), ("rss_MB", "{:>7}", "{:>7.0f}"),
           ("wrk_rss_MB", "{:>10}", "{:>10.0f}")]


def _peak_rss_mb(who: int) -> float:
    """Peak resident set size in MiB (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(who).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def run_bench(config: Config, *, batches: int = 200, num_workers: int | None = None
              ) -> list[dict[str, Any]] | None:
    """Bench this rank; return every rank's row on rank 0 (``None`` on the others)."""
    from mdloader.distributed.collectives import gather_to_main  # torch: only when it runs
    from mdloader.distributed.group import process_group

    with process_group() as world:
        row = bench_rank(config, world, batches=batches, num_workers=num_workers)
        return gather_to_main(row)


def run_job_bench(job: JobConfig, *, batches: int = 200, num_workers: int | None = None
                  ) -> dict[str, list[dict[str, Any]]] | None:
    """Bench each task of a multi-task input in turn, as its own loader (each task has its
    own stream and loader in the job); every rank's rows per task on rank 0."""
    from mdloader.distributed.collectives import gather_to_main
    from mdloader.distributed.group import process_group

    out: dict[str, list[dict[str, Any]]] = {}
    with process_group() as world:
        for task in job.tasks:
            rows = gather_to_main(bench_rank(task.config, world, batches=batches,
                                             num_workers=num_workers))
            if rows is not None:
                out[task.name] = rows
    return out if world.is_main else None


def bench_rank(config: Config, world: World, *, batches: int, num_workers: int | None
               ) -> dict[str, Any]:
    """One rank's measurements (see the module docstring)."""
    from mdloader.loading.feed import Feed
    from mdloader.loading.loader import default_num_workers
    from mdloader.sampling.loop import TrainingLoop
    from mdloader.threads import set_torch_threads

    workers = default_num_workers(num_workers, "--num-workers")
    set_torch_threads(workers, world=world)
    t0 = time.perf_counter()
    feed = Feed.build([config.training_data.stream("training", config.type_map)],
                      seed=config.seed, world=world, labels=BENCH_LABELS, num_workers=workers,
                      type_map=config.type_map)
    report = feed.report
    setup = time.perf_counter() - t0
    feed.start(0, TrainingLoop(displays=False))
    with feed:  # the workers end before the peak RSS of the children is read
        pulled = _pull(feed.stream(None, "training"), batches)
    return {
        "rank": world.rank, "world_size": world.world_size, "nsys": report.nsys,
        "num_workers": workers, "batches": batches, "setup_s": setup,
        "discover_s": report.discovery_seconds, "build_s": report.build_seconds,
        "bcast_s": report.broadcast_seconds, "bcast_MB": report.payload_bytes / 1e6,
        "first_s": pulled.first, "batch/s": pulled.rate(pulled.batches),
        "frame/s": pulled.rate(pulled.frames), "atom/s": pulled.rate(pulled.atoms),
        "rss_MB": _peak_rss_mb(resource.RUSAGE_SELF),
        "wrk_rss_MB": _peak_rss_mb(resource.RUSAGE_CHILDREN),
    }


@dataclass
class Pulled:
    """Batches pulled after the first one, in ``seconds``; ``first``: the wait for the first
    batch (worker start-up, the first reads), which the rates leave out."""

    first: float = 0.0
    seconds: float = 0.0
    batches: int = 0
    frames: int = 0
    atoms: int = 0

    def rate(self, count: int) -> float:
        return count / self.seconds if self.seconds > 0 else float("nan")


def _pull(stream: Iterable[dict[str, Any]], batches: int) -> Pulled:
    """Pull ``batches`` batches as the trainer does.

    The rates count from the first batch on: with workers, the wait for the first one is
    mostly their start-up, which would otherwise dominate a short run."""
    out = Pulled()
    stream = iter(stream)
    start = time.perf_counter()
    next(stream)
    steady = time.perf_counter()
    out.first = steady - start
    for batch in itertools.islice(stream, batches - 1):
        nframes = len(batch["fid"])
        out.batches += 1
        out.frames += nframes
        out.atoms += nframes * int(batch["atype"].shape[1])
    out.seconds = time.perf_counter() - steady
    return out


def format_bench_rows(rows: list[dict[str, Any]], *, as_json: bool = False) -> str:
    """A table (one line per rank) or JSON."""
    if as_json:
        return json.dumps(rows, indent=2)
    head = "  ".join(h.format(name) for name, h, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append("  ".join(f.format(row[name]) for name, _, f in COLUMNS))
    r0 = rows[0]
    wait = "mostly worker start-up" if r0["num_workers"] else "the first reads"
    lines.append(f"({r0['world_size']} rank(s), {r0['num_workers']} DataLoader worker(s) per "
                 f"rank, {r0['batches']} batches per rank; batch/s, frame/s and atom/s count "
                 f"from the first batch on: first_s, the wait for it, is {wait})")
    return "\n".join(lines)


# -- the sub-command ----------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader bench``'s parser."""
    p = sub.add_parser("bench", parents=[common], help="time the loader on an input.json",
                       description="Build the loader as training would and pull N batches "
                       "(per task, one task after the other, for a multi-task input) "
                       "through the outer DataLoader; report per rank. The rates count from the "
                       "first batch on; first_s, the wait for it, is mostly the start-up of the "
                       "DataLoader workers.")
    p.add_argument("input", help="DeePMD-kit input.json")
    p.add_argument("--batches", type=at_least(2), default=200,
                   help="batches to pull (default 200; at least 2: the rates leave the first "
                   "out)")
    p.add_argument("--num-workers", type=at_least(0), default=None,
                   help="DataLoader workers (default: NUM_WORKERS or min(4, cpus))")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args: argparse.Namespace) -> int:
    """Bench; rank 0 prints every rank's row."""
    from mdloader.config.multitask import JobConfig, load_job

    config = load_job(args.input)
    if isinstance(config, JobConfig):
        tasks = run_job_bench(config, batches=args.batches, num_workers=args.num_workers)
        if tasks is not None:
            print(json.dumps(tasks, indent=2) if args.json else "\n\n".join(
                f"=== task {name}\n" + format_bench_rows(rows) for name, rows in tasks.items()))
        return 0
    rows = run_bench(config, batches=args.batches, num_workers=args.num_workers)
    if rows is not None:  # rank 0 only: the gathered rows of every rank
        print(format_bench_rows(rows, as_json=args.json))
    return 0
