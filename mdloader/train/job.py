"""``mdloader train``: the reference DDP training job that exercises the loader as DeePMD-kit does.

One process per rank (``torchrun``); the process group starts only when ``WORLD_SIZE`` > 1, with
NCCL on GPUs and gloo on CPUs. Every rank builds the job's feed
(:class:`~mdloader.loading.feed.Feed`: one build of the training and validation data; rank 0
reads the data tree, the others receive metadata), takes its batches from the feed's streams,
read ahead by one pool of DataLoader workers, and steps a
:class:`~mdloader.train.model.RadialPotential` wrapped in ``DistributedDataParallel``; its
statistics (energy bias, feature scales) are computed before the first step in shares by every
rank, cached per system (:mod:`mdloader.train.statistics`).
Rank 0 writes ``lcurve.out`` and the checkpoints; ``restart`` resumes model, optimizer and the
loader streams: on the same number of ranks the batches after the restart are exactly those an
uninterrupted run would have drawn, on another number the job resumes elastically
(:mod:`mdloader.train.io`). Validation is in :mod:`mdloader.train.validation`, one step in
:mod:`mdloader.train.step`. Under ``batch_size: "mix:N"`` (one LMDB database) the batches are
DeePMD-kit 3.2's padded ``mix:N`` batches, and the statistics, box checks and summary read the
stream's ``max:N`` view of the same systems (:attr:`~mdloader.loading.feed.Stream.systems_view`).

Failures: before the first step every box is checked against the cutoff
(:mod:`mdloader.train.guards`); a SIGTERM or SIGUSR1 stops every rank after the same step with a
checkpoint, or at once before the first step, or cuts a full validation, which the restart then
runs first (:mod:`mdloader.train.signals`); a failure on one rank ends the job at once with one
line on every rank (:mod:`mdloader.distributed.failure`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm.contrib.logging import logging_redirect_tqdm

from mdloader import logs
from mdloader.config.input_json import Config, DataConfig
from mdloader.data.formats import release_handles
from mdloader.data.schema import DataRequirementItem
from mdloader.distributed.collectives import (
    all_reduce_mean,
    any_rank,
    broadcast_from_main,
    fail_together,
)
from mdloader.distributed.failure import Activity
from mdloader.distributed.group import process_group, use_device
from mdloader.errors import ConfigError, StateDictError, WriteError
from mdloader.loading import feed_state
from mdloader.loading.feed import Feed, Stream, StreamSpec
from mdloader.loading.loader import default_num_workers
from mdloader.loading.pool import lost_worker_error
from mdloader.sampling.loop import TrainingLoop
from mdloader.sampling.mixed import is_mixed_rule
from mdloader.threads import set_torch_threads
from mdloader.train.guards import check_boxes, nonfinite_weights
from mdloader.train.io import (
    FullValidationLog,
    Lcurve,
    check_output,
    load_checkpoint,
    restart_note,
    save_checkpoint,
)
from mdloader.train.model import RadialPotential
from mdloader.train.objective import EnergyForceLoss, ExpDecayLR, resolve_numb_steps, rmse_columns
from mdloader.train.signals import StopSignals, stop_at_once
from mdloader.train.statistics import fit_statistics
from mdloader.train.step import Stepper
from mdloader.train.validation import FullValidation, Validation
from mdloader.world import World

log = logging.getLogger(__name__)

LABELS = [DataRequirementItem("energy", 1, atomic=False, must=True, high_prec=True),
          DataRequirementItem("force", 3, atomic=True, must=True)]


def _stream_specs(config: Config) -> list[StreamSpec]:
    """The job's streams: its training data, and its validation data under the job seed + 1."""
    specs = [config.training_data.stream("training", config.type_map)]
    if config.validation_data is not None:
        specs.append(config.validation_data.stream("validation", config.type_map,
                                                   seed_offset=1))
    return specs


@dataclass(frozen=True)
class ModelOptions:
    """Size of the reference model (kept small: the job is about the loader)."""

    rcut: float = 4.0
    nbasis: int = 16
    hidden: tuple[int, ...] = (32, 32)


@dataclass
class TrainResult:
    """What one rank did: the last step, files written (rank 0), batches it trained on, and the
    signal that stopped the run early (``None`` when it ran to its end)."""

    step: int
    lcurve: str | None = None
    checkpoint: str | None = None
    batches: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    last_train: dict[str, float] = field(default_factory=dict)
    last_valid: dict[str, float] | None = None
    full_valid: list[FullValidation] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    stopped_by: str | None = None


