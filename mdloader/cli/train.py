"""``mdloader train``: the reference DDP training job (:mod:`mdloader.train`) as a sub-command.

Its parser, and its runner: the job runs inside :func:`session`, so that SIGTERM or SIGUSR1 sets
the stop flag for the whole run, teardown included, and a stopped job exits with
:data:`~mdloader.train.signals.EXIT_STOPPED` (143). torch is imported only when the job runs.
"""

from __future__ import annotations

import argparse

from mdloader.cli.arguments import at_least, positive_number
from mdloader.train.signals import EXIT_STOPPED, StopSignals


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader train``'s parser."""
    p = sub.add_parser("train", parents=[common], help="reference DDP training job",
                       description="Train a small energy/force potential with "
                       "DistributedDataParallel (one process per rank under torchrun).")
    p.add_argument("input", help="DeePMD-kit input.json")
    p.add_argument("--restart", default=None, metavar="CKPT",
                   help="continue from this checkpoint (model, optimizer and loader state), "
                   "on the same or on another number of ranks")
    p.add_argument("--numb-steps", type=at_least(0), default=None, metavar="N",
                   help="override training.numb_steps (0: only the statistics and the "
                   "untrained model, as DeePMD-kit)")
    p.add_argument("--stop-after", type=at_least(1), default=None, metavar="STEP",
                   help="stop after this step with a checkpoint (e.g. to fit a job's wall "
                   "time); continue later with --restart")
    p.add_argument("-o", "--output", default=".", metavar="DIR",
                   help="folder for lcurve.out and checkpoints (default: .)")
    p.add_argument("--num-workers", type=at_least(0), default=None,
                   help="DataLoader workers (default: NUM_WORKERS or min(4, cpus))")
    p.add_argument("--rcut", type=positive_number, default=4.0,
                   help="cutoff radius of the reference model in Angstrom (default: 4)")
    p.add_argument("--full-validation", action="store_true",
                   help="at every checkpoint, validate every validation frame once, shared by "
                   "the ranks; results in full_valid.out")
    p.add_argument("--nonfinite", choices=["stop", "skip"], default="stop",
                   help="a NaN/inf loss on any rank stops every rank with the step, system and "
                   "file (stop, the default), or every rank skips that step's update (skip)")


def session() -> StopSignals:
    """What the whole run, error reporting and teardown included, runs inside: a stop signal
    before the first training step ends the rank at once."""
    return StopSignals(at_once=True)


def run(args: argparse.Namespace) -> int:
    """Train; 143 when a stop signal ended the job after a checkpoint, else 0."""
    from mdloader.config.input_json import load_config
    from mdloader.train.job import ModelOptions, train

    result = train(load_config(args.input, mixed=True), output=args.output, restart=args.restart,
                   numb_steps=args.numb_steps, stop_after=args.stop_after,
                   num_workers=args.num_workers, options=ModelOptions(rcut=args.rcut),
                   full_validation=args.full_validation, nonfinite=args.nonfinite)
    return EXIT_STOPPED if result.stopped_by else 0
