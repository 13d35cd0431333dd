"""One optimisation step of the reference job, and what the ranks agree on at its end.

Every step exchanges two flags between the ranks in one tiny all-reduce: "a stop signal arrived
here" and "my loss is not finite". So every rank stops after the same step, and a non-finite loss
on any rank either stops every rank with the same line (``nonfinite="stop"``, the default) or
makes every rank skip the update of that step (``"skip"``). The ranks must decide together: with
DDP, a rank that skipped its backward alone would leave the others waiting in the gradient
all-reduce, and one that updated alone would leave the replicas different.
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
from mdloader.errors import ConfigError
from mdloader.train.faults import nonfinite_loss

log = logging.getLogger(__name__)

NONFINITE = ("stop", "skip")


@dataclass(frozen=True)
class StepOutcome:
    """The squared errors of this rank's batch, and what the ranks agreed on."""

    mse: dict[str, float]
    stop: bool  # a stop signal arrived on some rank
    skipped: bool  # a loss was not finite on some rank, and nobody updated the weights


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
    """

    def __init__(self, model: torch.nn.Module, ddp_model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, loss: Callable[..., Any],
                 systems: Sequence[DeepmdDataSetForLoader], *, device: torch.device,
                 nonfinite: str = "stop", rank: int = 0) -> None:
        if nonfinite not in NONFINITE:
            raise ConfigError(f"must be one of {list(NONFINITE)}, got {nonfinite!r}",
                              path="--nonfinite")
        self.model, self.ddp_model, self.optimizer, self.loss = model, ddp_model, optimizer, loss
        self.systems, self.device, self.nonfinite, self.rank = systems, device, nonfinite, rank

    def forward(self, model: Any, batch: dict[str, Any], create_graph: bool
                ) -> dict[str, torch.Tensor]:
        box = batch["box"]
        return model(batch["coord"].to(self.device), batch["atype"].to(self.device),
                     None if box is None else box.to(self.device), create_graph=create_graph)

    def labels(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: batch[k].to(self.device, torch.float64) for k in ("energy", "force")}

    def predict(self, batch: dict[str, Any]) -> tuple[dict[str, torch.Tensor],
                                                        dict[str, torch.Tensor]]:
        """Predictions without the DDP wrapper (validation), and the labels."""
        pred = self.forward(self.model, batch, create_graph=False)
        return {k: v.detach() for k, v in pred.items()}, self.labels(batch)

    def step(self, batch: dict[str, Any], lr: float, done: int, stop_requested: bool
             ) -> StepOutcome:
        """Train on ``batch`` as step ``done`` (1-based), unless a loss is not finite."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        pred = self.forward(self.ddp_model, batch, create_graph=True)
        loss, mse = self.loss(pred, self.labels(batch), lr)
        finite = math.isfinite(mse["mse"])
        stop, nonfinite = any_rank([stop_requested, not finite],
                                   activity=f"training step {done}")
        if nonfinite:
            self._nonfinite(batch, mse["mse"], done, finite)
            return StepOutcome(mse, stop, skipped=True)
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # The [1, H] output weight gets a grad with strides (1, 1) instead of (H, 1): the
            # same memory layout for a size-1 dimension, yet DDP's reducer warns once per rank.
            warnings.filterwarnings("ignore", message="Grad strides do not match bucket view")
            loss.backward()
        self.optimizer.step()
        return StepOutcome(mse, stop, skipped=False)

    def _nonfinite(self, batch: dict[str, Any], loss: float, done: int, finite: bool) -> None:
        mine = None if finite else nonfinite_loss(batch, self.systems[int(batch["sid"])],
                                                  loss=loss, step=done, rank=self.rank)
        if self.nonfinite == "stop":
            fail_together(mine, context=f"training step {done}")
        if mine is not None:
            log.warning("step %d skipped on every rank (--nonfinite skip): %s", done, mine)