def train(config: Config, *, output: str = ".", restart: str | None = None,
          numb_steps: int | None = None, stop_after: int | None = None,
          num_workers: int | None = None, options: ModelOptions = ModelOptions(),
          full_validation: bool = False, nonfinite: str = "stop") -> TrainResult:
    """Train; ``stop_after`` ends this run early (with a checkpoint) as a job time limit would;
    ``full_validation`` validates every validation frame at every checkpoint; ``nonfinite``
    says what a non-finite loss does (:mod:`mdloader.train.step`)."""
    if full_validation and config.validation_data is None:
        raise ConfigError("--full-validation needs validation data",
                          path="training.validation_data")
    if full_validation and is_mixed_rule(config.validation_data.sampling.batch_size):
        raise ConfigError("a full validation reads the validation systems frame by frame, not "
                          "in mix:N batches: give the validation data a batch size of its own "
                          "(e.g. 1, or 'auto'), or train without --full-validation",
                          path="training.validation_data.batch_size")
    if stop_after is not None and stop_after < 1:
        raise ConfigError(f"must be a positive step, got {stop_after}", path="--stop-after")
    if numb_steps is not None and numb_steps < 0:
        raise ConfigError(f"must be an integer >= 0, got {numb_steps}", path="--numb-steps")
    check_output(output)
    activity = Activity("building the loader")
    with ExitStack() as group:
        # Nothing to save before the first step: a signal ends the run, one received since the
        # command started (while torch was imported, say) included, before it joins the group.
        with stop_at_once():
            world = group.enter_context(process_group(activity))
            trainer = _Trainer(config, world, output=output, numb_steps=numb_steps,
                               num_workers=num_workers, options=options,
                               full_validation=full_validation, activity=activity)
            trainer.prepare(restart, nonfinite)
        return trainer.run(restart, stop_after)


