"""DeePMD-kit's learning-rate schedule and energy/force loss, as small pure pieces.

Both follow DeePMD-kit's PyTorch backend so that the numbers in ``lcurve.out`` mean the same
thing: the learning rate decays exponentially in steps of ``decay_steps`` to reach ``stop_lr``
at the last step, and the loss prefactors move from ``start_pref_*`` to ``limit_pref_*`` in
proportion to ``lr / start_lr``. The number of steps follows DeePMD-kit too, including its
conversion from ``numb_epoch``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mdloader.config.input_json import Config, LearningRateConfig, LossConfig
from mdloader.errors import ConfigError


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
    def from_config(cls, cfg: LearningRateConfig, numb_steps: int) -> ExpDecayLR:
        if cfg.type != "exp":
            raise ConfigError(f"mdloader train implements the 'exp' schedule only, found "
                              f"'{cfg.type}'", path="learning_rate.type")
        decay = cfg.decay_steps
        if decay >= numb_steps:
            decay = 100 if numb_steps // 10 > 100 else numb_steps // 100 + 1
        rate = math.exp(math.log(cfg.stop_lr / cfg.start_lr) / (max(numb_steps, 1) / decay))
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
    def from_config(cls, cfg: LossConfig, start_lr: float) -> EnergyForceLoss:
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
        """Loss and the squared errors lcurve needs (``mse_e`` per atom, ``mse_f``).

        A padded ``mix:N`` batch carries ``label["real"]`` (``[frames, atoms]``, False on the
        padded slots): then, as DeePMD-kit's masked loss, each frame's energy error is divided
        by its own atom count and the force error averaged over the real atoms only; on a batch
        without padding both equal the plain form."""
        pref_e, pref_f = self.prefactors(lr)
        if "real" in label:
            return self._masked(pred, label, pref_e, pref_f)
        natoms = label["force"].shape[1]
        l2_e = torch.mean(torch.square(pred["energy"] - label["energy"].reshape(-1, 1)))
        l2_f = torch.mean(torch.square(pred["force"] - label["force"]))
        loss = pref_e * l2_e / natoms + pref_f * l2_f
        metrics = {"mse": float(loss.detach()), "mse_e": float(l2_e.detach()) / natoms ** 2,
                   "mse_f": float(l2_f.detach())}
        return loss, metrics

    @staticmethod
    def _masked(pred: dict[str, torch.Tensor], label: dict[str, torch.Tensor], pref_e: float,
                pref_f: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of a padded batch: per-frame atom counts, padded atoms left out."""
        real = label["real"]
        natoms = real.sum(dim=1).to(torch.float64)  # [frames]
        se = torch.square(pred["energy"].reshape(-1) - label["energy"].reshape(-1))
        l2_e, mse_e = torch.mean(se / natoms), torch.mean(se / natoms ** 2)
        sf = torch.square(pred["force"] - label["force"]) * real.unsqueeze(-1)
        l2_f = torch.sum(sf) / (3 * torch.sum(natoms))
        loss = pref_e * l2_e + pref_f * l2_f
        metrics = {"mse": float(loss.detach()), "mse_e": float(mse_e.detach()),
                   "mse_f": float(l2_f.detach())}
        return loss, metrics


def rmse_columns(mse: dict[str, float]) -> dict[str, float]:
    """``rmse``, ``rmse_e`` (per atom) and ``rmse_f`` from averaged squared errors."""
    return {"rmse": math.sqrt(mse["mse"]), "rmse_e": math.sqrt(mse["mse_e"]),
            "rmse_f": math.sqrt(mse["mse_f"])}


def resolve_numb_steps(config: Config, override: int | None, nbatch: Sequence[int],
                       probs: np.ndarray) -> int:
    """``--numb-steps``, else ``numb_steps``, else DeePMD-kit's steps from ``numb_epoch``:
    ``ceil(numb_epoch * ceil(max_i nb_i / p_i))`` with ``nb_i`` the batches on this rank
    (the same on every rank, so no broadcast is needed, unlike DeePMD-kit's #5570)."""
    if override is not None:
        return override
    if config.numb_steps is not None:
        return config.numb_steps
    if config.numb_epoch is not None:
        nb, p = np.asarray(nbatch, dtype=np.float64), np.asarray(probs, dtype=np.float64)
        per_epoch = (nb[p > 0] / p[p > 0]).max()  # systems never drawn do not count
        return max(1, math.ceil(config.numb_epoch * math.ceil(per_epoch)))
    raise ConfigError("mdloader train needs the number of steps: give training.numb_steps, "
                      "training.numb_epoch or --numb-steps", path="training.numb_steps")
