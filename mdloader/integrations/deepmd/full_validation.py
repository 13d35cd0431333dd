"""DeePMD-kit 3.2's full validation (``validating.full_validation``) sharded over the ranks.

DeePMD-kit's ``FullValidator`` evaluates every validation system whole on rank 0 while the other
ranks wait at a barrier, through each system's own ``DeepmdData`` (deepmd-kit #5336). Under
``mdloader dp`` every validator DeePMD-kit builds is a sharded one (:func:`sharded_class`, built by
DeePMD-kit's own ``build_full_validators``, with its schedule, metric, log file and
best-checkpoint rule: :func:`sharded_builds`); only its evaluation differs: every rank reads its
share of the validation frames through the feed's full pass
(:meth:`~mdloader.loading.feed.Feed.full_pass`: each frame exactly once over the ranks), predicts
them with DeePMD-kit's own ``_predict_outputs`` and computes DeePMD-kit's per-system metrics of
each batch (its profile's ``compute_system_metrics``). A metric's weighted sums travel in one
gather (:func:`~mdloader.distributed.collectives.gather_from_every_rank`), which also carries a
rank's failure or a stop signal, and are merged as DeePMD-kit's ``weighted_average`` merges its
systems (the mean of an MAE, the mean square of an RMSE, weighted by the elements each was taken
over): a partition of a system's frames merges to the system's own value. DeePMD-kit's ``run``
then does the rest on rank 0 as it always does: the best-checkpoint records (``train_infos``),
the best checkpoint, ``val.log``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from mdloader.data.formats import backend_of
from mdloader.distributed.collectives import gather_from_every_rank
from mdloader.errors import MdloaderError
from mdloader.integrations.deepmd import seam
from mdloader.loading.feed import Feed

#: ``(value, weight)`` of each metric, as DeePMD-kit's ``compute_system_metrics`` returns them.
Errors = Mapping[str, tuple[float, float]]


def weighted_sums(errors: Errors) -> dict[str, tuple[float, float]]:
    """``{metric: (sum, weight)}`` of one batch's ``(value, weight)`` pairs: ``value * weight``
    for an MAE, ``value**2 * weight`` for an RMSE (what ``weighted_average`` sums)."""
    sums = {}
    for key, (value, weight) in errors.items():
        if key.startswith("mae"):
            sums[key] = (float(value) * float(weight), float(weight))
        elif key.startswith("rmse"):
            sums[key] = (float(value) * float(value) * float(weight), float(weight))
        else:
            raise MdloaderError(f"a full validation metric is an MAE or an RMSE, got {key!r}")
    return sums


def add_sums(total: dict[str, list[float]], sums: Mapping[str, tuple[float, float]]) -> None:
    """Add one batch's :func:`weighted_sums` to ``total`` (``{metric: [sums], [weights]}``)."""
    for key, (value, weight) in sums.items():
        parts = total.setdefault(key, [[], []])
        parts[0].append(value)
        parts[1].append(weight)


def merged_metrics(parts: list[Mapping[str, tuple[float, float]]]) -> dict[str, float]:
    """Every rank's ``{metric: (sum, weight)}`` merged: the weighted mean of an MAE, the root of
    the weighted mean square of an RMSE (``math.fsum`` in rank order: the same on every rank)."""
    keys = sorted({key for part in parts for key in part})
    merged = {}
    for key in keys:
        total = math.fsum(part[key][0] for part in parts if key in part)
        weight = math.fsum(part[key][1] for part in parts if key in part)
        mean = total / weight
        merged[key] = mean if key.startswith("mae") else math.sqrt(mean)
    return merged


