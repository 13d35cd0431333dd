"""``mdloader report RUN_DIR``: the data stalls of a run, as text and as a picture.

Reads the ``stalls.jsonl`` that rank 0 of ``mdloader train`` or ``mdloader dp`` wrote beside
``lcurve.out`` (:mod:`mdloader.loading.stalls`): prints a summary (how much of the step time
was spent waiting for data, the median and 99th-percentile wait, the rank that waited most and
the windows it did), and with matplotlib (``pip install "mdloader[report]"``) draws
``stalls.png``: the wait per step of every rank, the bytes (of arrays, from storage) and files
opened per step, and the slowest rank's batch cost against the mean.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from mdloader.errors import ConfigError, DataError

PICTURE = "stalls.png"


def read_records(run_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The windows and the summaries of ``run_dir``'s ``stalls.jsonl`` (a restarted run
    appends, so there may be several summaries)."""
    from mdloader.loading.stalls import FILE_NAME

    path = os.path.join(run_dir, FILE_NAME)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} does not exist: give the folder of a run's lcurve.out (the "
                          "output folder of mdloader train, the working folder of mdloader dp)",
                          path="RUN_DIR")
    windows, summaries = [], []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"line {number} is not JSON ({exc.msg})", file=path) from None
            kind = record.get("kind") if isinstance(record, dict) else None
            if kind not in ("window", "summary"):
                raise DataError(f"line {number} is not a stall record (kind {kind!r})",
                                file=path)
            (windows if kind == "window" else summaries).append(record)
    if not windows:
        raise DataError("no stall report in it yet (rank 0 writes one every "
                        "$MDLOADER_STALL_REPORT steps, else every disp_freq steps)", file=path)
    return windows, summaries


def text_summary(windows: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> str:
    """What the report says, in a few lines."""
    steps = sum(w["last_step"] - w["first_step"] + 1 for w in windows)
    worst = max(windows, key=lambda w: w["wait_share"])
    skewed = max(windows, key=lambda w: w["skew"])
    lines = [f"{len(windows)} reports over {steps} steps, {windows[-1]['ranks']} ranks"]
    if summaries:
        s = summaries[-1]
        lines.append(f"waited {s['wait_share']:.1%} of step time; wait per step "
                     f"{s['wait_ms_p50']:.3g} ms median, {s['wait_ms_p99']:.3g} ms p99; rank "
                     f"{s['worst_rank']} waited most ({s['worst_rank_wait_share']:.1%})")
    lines += [
        f"most waiting: steps {worst['first_step']}-{worst['last_step']}, "
        f"{worst['wait_share']:.1%} (slowest rank {worst['slowest_rank']})",
        f"most skewed: steps {skewed['first_step']}-{skewed['last_step']}, the slowest rank's "
        f"batch cost {skewed['skew']:.2f}x the mean (rank {skewed['slowest_rank']})",
        f"main process per batch: {min(w['main_ms_per_batch'] for w in windows):.3g} to "
        f"{max(w['main_ms_per_batch'] for w in windows):.3g} ms",
    ]
    return "\n".join(lines)


def draw(windows: list[dict[str, Any]], out: str) -> str:
    """Draw the three panels to ``out``; the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps = [w["last_step"] for w in windows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True, constrained_layout=True)
    waits = np.array([w["rank_wait_ms"] for w in windows])
    if waits.shape[1] <= 16:
        for rank in range(waits.shape[1]):
            axes[0].plot(steps, waits[:, rank], marker=".", label=f"rank {rank}")
        axes[0].legend(fontsize="small", ncol=4)
    else:  # many ranks: one row of colour per rank
        image = axes[0].imshow(waits.T, aspect="auto", origin="lower", interpolation="nearest",
                               extent=(steps[0], steps[-1], -0.5, waits.shape[1] - 0.5))
        fig.colorbar(image, ax=axes[0], label="ms")
    axes[0].set_ylabel("wait per step (ms)" if waits.shape[1] <= 16 else "rank")
    axes[0].set_title("data stalls")
    axes[1].plot(steps, [w["payload_bytes_per_step"] / 1e3 for w in windows], marker=".",
                 label="arrays (kB)")
    axes[1].plot(steps, [w["storage_bytes_per_step"] / 1e3 for w in windows], marker=".",
                 label="from storage (kB)")
    axes[1].plot(steps, [w["opens_per_step"] for w in windows], marker=".",
                 label="files opened")
    axes[1].set_ylabel("per step and rank")
    axes[1].legend(fontsize="small")
    axes[2].plot(steps, [w["skew"] for w in windows], marker=".")
    axes[2].axhline(1.0, color="grey", linewidth=0.8)
    axes[2].set_ylabel("slowest rank / mean")
    axes[2].set_xlabel("step")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run_report(run_dir: str, *, plot: bool = True) -> int:
    """Print the summary of ``run_dir``'s stall report and draw its picture; exit code 0."""
    windows, summaries = read_records(run_dir)
    print(text_summary(windows, summaries))
    if not plot:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('no picture: matplotlib is not installed (pip install "mdloader[report]")')
        return 0
    print(f"picture: {draw(windows, os.path.join(run_dir, PICTURE))}")
    return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader report``'s parser."""
    p = sub.add_parser("report", parents=[common], help="the data stalls of a run (text, plot)",
                       description="Summarise the data-stall report (stalls.jsonl) that "
                       "mdloader train and mdloader dp write beside lcurve.out, and draw it "
                       "to stalls.png with matplotlib.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the folder of the run's lcurve.out")
    p.add_argument("--no-plot", action="store_true", help="the text summary only")


def run(args: argparse.Namespace) -> int:
    """The exit code of :func:`run_report`."""
    return run_report(args.run_dir, plot=not args.no_plot)