class _Trainer:
    """State of one training run on one rank (created by :func:`train`)."""

    def __init__(self, config: Config, world: World, *, output: str, numb_steps: int | None,
                 num_workers: int | None, options: ModelOptions, full_validation: bool,
                 activity: Activity) -> None:
        self.config, self.world, self.output, self.options = config, world, output, options
        self.full_validation, self.activity = full_validation, activity
        self.started = (time.monotonic(), 0)  # when the loop started, and from which step
        self.start, self.validation_due = 0, False  # a restart's step; a validation it owes
        self.device = use_device(world)  # before the feed: its pinning thread uses it too
        workers = default_num_workers(num_workers, "--num-workers")
        set_torch_threads(workers, world=world)
        self.feed = Feed.build(_stream_specs(config), seed=config.seed, world=world,
                               labels=LABELS, num_workers=workers,
                               pin_memory=self.device.type == "cuda", type_map=config.type_map,
                               systems_views=True)
        self.train_stream = self.feed.stream(None, "training")
        self.train_set, weights = self.train_stream.systems()
        sampler = self.train_stream.sampler
        if self.train_stream.systems_view is None:
            self.numb_steps = resolve_numb_steps(config, numb_steps, self.train_set.index,
                                                 sampler.weights.numpy())
        else:  # mix:N: an epoch is a pass of the stream's batches
            self.numb_steps = resolve_numb_steps(config, numb_steps,
                                                 [sampler.steps_in_pass(0)], np.ones(1))
        self.train_set.print_summary("training", weights)
        self.database = self._database(self.train_stream, config.training_data)
        self.numb_steps_given = numb_steps is not None or config.numb_steps is not None
        self.valid = None if config.validation_data is None else Validation(
            self.feed, numb_btch=config.validation_data.numb_btch)
        self.resumed: dict[str, Any] | None = None  # a restart's loader state
        self.schedule = ExpDecayLR.from_config(config.learning_rate, self.numb_steps)
        self.loss_fn = EnergyForceLoss.from_config(config.loss, self.schedule.start_lr)
        ntypes = len(config.type_map) if config.type_map else max(
            s.meta.ntypes for s in self.train_set.systems)
        self.model_args = {"ntypes": ntypes, "rcut": options.rcut, "nbasis": options.nbasis,
                           "hidden": list(options.hidden)}
        with torch.random.fork_rng(devices=[]):  # seeded init, no global side effect
            if config.seed is not None:
                torch.manual_seed(config.seed)
            self.model = RadialPotential(ntypes, rcut=options.rcut, nbasis=options.nbasis,
                                         hidden=options.hidden).to(self.device)

    def prepare(self, restart: str | None, nonfinite: str) -> None:
        """Everything before the first step: checks, statistics or the restored checkpoint."""
        self.activity.doing = "checking every box against the model cutoff"
        valid = self.valid.systems if self.valid is not None else []
        check_boxes([*self.train_set.systems, *valid], self.options.rcut, self.world)
        if restart is None:
            self.activity.doing = "computing the model statistics"
            self._statistics()
        release_handles()  # training reopens (and checks again) what the checks read
        ddp_model = (DistributedDataParallel(self.model) if self.world.distributed
                     else self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.schedule.start_lr)
        self.stepper = Stepper(self.model, ddp_model, self.optimizer, self.loss_fn,
                               self.train_set.systems, device=self.device, nonfinite=nonfinite,
                               rank=self.world.rank, database=self.database)
        self.predict = self.stepper.predict if self.valid is None else functools.partial(
            self.stepper.predict, systems=self.valid.systems, database=self._database(
                self.valid.stream, self.config.validation_data))
        self.start = 0 if restart is None else self._restore(restart)

    @staticmethod
    def _database(stream: Stream, data: DataConfig | None) -> str | None:
        """The LMDB database of a ``mix:N`` stream, as the input names it (its errors name
        it), else ``None``."""
        return None if stream.systems_view is None or data is None else data.systems[0]

    def run(self, restart: str | None, stop_after: int | None) -> TrainResult:
        """Open the logs and train from the start step (a restart's: its checkpoint's)."""
        step = self.start
        self.activity.doing = f"opening the logs in {self.output}"
        self._open_logs(restart, step)
        try:
            self.feed.start(step, self._loop_shape(), self.resumed, stall_dir=self.output)
            result = self._loop(step, stop_after)
            self.feed.finish()
            return result
        except RuntimeError as exc:  # torch notices a dead worker wherever the loop is
            lost = lost_worker_error()
            if lost is None:
                raise
            raise lost from exc
        finally:
            self.feed.close()
            if self.lcurve is not None:
                self.lcurve.close()

    def _open_logs(self, restart: str | None, step: int) -> None:
        """``lcurve.out`` (and ``full_valid.out``) on rank 0; a restart first drops the lines
        after its checkpoint's step, written by a run that went on without saving."""
        after = step if restart is not None else None
        self.lcurve = (Lcurve(os.path.join(self.output, self.config.disp_file),
                              with_validation=self.valid is not None, after=after)
                       if self.world.is_main else None)
        self.full_log = (FullValidationLog(os.path.join(self.output, "full_valid.out"),
                                           after=after)
                         if self.world.is_main and self.full_validation else None)

    def _statistics(self) -> None:
        """Energy bias and feature scales, in shares on every rank (collective)."""
        fit_statistics(self.model, self.train_set, nbatch=self.config.data_stat_nbatch,
                       device=self.device)

    def _restore(self, path: str) -> int:
        self.activity.doing = f"restoring the checkpoint {path}"
        state = load_checkpoint(path)
        self.validation_due = bool(state.get("full_validation_due"))
        if state["model_args"] != self.model_args:
            raise StateDictError(f"checkpoint {path} holds a model {state['model_args']} but "
                                 f"this run builds {self.model_args}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.resumed = feed_state.from_training_checkpoint(state)
        if not self.numb_steps_given and state["numb_steps"] != self.numb_steps:
            # numb_epoch: the step count depends on the world size; the job keeps its first one
            self.numb_steps = int(state["numb_steps"])
            self.schedule = ExpDecayLR.from_config(self.config.learning_rate, self.numb_steps)
        log.info("%s", restart_note(path, self.resumed, self.world.world_size))
        return int(state["step"])

    def _loop_shape(self) -> TrainingLoop:
        """What the loop asks for at each step (the feed's workers read it ahead)."""
        return TrainingLoop(disp_freq=self.config.disp_freq, last_display=self.numb_steps,
                            validation=(self.valid.numb_btch if self.valid else 0,))

    def _loop(self, start: int, stop_after: int | None) -> TrainResult:
        result = TrainResult(step=start)
        end = self.numb_steps if stop_after is None else min(self.numb_steps, stop_after)
        bar = logs.bar(total=self.numb_steps, initial=start, disable=True if not self.world.is_main
                   else None, desc="train", unit="step", dynamic_ncols=True)
        self.started = time.monotonic(), start
        # in a terminal, log lines go above the bar instead of onto its line
        with logging_redirect_tqdm([logging.getLogger("mdloader")]), StopSignals() as signals:
            if any_rank([signals.requested], activity="starting to train")[0]:
                end = start  # a signal came before the first step: nothing to train or save
                self._stopped(start, signals, result)
            elif self._validation_missed(start) and not self._validate_fully(start, result,
                                                                              signals):
                end = start  # cut again by a signal: the next restart validates it
                self._stopped(start, signals, result)
            for step in range(start, end):
                done = step + 1
                self.activity.doing = f"training step {done}"
                lr = self.schedule.value(step)
                with self.feed.training_step():
                    batch = next(self.train_stream)
                result.batches.append((step, int(batch["sid"]), tuple(batch["fid"])))
                outcome = self.stepper.step(batch, lr, done, signals.requested)
                if outcome.skipped:
                    result.skipped.append(done)
                if done % self.config.disp_freq == 0 or done == 1 or done == self.numb_steps:
                    self._display(done, lr, outcome.mse, result, bar)
                saved = done % self.config.save_freq == 0 or done == end
                stop = outcome.stop
                if saved or stop:
                    result.checkpoint = self._save(done, validation_due=saved)
                if saved and self.full_validation and not stop:
                    stop = not self._validate_fully(done, result, signals)
                result.step = done
                bar.update(1)
                if stop:
                    self._stopped(done, signals, result)
                    break
        bar.close()
        if self.numb_steps == 0 == start:  # DeePMD-kit's numb_steps 0: the untrained model
            result.checkpoint = self._save(0)
        if self.lcurve is not None:
            result.lcurve = self.lcurve.path
        return result

    def _stopped(self, done: int, signals: StopSignals, result: TrainResult) -> None:
        result.stopped_by = signals.received or "a signal on another rank"
        if not self.world.is_main:
            return
        if result.checkpoint is None:
            log.warning("stopped before training step %d (%s): nothing new to save", done + 1,
                        result.stopped_by)
        else:
            log.warning("stopped after step %d (%s): continue with --restart %s", done,
                        result.stopped_by, result.checkpoint)

    def _validation_missed(self, step: int) -> bool:
        """Whether this restart's checkpoint was due a full validation that ``full_valid.out``
        lacks (a signal cut it, or came at its step): then it runs before the first step."""
        if not (self.full_validation and self.validation_due):
            return False
        missing = self.full_log.missing(step) if self.full_log is not None else None
        return bool(broadcast_from_main(missing, context="checking full_valid.out"))

    def _validate_fully(self, done: int, result: TrainResult, signals: StopSignals) -> bool:
        """The full validation at step ``done``; False when a stop signal on some rank cut it
        (then no line is written: the restart validates this step first)."""
        self.activity.doing = f"the full validation at step {done}"
        if self.world.is_main:
            log.info("full validation at step %d: started", done)
        full = self.valid.full(self.predict, done,  # type: ignore[union-attr]
                               stop=lambda: signals.requested)
        if full is None:
            if self.world.is_main:
                log.warning("full validation at step %d cut by a stop signal", done)
            return False
        result.full_valid.append(full)
        if self.full_log is not None:
            self.full_log.write(done, full.rmse_e, full.rmse_f, full.frames, full.seconds)
            log.info("full validation at step %d: rmse_e %.4e, rmse_f %.4e over %d frames "
                     "(%.2f s on %d rank(s))", done, full.rmse_e, full.rmse_f, full.frames,
                     full.seconds, self.world.world_size)
        return True

    def _display(self, done: int, lr: float, mse: dict[str, float], result: TrainResult,
                 bar: Any) -> None:
        trn = all_reduce_mean([mse["mse"], mse["mse_e"], mse["mse_f"]])
        result.last_train = rmse_columns(dict(zip(("mse", "mse_e", "mse_f"), trn)))
        if self.valid is not None:
            self.activity.doing = f"the validation at step {done}"
            result.last_valid = self.valid.partial(
                self.predict, lambda pred, label: self.loss_fn(pred, label, lr))
        if self.lcurve is not None:
            self.lcurve.write(done, lr, result.last_train, result.last_valid)
            bar.set_postfix(rmse_f=f"{result.last_train['rmse_f']:.3g}", lr=f"{lr:.1e}")
            if bar.disable:  # no bar (output to a file or a pipe): a line at every display
                since, first = self.started
                rate = (done - first) / max(time.monotonic() - since, 1e-9)
                log.info("step %d/%d: rmse_f_trn %.3g, lr %.1e (%.2f steps/s)", done,
                         self.numb_steps, result.last_train["rmse_f"], lr, rate)
            log.debug("step %d: train %s valid %s", done, result.last_train, result.last_valid)

    def _save(self, done: int, *, validation_due: bool = False) -> str | None:
        self.activity.doing = f"saving the checkpoint of step {done}"
        fail_together(nonfinite_weights(self.model, done), context=self.activity.doing)
        loader_state = self.feed.gather_state()
        path, failed = None, None
        if loader_state is not None:  # rank 0 writes; a write error is every rank's, not a hang
            state = {"world_size": self.world.world_size, "model": self.model.state_dict(),
                     "optimizer": self.optimizer.state_dict(), "loader_state": loader_state,
                     "model_args": self.model_args, "numb_steps": self.numb_steps,
                     "full_validation_due": validation_due and self.full_validation}
            try:
                path = save_checkpoint(self.output, self.config.save_ckpt, done, state)
            except WriteError as exc:
                failed = exc
        fail_together(failed, context=self.activity.doing)
        if path is not None:
            log.info("saved checkpoint %s", path)
        return path
