"""DeePMD-kit's input statistics (``davg``/``dstd``, energy bias) computed by mdloader in shares.

``Trainer._run_stat_on_chief`` is wrapped (:func:`mdloader_run_stat_on_chief`). Unless something
mdloader does not compute is needed (:func:`unsupported`), the first statistics call of a
job computes the statistics of every task it will ask for (:func:`merged_statistics`: each
task's model, training set and ``data_stat_nbatch``) in one sharded pass with one all-gather
(:func:`~mdloader.loading.statistics.job_input_statistics`; parts equal across tasks computed
once); each task's call then has rank 0 run DeePMD-kit's own ``compute_or_load_stat`` with
``EnvMatStatSe`` handed the merged ``StatItem``s and a sampled function holding only energies
and type counts, so DeePMD-kit's code derives the values (and merges a shared descriptor's
statistics afterwards as it does). The frames of each system are those of
:meth:`~mdloader.sampling.plan.LoaderPlan.statistics_frames` (a one-rank job's
``make_stat_input``), so the values equal DeePMD-kit's one-rank run at any world size.
Otherwise (a ``stat_file``, fparam, ...) DeePMD-kit's action runs as is, for that task.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from mdloader import settings
from mdloader.distributed.collectives import broadcast_from_main
from mdloader.distributed.group import current_world
from mdloader.integrations.deepmd.seam import (
    COMPUTE_MODEL_PREDICT,
    ENV_MAT_STAT,
    FORWARD_WRAPPER,
    STAT,
    STAT_ITEM,
    TRAINING,
    StatisticsCall,
    deepmd_module,
    finetune_call,
    patched,
    private,
    statistics_call,
)
from mdloader.integrations.deepmd.systems import current_job, planned_task_input
from mdloader.loading.loader import DpLoaderSet, WholeSystemLoaders
from mdloader.loading.statistics import (
    InputRequest,
    StatPass,
    job_input_statistics,
    joint_pass,
    placed_samples,
    report_line,
)
from mdloader.stats.frames import frames_by_set

log = logging.getLogger(__name__)

#: The ``operation`` DeePMD-kit names the statistics before training with.
OPERATION = "statistics initialization"


class InputStatTakeover:
    """The trainer's statistics action, computed by mdloader in shares when it can be.

    Built on every rank from what DeePMD-kit's ``initialize_statistics`` passes on (the model,
    the training ``DpLoaderSet``, ``data_stat_nbatch``, the stat-file setting:
    :func:`~mdloader.integrations.deepmd.seam.statistics_call`). :meth:`compute` is
    collective; :meth:`action` is what rank 0 then runs in place of DeePMD-kit's action: its
    own ``compute_or_load_stat``, fed the merged statistics.
    """

    def __init__(self, model: Any, data: DpLoaderSet, get_sample: Callable[[], Any],
                 preset_observed_type: Any, blocks: list[Any], nbatch: int) -> None:
        self.model = model
        self.data = data
        self.nbatch = int(nbatch)
        self.get_sample = get_sample
        self.preset_observed_type = preset_observed_type
        self.settings = [env_settings(b) for b in blocks]
        self.every_frame = every_frame()
        """``MDLOADER_STAT_FRAMES=all``: every frame of every system, whatever ``nbatch``."""
        self._counts: Any = None

    @classmethod
    def of(cls, trainer: Any, action: Callable[[], None]) -> InputStatTakeover | None:
        """The takeover of the ``trainer``'s statistics ``action``, or ``None`` (then DeePMD-kit
        computes it: a stat file is set, fparam/aparam, exclusions or ``min_pair_dist`` are
        used)."""
        call = statistics_call(trainer, action)
        return None if call is None else cls.of_call(call)

    @classmethod
    def of_call(cls, call: StatisticsCall, *, quiet: bool = False) -> InputStatTakeover | None:
        """The takeover of one model's statistics call, or ``None`` (DeePMD-kit's own)."""
        reason = unsupported(call.model, call.data, call.nbatch, call.stat_file_spec,
                             call.min_pair_dist)
        if reason:
            if not quiet:
                log.info("input statistics: DeePMD-kit's own (%s)", reason)
            return None
        blocks = env_blocks(call.model)
        if not blocks:
            return None
        return cls(call.model, call.data, call.get_sample, call.preset_observed_type, blocks,
                   int(call.nbatch))

    def matches(self, other: InputStatTakeover) -> bool:
        """Whether ``other`` asks for the very statistics this one computes."""
        return (self.model is other.model and self.data is other.data
                and self.nbatch == other.nbatch and self.settings == other.settings)

    def request(self) -> InputRequest:
        """What the joint pass computes for this model (its training set's frames)."""
        return InputRequest(self.data.systems, self.settings,
                            getattr(self.data, "type_map", None), frames=self.frames)

    def log_frames(self) -> None:
        """Rank 0's line on the frames that enter this model's statistics."""
        counts = self.frame_counts()
        total = int(sum(int(n) for n in self.data.nframes))
        world = current_world()
        if world.is_main and int(counts.sum()) == total:
            log.info("input statistics: all frames of %d systems%s, in shares on %d ranks",
                     len(self.data.systems),
                     " (MDLOADER_STAT_FRAMES=all)" if self.every_frame else "",
                     world.world_size)
        elif world.is_main:
            log.info("input statistics: %d of %d frames of %d systems (data_stat_nbatch=%d, "
                     "the frames of a one-rank job), in shares on %d ranks", int(counts.sum()),
                     total, len(self.data.systems), self.nbatch, world.world_size)

    def frame_counts(self) -> Any:
        """How many frames of each system enter (the plan's rule, counted without drawing; every
        frame under ``MDLOADER_STAT_FRAMES=all``)."""
        if self._counts is None:
            plan = self.data.plan
            self._counts = (plan.nframes if self.every_frame
                            else plan.statistics_frame_counts(self.nbatch))
        return self._counts

    def frames(self, position: int) -> Any:
        """The frames system ``position`` gives the statistics (the plan's), ``None`` when all
        do (then the all-frames cache entries are shared with every other
        ``data_stat_nbatch``, and no permutation is drawn)."""
        plan = self.data.plan
        if int(self.frame_counts()[position]) == int(plan.nframes[position]):
            return None
        return plan.statistics_frames(position, self.nbatch)

    def compute(self) -> tuple[list[Any], list[Any]]:
        """The merged environment sums of each block and every system's output samples
        (collective: every rank calls it)."""
        self.log_frames()
        return job_input_statistics([self.request()])[0]

    def action(self, merged: tuple[list[Any], list[Any]]) -> Callable[[], None] | None:
        """Rank 0's statistics action on the merged results (``None``: some chosen frame has no
        energy, DeePMD-kit's own sampling decides)."""
        sums, samples = merged
        if any(len(s.counts) != int(n) for s, n in zip(samples, self.frame_counts())):
            return None
        sampled = output_sampled(samples)
        by_settings = dict(zip(self.settings, sums))
        model, preset, get_sample = self.model, self.preset_observed_type, self.get_sample

        def initialize_statistics() -> None:
            with _env_stats_from(by_settings, get_sample):
                model.compute_or_load_stat(sampled_func=lambda: sampled, stat_file_path=None,
                                           preset_observed_type=preset)

        return initialize_statistics


def every_frame() -> bool:
    """Whether the statistics read every frame (``MDLOADER_STAT_FRAMES=all``)."""
    return settings.resolve("stat_frames") == "all"


def unsupported(model: Any, data: Any, nbatch: Any, spec: Any, min_pair_dist: Any) -> str:
    """Why mdloader leaves these statistics to DeePMD-kit; empty when it computes them."""
    if not isinstance(data, DpLoaderSet):
        return "training data not read by mdloader"
    if getattr(spec, "path", None) is not None:
        return "training.stat_file is set"
    if float(min_pair_dist or 0.0) > 0:
        return "min_pair_dist filters frames"
    atomic = getattr(model, "atomic_model", None)
    fitting = getattr(atomic, "fitting_net", None)
    if atomic is None or fitting is None or list(getattr(atomic, "bias_keys", [])) != ["energy"]:
        return "not an energy model"
    if getattr(fitting, "numb_fparam", 0) or getattr(fitting, "numb_aparam", 0):
        return "fparam/aparam statistics"
    if getattr(atomic, "pair_exclude_types", None) or getattr(atomic, "atom_exclude_types", None):
        return "model-level exclude types"
    if isinstance(nbatch, bool) or not isinstance(nbatch, int) or nbatch < 1:
        return f"data_stat_nbatch={nbatch!r} is not a positive integer"
    return ""


def env_blocks(model: Any) -> list[Any]:
    """The descriptor blocks whose ``davg``/``dstd`` come from ``EnvMatStatSe``."""
    needed = ("get_rcut", "get_rcut_smth", "get_sel", "get_nsel", "get_ntypes", "mixed_types",
              "get_env_protection", "compute_input_stats")
    return [m for m in model.modules()
            if all(hasattr(m, n) for n in needed) and hasattr(m, "mean") and
            hasattr(m, "stddev") and type(m).__name__.startswith("DescrptBlock")]


def env_settings(block: Any) -> Any:
    """The :class:`~mdloader.stats.env_mat.EnvMatSettings` of a DeePMD-kit block."""
    from mdloader.stats.env_mat import EnvMatSettings

    EnvMatStatSe = deepmd_module(ENV_MAT_STAT).EnvMatStatSe

    mixed = bool(block.mixed_types())
    sel = (int(block.get_nsel()),) if mixed else tuple(int(s) for s in block.get_sel())
    return EnvMatSettings(
        float(block.get_rcut()), float(block.get_rcut_smth()), sel, int(block.get_ntypes()),
        mixed_types=mixed, env_protection=float(block.get_env_protection()),
        radial_only=EnvMatStatSe(block).last_dim == 1,
        exclude_types=tuple(tuple(int(t) for t in p)
                            for p in getattr(block, "exclude_types", None) or ()))


def output_sampled(samples: Sequence[Any]) -> list[dict[str, Any]]:
    """DeePMD-kit's sampled systems, reduced to what its output statistics and observed types
    read: ``energy``, ``find_energy``, ``natoms`` and ``atype`` (virtual atoms ``-1``), on the
    CPU as ``make_stat_input`` packs them, whatever the default device."""
    import numpy as np
    import torch

    cpu = torch.device("cpu")
    out = []
    for s in samples:
        counts = np.asarray(s.counts, dtype=np.int64)
        natoms = counts.sum(axis=1, keepdims=True)
        width = int(natoms.max()) if len(natoms) else 0
        atype = np.full((len(counts), width), -1, dtype=np.int64)
        for f, row in enumerate(counts):
            types = np.repeat(np.arange(row.size), row)
            atype[f, :types.size] = types
        out.append({
            "energy": torch.as_tensor(np.asarray(s.labels, dtype=np.float64), device=cpu),
            "find_energy": np.float32(1.0),
            "natoms": torch.as_tensor(np.concatenate([natoms, natoms, counts], axis=1),
                                      device=cpu),
            "atype": torch.as_tensor(atype, device=cpu),
        })
    return out


def _env_stats_from(by_settings: dict[Any, Any], get_sample: Callable[[], Any]) -> Any:
    """While active, DeePMD-kit's ``EnvMatStatSe`` takes its ``StatItem``s from merged sums of
    the same settings; any other descriptor block samples as usual (``get_sample``)."""
    EnvMatStatSe = deepmd_module(ENV_MAT_STAT).EnvMatStatSe
    StatItem = deepmd_module(STAT_ITEM).StatItem
    original = EnvMatStatSe.load_or_compute_stats

    def load_or_compute_stats(stat: Any, data: Any, path: Any = None) -> None:
        sums = by_settings.get(env_settings(stat.descriptor))
        if sums is None:
            return original(stat, get_sample, path)
        keys = set(stat.get_stat_keys())
        stat.stats = {k: StatItem(*v) for k, v in sums.items().items() if k in keys}
        return None

    return patched(EnvMatStatSe, "load_or_compute_stats", load_or_compute_stats)


def merged_statistics(trainer: Any, takeover: InputStatTakeover) -> tuple[list[Any], list[Any]]:
    """The merged statistics of ``takeover``: every task's of a recorded job in one pass, at the
    job's first statistics call (collective), kept with the job.

    The first call plans a takeover for every task the trainer will ask for (all of them, or
    under ``--finetune`` those with new types, :func:`planned_takeovers`); one joint pass
    computes them. A later call whose takeover is not a planned one computes alone (every rank
    decides alike: the plan is a function of the input).
    """
    job = current_job()
    results = job.input_statistics if job is not None else None
    if results is None:
        planned = [t for t in planned_takeovers(trainer) if not t.matches(takeover)]
        todo = [takeover, *planned]
        for t in todo:
            t.log_frames()
        merged = job_input_statistics([t.request() for t in todo])
        results = list(zip(todo, merged, strict=True))
        if job is not None:
            job.input_statistics = results
    for planned_takeover, merged_result in results:
        if planned_takeover.matches(takeover):
            return merged_result
    return takeover.compute()


def planned_takeovers(trainer: Any) -> list[InputStatTakeover]:
    """The takeovers of every task ``trainer`` will compute statistics for, from the trainer
    (its models, stat-file settings, losses) and the recorded input and training sets
    (:func:`~mdloader.integrations.deepmd.systems.planned_task_input`)."""
    models = trainer.model
    if not isinstance(models, dict):
        return []
    training = deepmd_module(TRAINING)
    links = trainer.finetune_links
    specs = trainer.stat_file_specs or {}
    losses = trainer.loss or {}
    out = []
    for key, model in models.items():
        if links is not None and not links[key].get_has_new_type():
            continue  # a fine-tuned task keeps its loaded statistics
        found = planned_task_input(key)
        if found is None or key not in specs or key not in losses:
            continue
        data, nbatch, min_pair_dist = found
        call = StatisticsCall(model, lambda: None, None, specs[key], data, nbatch, min_pair_dist)
        takeover = InputStatTakeover.of_call(call, quiet=True)
        if takeover is None:
            continue
        # what the trainer adds before this task's statistics (an energy model's labels)
        data.add_data_requirement(list(losses[key].label_requirement)
                                  + training.get_additional_data_requirement(model))
        out.append(takeover)
    return out



#: The ``operation`` of DeePMD-kit's fine-tuning statistics start so (the task follows).
FINETUNE_OPERATION = "fine-tuning statistics"


class FinetuneTakeover:
    """DeePMD-kit's fine-tuning bias statistics, in shares: every rank (all hold the loaded
    weights) reads its share of the statistics frames and, for ``change-by-statistic``, runs
    the model's forward on them; one all-gather brings every system's energies and
    predictions, and rank 0 runs DeePMD-kit's own action on them (its ``compute_output_stats``
    with the gathered predictions in place of its forward pass over every frame)."""

    def __init__(self, takeover: InputStatTakeover, mode: str) -> None:
        self.takeover = takeover
        self.mode = mode

    @classmethod
    def of(cls, trainer: Any, action: Callable[[], None]) -> FinetuneTakeover | None:
        """The takeover of a fine-tuning ``action``, or ``None`` (DeePMD-kit's own)."""
        found = finetune_call(trainer, action)
        if found is None:
            return None
        call, mode = found
        reason = unsupported(call.model, call.data, call.nbatch, None, call.min_pair_dist)
        if reason or mode not in ("change-by-statistic", "set-by-statistic"):
            log.info("fine-tuning statistics: DeePMD-kit's own (%s)", reason or mode)
            return None
        return cls(InputStatTakeover(call.model, call.data, call.get_sample, None, [],
                                     int(call.nbatch)), mode)

    def compute(self) -> tuple[list[Any], list[Any] | None]:
        """Every system's output samples and (``change-by-statistic``) the model's predictions
        of its frames, on every rank (collective: one all-gather)."""
        takeover = self.takeover
        takeover.log_frames()
        passes = takeover.request().passes()
        if self.mode == "change-by-statistic":
            loaded_weights_everywhere(takeover.model)
            forward = private(takeover.model.atomic_model, FORWARD_WRAPPER)()
            predict = private(deepmd_module(STAT), COMPUTE_MODEL_PREDICT)
            passes.append(StatPass(
                takeover.data.systems, "prediction", {"model": "loaded"},
                getattr(takeover.data, "type_map", None),
                functools.partial(_prediction, forward=forward, predict=predict),
                takeover.frames, cached=False))
        results, report = joint_pass(passes)
        if current_world().is_main:
            for kind, counts in report.kinds.items():
                log.info(report_line(kind, counts))
            log.info(report.line())
        samples = placed_samples(results[0])
        return samples, (results[1] if len(results) > 1 else None)

    def action(self, action: Callable[[], None], merged: tuple[list[Any], list[Any] | None]
               ) -> Callable[[], None] | None:
        """Rank 0's fine-tuning action on the gathered results (``None``: some chosen frame has
        no energy, DeePMD-kit's own sampling decides)."""
        samples, predictions = merged
        if any(len(s.counts) != int(n) for s, n in zip(samples, self.takeover.frame_counts())):
            return None
        sampled = output_sampled(samples)
        training = deepmd_module(TRAINING)
        stat = deepmd_module(STAT)
        change = training.model_change_out_bias

        def gathered_predictions(sampled_systems: Any, keys: Any, model_forward: Any) -> Any:
            return ({"energy": [p for p, _ in predictions]}, [m for _, m in predictions])

        def with_merged_samples(_model: Any, _sample_func: Any,
                                _bias_adjust_mode: str = "change-by-statistic") -> Any:
            return change(_model, lambda: sampled, _bias_adjust_mode=_bias_adjust_mode)

        def update_finetune_bias() -> None:
            with patched(training, "model_change_out_bias", with_merged_samples):
                if predictions is None:
                    action()
                    return
                with patched(stat, COMPUTE_MODEL_PREDICT, gathered_predictions):
                    action()

        return update_finetune_bias


def loaded_weights_everywhere(model: Any) -> None:
    """Rank 0's weights in ``model`` on every rank (collective; one broadcast). DeePMD-kit loads
    a fine-tuned checkpoint on rank 0 alone, and DDP copies it to the others later, after the
    fine-tuning statistics: their forward needs it now (what DDP then copies is the same)."""
    import torch

    world = current_world()
    if not world.distributed:
        return
    state = None
    if world.is_main:
        state = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                 for k, v in model.state_dict().items()}
    state = broadcast_from_main(state, context="the fine-tuned model's loaded weights")
    if not world.is_main:
        model.load_state_dict(state)


