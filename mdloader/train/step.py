"""One optimisation step of the reference job, and what the ranks agree on at its end.

The ranks must decide together, or they part: with DDP, a rank that skipped its update alone
would leave the replicas different, and one that stopped alone would leave the others waiting in
the next gradient all-reduce.

* **A non-finite loss** on any rank makes the averaged gradients non-finite on every rank, so
  every rank sees it after the backward pass without another collective (as mixed-precision
  loss scaling does). Then every rank stops with the line of the rank whose loss it was
  (``nonfinite="stop"``, the default), or every rank skips the update of that step (``"skip"``).
  Gradients that overflow from finite losses are caught the same way.
* **A stop signal** (:mod:`mdloader.train.signals`) is exchanged every ``check_every`` steps in
  one all-reduce of a flag; ``docs/benchmarks.md`` has what that costs per step.

A batch reaches the rank's device by :func:`~mdloader.transport.to_device`: on a GPU from the
pinned memory the feed's workers deliver into, without blocking the host.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.distributed.collectives import any_rank, fail_together
from mdloader.errors import ConfigError, DataError, NonFiniteError
from mdloader.settings import resolve
from mdloader.train.guards import batch_source, nonfinite_loss, small_box_in_batch
from mdloader.transport import to_device

log = logging.getLogger(__name__)

NONFINITE = ("stop", "skip")


@dataclass(frozen=True)
class StepOutcome:
    """The squared errors of this rank's batch, and what the ranks agreed on."""

    mse: dict[str, float]
    stop: bool  # a stop signal arrived on some rank
    skipped: bool  # the gradients were not finite, and no rank updated the weights


class Stepper:
    """Forward, the ranks' agreement, backward and update, for one rank.

    Parameters
    ----------
    model, ddp_model
        The model, and the same wrapped in ``DistributedDataParallel`` (or itself).
    loss
        ``loss(pred, labels, lr) -> (loss tensor, squared errors)``.
    nonfinite
        ``"stop"`` or ``"skip"`` (see the module docstring).
    check_every
        Steps between two exchanges of the stop flag (``$MDLOADER_STOP_CHECK_STEPS``).
    database
        The LMDB database of ``mix:N`` batches (their errors name it), else ``None``.
    """

    def __init__(self, model: torch.nn.Module, ddp_model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, loss: Callable[..., Any],
                 systems: Sequence[DeepmdDataSetForLoader], *, device: torch.device,
                 nonfinite: str = "stop", rank: int = 0, check_every: int | None = None,
                 database: str | None = None) -> None:
        if nonfinite not in NONFINITE:
            raise ConfigError(f"must be one of {list(NONFINITE)}, got {nonfinite!r}",
                              path="--nonfinite")
        self.model, self.ddp_model, self.optimizer, self.loss = model, ddp_model, optimizer, loss
        self.systems, self.device, self.nonfinite, self.rank = systems, device, nonfinite, rank
        self.database = database
        self.check_every = int(resolve("stop_check_steps", check_every, argument="check_every"))

    def forward(self, model: Any, batch: dict[str, Any], create_graph: bool,
                systems: Sequence[DeepmdDataSetForLoader] | None = None,
                database: str | None = None) -> dict[str, torch.Tensor]:
        """The model on ``batch``; a box too small for the cutoff names the batch's system of
        ``systems`` (or its ``database`` under ``mix:N``), the training data's by default."""
        box = batch["box"]
        try:
            return model(to_device(batch["coord"], self.device),
                         to_device(batch["atype"], self.device),
                         None if box is None else to_device(box, self.device),
                         create_graph=create_graph)
        except DataError as exc:  # a box too small for the cutoff (boxes read with the frames)
            if exc.system is not None or box is None:
                raise
            if systems is None:
                systems, database = self.systems, self.database
            raise small_box_in_batch(exc, batch, batch_source(systems, batch, database)) from exc

    def labels(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Energy and force as float64 on the device; for a padded ``mix:N`` batch (some
        ``atype < 0``, checked on the host copy) also ``real``, the mask of its real atoms."""
        labels = {k: to_device(batch[k], self.device, torch.float64) for k in ("energy", "force")}
        atype = torch.as_tensor(batch["atype"])
        if bool((atype < 0).any()):
            labels["real"] = to_device(atype >= 0, self.device)
        return labels

    def predict(self, batch: dict[str, Any],
                systems: Sequence[DeepmdDataSetForLoader] | None = None,
                database: str | None = None) -> tuple[dict[str, torch.Tensor],
                                                      dict[str, torch.Tensor]]:
        """Predictions without the DDP wrapper (validation: ``systems`` and ``database`` are
        the validation data's, for errors), and the labels."""
        pred = self.forward(self.model, batch, False, systems, database)
        return {k: v.detach() for k, v in pred.items()}, self.labels(batch)

    def step(self, batch: dict[str, Any], lr: float, done: int, stop_requested: bool
             ) -> StepOutcome:
        """Train on ``batch`` as step ``done`` (1-based), unless the gradients are not finite."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        pred = self.forward(self.ddp_model, batch, create_graph=True)
        loss, mse = self.loss(pred, self.labels(batch), lr)
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # The [1, H] output weight gets a grad with strides (1, 1) instead of (H, 1): the
            # same memory layout for a size-1 dimension, yet DDP's reducer warns once per rank.
            warnings.filterwarnings("ignore", message="Grad strides do not match bucket view")
            loss.backward()
        skipped = not self.gradients_finite()  # the same on every rank: DDP averaged them
        if skipped:
            self._nonfinite(batch, mse["mse"], done)
        else:
            self.optimizer.step()
        stop = done % self.check_every == 0 and any_rank(
            [stop_requested], activity=f"training step {done}")[0]
        return StepOutcome(mse, stop, skipped)

    def gradients_finite(self) -> bool:
        """Whether every gradient is finite (one device synchronisation)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def _nonfinite(self, batch: dict[str, Any], loss: float, done: int) -> None:
        """Stop every rank with the line of the first rank whose loss was not finite (or of
        gradients that overflowed), or log what every rank skipped."""
        mine = None if math.isfinite(loss) else nonfinite_loss(
            batch, batch_source(self.systems, batch, self.database), loss=loss, step=done,
            rank=self.rank)
        diverged = NonFiniteError(f"the gradients are not finite at step {done}, the losses "
                                  "are: the model diverged (try a smaller "
                                  "learning_rate.start_lr)")
        if self.nonfinite == "stop":
            fail_together(mine, context=f"training step {done}")
            fail_together(diverged if self.rank == 0 else None,
                          context=f"training step {done}")
        if mine is not None:
            log.warning("step %d skipped on every rank (--nonfinite skip): %s", done, mine)
        elif self.rank == 0:
            log.warning("step %d skipped on every rank (--nonfinite skip): the gradients are "
                        "not finite (a rank whose loss was not says why)", done)
