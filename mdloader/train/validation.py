"""Validation in the reference job: DeePMD-kit's partial validation, and full passes over the ranks.

*Partial* (every display step, as DeePMD-kit): each rank takes the next ``numb_btch`` batches of
the feed's weighted validation stream (it continues from display to display and is saved in
checkpoints); the batch means of the squared errors are averaged over every rank's batches.

*Full* (``mdloader train --full-validation``): every validation frame exactly once, shared by
the ranks without padding (:class:`~mdloader.sampling.validation.ShardedValidationSampler`),
read by the feed's pool of workers.
Each rank sums squared errors and counts; :func:`~mdloader.distributed.collectives.reduce_sums`
adds them up, so the RMSEs are those one rank would compute alone, in about ``1 / W`` of its
time. DeePMD-kit's full validation runs on rank 0 while the other ranks wait.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mdloader.distributed.collectives import reduce_sums
from mdloader.loading.feed import Feed
from mdloader.train.objective import rmse_columns

Predict = Callable[[dict[str, Any]], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]
"""A batch -> (predicted energy and force, labels), both float64 on the model's device."""


@dataclass(frozen=True)
class FullValidation:
    """One full pass: RMSEs over every validation frame, how many, and the pass's wall time."""

    step: int
    rmse_e: float
    rmse_f: float
    frames: int
    seconds: float


def frame_sums(pred: Mapping[str, torch.Tensor], label: Mapping[str, torch.Tensor],
               atype: torch.Tensor) -> dict[str, float]:
    """Squared errors of a batch summed over its frames: energy per atom and force components of
    real atoms (virtual atoms, ``atype < 0``, count for nothing), and the counts to divide by."""
    real = (atype >= 0).to(pred["force"].device)
    natoms = real.sum(dim=1).to(torch.float64)
    de = (pred["energy"].reshape(-1) - label["energy"].reshape(-1)) / natoms
    df = (pred["force"] - label["force"]) * real.unsqueeze(-1)
    return {"sse_e": float(torch.sum(de * de)), "frames": float(len(de)),
            "sse_f": float(torch.sum(df * df)), "force_terms": float(3 * real.sum())}


def rmse_from_sums(sums: Mapping[str, float]) -> tuple[float, float]:
    """(per-atom energy RMSE, force RMSE) from summed squared errors and counts."""
    return (math.sqrt(sums["sse_e"] / sums["frames"]),
            math.sqrt(sums["sse_f"] / sums["force_terms"]))


class Validation:
    """The validation data of a job: the feed's validation stream and its full passes."""

    def __init__(self, feed: Feed, *, numb_btch: int) -> None:
        self.feed = feed
        self.stream = feed.stream(None, "validation")
        data, weights = self.stream.systems()
        data.print_summary("validation", weights)
        self.numb_btch = int(numb_btch)
        self.systems = data.systems

    def partial(self, predict: Predict,
                loss: Callable[..., tuple[Any, dict[str, float]]]) -> dict[str, float]:
        """RMSE columns of ``numb_btch`` batches per rank, averaged over every rank's batches."""
        totals = {"mse": 0.0, "mse_e": 0.0, "mse_f": 0.0, "batches": 0.0}
        for _ in range(self.numb_btch):
            pred, label = predict(next(self.stream))
            _, mse = loss(pred, label)
            for key in ("mse", "mse_e", "mse_f"):
                totals[key] += mse[key]
            totals["batches"] += 1
        summed = reduce_sums(totals)
        return rmse_columns({k: summed[k] / summed["batches"] for k in ("mse", "mse_e", "mse_f")})

    def full(self, predict: Predict, step: int,
             stop: Callable[[], bool] = lambda: False) -> FullValidation | None:
        """Every validation frame once, shared by the ranks; the same result on every rank.

        A rank on which ``stop()`` turns true leaves its loop; then every rank returns ``None``
        (they learn it in the same exchange as the sums), so that a stop signal is acted on in
        a pass that may take minutes.
        """
        started = time.perf_counter()
        sums = {"sse_e": 0.0, "frames": 0.0, "sse_f": 0.0, "force_terms": 0.0, "cut": 0.0}
        batches = self.feed.full_pass()
        try:
            for batch in batches:
                if stop():
                    sums["cut"] = 1.0
                    break
                pred, label = predict(batch)
                for key, value in frame_sums(pred, label, batch["atype"]).items():
                    sums[key] += value
        finally:
            batches.close()  # a pass cut short: what was read ahead for it is dropped
        total = reduce_sums(sums)
        if total["cut"]:
            return None
        rmse_e, rmse_f = rmse_from_sums(total)
        return FullValidation(step, rmse_e, rmse_f, int(total["frames"]),
                              time.perf_counter() - started)