def _prediction(dataset: Any, chosen: Sequence[int] | None = None, *, forward: Any,
                predict: Any) -> tuple[Any, Any]:
    """The loaded model's atomic energies and mask for a system's chosen frames (in the order
    of its output samples), by DeePMD-kit's own ``_compute_model_predict``."""
    import numpy as np

    fids = np.concatenate([f for _, f in frames_by_set(dataset, chosen)])
    batch = dataset.get_batch(fids.tolist())
    sample = {"coord": batch["coord"], "atype": batch["atype"], "box": batch.get("box")}
    values, masks = predict([sample], ["energy"], forward)
    return values["energy"][0], masks[0]


def on_every_frame(action: Callable[[], None]) -> Callable[[], None]:
    """DeePMD-kit's own statistics ``action`` (rank 0's) on every frame of each system of an
    mdloader loader set (``MDLOADER_STAT_FRAMES=all``): its ``make_stat_input`` is handed
    loaders of whole systems (:class:`~mdloader.loading.loader.WholeSystemLoaders`) and as many
    batches as the longest has, so the sample is all of the data at any world size."""
    training = deepmd_module(TRAINING)
    sample_input = training.make_stat_input

    def make_stat_input(datasets: Any, dataloaders: Any, nbatches: Any, *args: Any,
                        **kwargs: Any) -> Any:
        owner = getattr(dataloaders, "loader_set", None)
        if owner is None:  # not mdloader's data: DeePMD-kit's sample as it is
            return sample_input(datasets, dataloaders, nbatches, *args, **kwargs)
        whole = WholeSystemLoaders(owner)
        longest = max((len(whole[i]) for i in range(len(whole))), default=1)
        log.info("input statistics: DeePMD-kit's own on all frames of %d systems "
                 "(MDLOADER_STAT_FRAMES=all)", len(whole))
        return sample_input(datasets, whole, longest, *args, **kwargs)

    def every_frame_action() -> None:
        with patched(training, "make_stat_input", make_stat_input):
            action()

    return every_frame_action


def mdloader_run_stat_on_chief(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer._run_stat_on_chief``: for the statistics initialization, every rank takes its
    share of the input statistics (every task's at the first call, one all-gather); rank 0
    then runs DeePMD-kit's ``compute_or_load_stat`` on the merged result."""

    def _run_stat_on_chief(self: Any, action: Callable[[], None], *, operation: str) -> None:
        takeover = InputStatTakeover.of(self, action) if operation == OPERATION else None
        ours = None
        if takeover is not None:
            ours = takeover.action(merged_statistics(self, takeover))
            if ours is not None:
                action = ours
        if operation == OPERATION and ours is None and every_frame():
            action = on_every_frame(action)
        finetune = (FinetuneTakeover.of(self, action)
                    if operation.startswith(FINETUNE_OPERATION) else None)
        if finetune is not None:
            ours = finetune.action(action, finetune.compute())
            if ours is not None:
                action = ours
        return original(self, action, operation=operation)

    return _run_stat_on_chief
