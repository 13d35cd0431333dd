"""DeePMD-kit's learning-rate schedule and energy/force loss, as small pure pieces.

Both follow DeePMD-kit's PyTorch backend so that the numbers in ``lcurve.out`` mean the same
thing: the learning rate decays exponentially in steps of ``decay_steps`` to reach ``stop_lr``
at the last step, and the loss prefactors move from ``start_pref_*`` to ``limit_pref_*`` in
proportion to ``lr / start_lr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import LearningRateConfig, LossConfig
from .errors import ConfigError


@dataclass(frozen=True)
class ExpDecayLR:
    """``lr(step) = max(stop_lr, start_lr * rate ** (step // decay_steps))``.

    As in DeePMD-kit, a ``decay_steps`` not smaller than the run is replaced by a default
    (100, or ``numb_steps // 100 + 1`` for short runs) so that short runs still decay.
    """

    start_lr: float
    stop_lr: float
    decay_steps: int
    decay_rate: float

    @classmethod
    def from_config(cls, cfg: LearningRateConfig, numb_steps: int) -> "ExpDecayLR":
        if cfg.type != "exp":
            raise ConfigError(f"mdloader train implements the 'exp' schedule only, found "
                              f"'{cfg.type}'", path="learning_rate.type")
        decay = cfg.decay_steps
        if decay >= numb_steps:
            decay = 100 if numb_steps // 10 > 100 else numb_steps // 100 + 1
        rate = math.exp(math.log(cfg.stop_lr / cfg.start_lr) / (numb_steps / decay))
        return cls(float(cfg.start_lr), float(cfg.stop_lr), int(decay), rate)

    def value(self, step: int) -> float:
        return max(self.stop_lr, self.start_lr * self.decay_rate ** (step // self.decay_steps))


@dataclass(frozen=True)
class EnergyForceLoss:
    """DeePMD-kit's ``ener`` loss restricted to energy and force."""

    start_pref_e: float
    limit_pref_e: float
    start_pref_f: float
    limit_pref_f: float
    start_lr: float

    @classmethod
    def from_config(cls, cfg: LossConfig, start_lr: float) -> "EnergyForceLoss":
        if cfg.type != "ener":
            raise ConfigError(f"mdloader train implements the 'ener' loss only, found "
                              f"'{cfg.type}'", path="loss.type")
        return cls(cfg.start_pref_e, cfg.limit_pref_e, cfg.start_pref_f, cfg.limit_pref_f,
                   start_lr)

    def prefactors(self, lr: float) -> tuple[float, float]:
        coef = lr / self.start_lr
        return (self.limit_pref_e + (self.start_pref_e - self.limit_pref_e) * coef,
                self.limit_pref_f + (self.start_pref_f - self.limit_pref_f) * coef)

    def __call__(self, pred: dict[str, torch.Tensor], label: dict[str, torch.Tensor],
                 lr: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and the squared errors lcurve needs (``mse_e`` per atom, ``mse_f``)."""
        pref_e, pref_f = self.prefactors(lr)
        natoms = label["force"].shape[1]
        l2_e = torch.mean(torch.square(pred["energy"] - label["energy"].reshape(-1, 1)))
        l2_f = torch.mean(torch.square(pred["force"] - label["force"]))
        loss = pref_e * l2_e / natoms + pref_f * l2_f
        metrics = {"mse": float(loss.detach()), "mse_e": float(l2_e.detach()) / natoms ** 2,
                   "mse_f": float(l2_f.detach())}
        return loss, metrics


def rmse_columns(mse: dict[str, float]) -> dict[str, float]:
    """``rmse``, ``rmse_e`` (per atom) and ``rmse_f`` from averaged squared errors."""
    return {"rmse": math.sqrt(mse["mse"]), "rmse_e": math.sqrt(mse["mse_e"]),
            "rmse_f": math.sqrt(mse["mse_f"])}