class ShardedEvaluation:
    """What the sharded validator (:func:`sharded_class`) changes in DeePMD-kit's
    ``FullValidator``: its evaluation, on every rank, of the rank's share of the frames.
    ``feed``, ``stop`` and ``pending_signal`` are set when the trainer runs (:func:`bind`)."""

    feed: Feed | None = None
    stop: Callable[[str], None] | None = None
    pending_signal: Callable[[], str | None] = staticmethod(lambda: None)
    _shared_metrics: dict[str, float] | None = None
    _signal: str | None = None

    def run(self, *, step_id: int, display_step: int, lr: float,
            save_checkpoint: Any) -> Any:
        """DeePMD-kit's ``run`` with the metrics computed by every rank first (a collective)."""
        if not self.should_run(display_step):  # type: ignore[attr-defined]
            return None
        shared = self.evaluate_shards(display_step)
        if shared is None:  # a stop signal cut the pass: stop as after a training step
            if self.stop is not None:
                self.stop(self._signal or "SIGTERM")
            return None
        self._shared_metrics = shared
        try:
            return super().run(step_id=step_id, display_step=display_step,  # type: ignore[misc]
                               lr=lr, save_checkpoint=save_checkpoint)
        finally:
            self._shared_metrics = None

    def evaluate_all_systems(self) -> dict[str, float]:
        """The metrics of the pass every rank took part in (rank 0's ``_evaluate`` asks)."""
        if self._shared_metrics is None:
            raise MdloaderError("DeePMD-kit's full validation evaluated outside its run: under "
                                "mdloader dp the ranks evaluate their shares together in run")
        return dict(self._shared_metrics)

    def evaluate_shards(self, display_step: int) -> dict[str, float] | None:
        """Evaluate this rank's share of the validation frames and merge every rank's sums in one
        gather: the metrics of the table's columns, the same on every rank; ``None`` on every
        rank when a stop signal cut the pass on any rank. A rank's failure is raised on every
        rank (the lowest failing rank's, naming its system and file)."""
        if self.feed is None:
            raise MdloaderError("DeePMD-kit's full validation ran outside Trainer.run: mdloader's "
                                "feed reads its frames once the trainer runs")
        self._signal = None
        part: dict[str, tuple[float, float]] = {}
        error: BaseException | None = None
        try:
            part, cut = self._evaluate_share()
        except Exception as exc:  # noqa: BLE001 - every rank raises it after the one gather
            error, cut = exc, False
        parts = gather_from_every_rank({"sums": part, "cut": cut}, error,
                                       context=f"full validation at step {display_step}")
        if any(p["cut"] for p in parts):
            return None
        merged = merged_metrics([p["sums"] for p in parts])
        columns = self.table_column_specs  # type: ignore[attr-defined]
        return {key: merged[key] for key, _, _ in columns if key in merged}

    def _evaluate_share(self) -> tuple[dict[str, tuple[float, float]], bool]:
        """The weighted sums of this rank's batches, and whether a stop signal cut them."""
        model = self.model  # type: ignore[attr-defined]
        was_training = bool(getattr(model, "training", True))
        model.eval()
        total: dict[str, list[float]] = {}
        batches: Iterator[Any] = self.feed.full_pass(None)  # type: ignore[union-attr]
        try:
            with self.matmul_precision.applied(training=False), \
                    self.model_eval_context():  # type: ignore[attr-defined]
                for batch in batches:
                    self._signal = self.pending_signal()
                    if self._signal is not None:
                        return {}, True
                    add_sums(total, weighted_sums(self.batch_errors(batch)))
        finally:
            batches.close()  # type: ignore[attr-defined]  # a cut pass drops its read-ahead
            model.train(was_training)
        return {key: (math.fsum(s), math.fsum(w)) for key, (s, w) in total.items()}, False

    def batch_errors(self, batch: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
        """DeePMD-kit's metrics of one batch (frames of one system), as ``_evaluate_system``
        computes them for a whole system: the same model inputs and outputs, the same labels."""
        test = {key: (value.numpy() if torch.is_tensor(value) else value)
                for key, value in batch.items()}
        test["type"] = test.pop("atype")
        system = self.feed.stream(None, "validation").dataset.systems[  # type: ignore[union-attr]
            int(batch["sid"])]
        pbc = periodic(system.meta, test.get("box"))
        natoms, nframes = int(test["type"].shape[1]), int(test["coord"].shape[0])
        model = self.model  # type: ignore[attr-defined]
        profile = self.profile  # type: ignore[attr-defined]
        prediction = self._predict_outputs(  # type: ignore[attr-defined]
            coord=test["coord"].reshape(nframes, -1),
            atom_types=test["type"],
            box=test["box"] if pbc else None,
            fparam=(test["fparam"] if model.get_dim_fparam() > 0
                    and bool(test.get("find_fparam", 0.0)) else None),
            aparam=test["aparam"] if model.get_dim_aparam() > 0 else None,
            spin=test["spin"].reshape(nframes, -1) if profile.needs_spin else None,
            include_virial=pbc and bool(test.get("find_virial", 0.0)),
            natoms=natoms, nframes=nframes)
        return profile.compute_system_metrics(prediction, test, natoms, pbc)


def periodic(meta: Any, box: Any) -> bool:
    """Whether a batch's system is periodic: its description's ``nopbc``, or for a format that
    stores periodicity with each frame (LMDB) a box that is not all zeros, as DeePMD-kit's LMDB
    test data decides from its first frame."""
    if not backend_of(meta.location).pbc_per_frame:
        return bool(meta.pbc)
    return box is not None and not np.allclose(np.asarray(box), 0.0)


_classes: dict[type, type] = {}


def sharded_class(base: type) -> type:
    """DeePMD-kit's validator class ``base`` with :class:`ShardedEvaluation`'s evaluation."""
    if base not in _classes:
        _classes[base] = type("ShardedFullValidator", (ShardedEvaluation, base),
                              {"__doc__": "DeePMD-kit's FullValidator, sharded over the ranks."})
    return _classes[base]


def sharded_builds(original: Callable[..., Any]) -> Callable[..., Any]:
    """``build_full_validators`` whose validators are sharded: DeePMD-kit's own builder (its
    checks, schedule, metric, log file and best-checkpoint set-up) with its ``FullValidator``
    bound to :func:`sharded_class` of it while it builds."""
    def build_full_validators(*args: Any, **kwargs: Any) -> Any:
        module = seam.deepmd_module(seam.VALIDATION)
        own = seam.FULL_VALIDATOR_CLASS
        base = module.__dict__[own]
        with seam.patched(module, own, sharded_class(base)):
            return original(*args, **kwargs)

    build_full_validators.__wrapped__ = original  # type: ignore[attr-defined]
    return build_full_validators


def bind(trainer: Any, feed: Feed, stop: Callable[[str], None],
         pending_signal: Callable[[], str | None]) -> list[ShardedEvaluation]:
    """The trainer's sharded validators, reading from ``feed``; a stop signal during a pass
    calls ``stop(signal_name)`` on every rank."""
    bound = []
    for name in ("full_validator", "ema_full_validator"):
        validator = getattr(trainer, name, None)
        if validator is None:
            continue
        if not isinstance(validator, ShardedEvaluation):
            raise MdloaderError(f"Trainer.{name} is not mdloader's sharded full validator: "
                                "it was built while mdloader was not installed")
        validator.feed, validator.stop = feed, stop
        validator.pending_signal = pending_signal  # type: ignore[method-assign]
        bound.append(validator)
    return bound


@contextlib.contextmanager
def bound(trainer: Any, feed: Feed, stop: Callable[[str], None],
          pending_signal: Callable[[], str | None]) -> Iterator[None]:
    """:func:`bind` for the length of a run (the feed is read only while it runs)."""
    validators = bind(trainer, feed, stop, pending_signal)
    try:
        yield
    finally:
        for validator in validators:
            validator.feed = validator.stop = None
