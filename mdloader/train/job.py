"""``mdloader train``: the reference DDP training job that exercises the loader as DeePMD-kit does.

One process per rank (``torchrun``); the process group starts only when ``WORLD_SIZE`` > 1, with
NCCL on GPUs and gloo on CPUs. Every rank builds the loader (rank 0 reads the data tree, the
others receive metadata), pulls batches through the outer ``DataLoader`` with the stateful
weighted sampler, and steps a :class:`~mdloader.train.model.RadialPotential` wrapped in
``DistributedDataParallel``. Rank 0 writes ``lcurve.out`` and the checkpoints; ``restart``
resumes model, optimizer and every rank's loader stream, so the batches after the restart are
exactly those an uninterrupted run would have drawn.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from mdloader.config.input_json import Config
from mdloader.config.loaders import configured_loader
from mdloader.data.schema import DataRequirementItem
from mdloader.distributed.channel import world_channel
from mdloader.distributed.collectives import all_reduce_mean, gather_to_main
from mdloader.distributed.group import device_of, process_group
from mdloader.distributed.packets import data_packet, error_packet, open_packet
from mdloader.errors import ConfigError, StateDictError
from mdloader.loader import default_num_workers
from mdloader.sampling.stateful_loader import StatefulLoader
from mdloader.train.io import Lcurve, load_checkpoint, save_checkpoint
from mdloader.train.model import RadialPotential, fit_energy_bias
from mdloader.train.objective import EnergyForceLoss, ExpDecayLR, resolve_numb_steps, rmse_columns
from mdloader.world import World

log = logging.getLogger(__name__)

LABELS = [DataRequirementItem("energy", 1, atomic=False, must=True, high_prec=True),
          DataRequirementItem("force", 3, atomic=True, must=True)]


@dataclass(frozen=True)
class ModelOptions:
    """Size of the reference model (kept small: the job is about the loader)."""

    rcut: float = 4.0
    nbasis: int = 16
    hidden: tuple[int, ...] = (32, 32)
    stat_frames: int = 10
    stat_systems: int = 200


@dataclass
class TrainResult:
    """What one rank did: the last step, files written (rank 0), batches it trained on."""

    step: int
    lcurve: str | None = None
    checkpoint: str | None = None
    batches: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    last_train: dict[str, float] = field(default_factory=dict)
    last_valid: dict[str, float] | None = None


def train(config: Config, *, output: str = ".", restart: str | None = None,
          numb_steps: int | None = None, stop_after: int | None = None,
          num_workers: int | None = None, options: ModelOptions = ModelOptions()) -> TrainResult:
    """Train; ``stop_after`` ends this run early (with a checkpoint) as a job time limit would."""
    if stop_after is not None and stop_after < 1:
        raise ConfigError(f"must be a positive step, got {stop_after}", path="--stop-after")
    if numb_steps is not None and numb_steps < 1:
        raise ConfigError(f"must be a positive integer, got {numb_steps}", path="--numb-steps")
    with process_group() as world:
        return _Trainer(config, world, output=output, numb_steps=numb_steps,
                        num_workers=num_workers, options=options).run(restart, stop_after)


class _Trainer:
    """State of one training run on one rank (created by :func:`train`)."""

    def __init__(self, config: Config, world: World, *, output: str, numb_steps: int | None,
                 num_workers: int | None, options: ModelOptions) -> None:
        self.config, self.world, self.output, self.options = config, world, output, options
        self.device = device_of(world)
        workers = default_num_workers() if num_workers is None else num_workers
        built = configured_loader(config.training_data, type_map=config.type_map,
                                  seed=config.seed, world=world, labels=LABELS,
                                  num_workers=workers, pin_memory=self.device.type == "cuda")
        self.train_set, sampler, self.loader = built.dataset, built.sampler, built.loader
        self.numb_steps = resolve_numb_steps(config, numb_steps, self.train_set.index,
                                             sampler.weights.numpy())
        self.train_set.print_summary("training", sampler.weights.tolist())
        self.valid = self._validation_loader()
        self.schedule = ExpDecayLR.from_config(config.learning_rate, self.numb_steps)
        self.loss_fn = EnergyForceLoss.from_config(config.loss, self.schedule.start_lr)
        ntypes = len(config.type_map) if config.type_map else max(
            s._ntypes for s in self.train_set.systems)
        self.model_args = {"ntypes": ntypes, "rcut": options.rcut, "nbasis": options.nbasis,
                           "hidden": list(options.hidden)}
        with torch.random.fork_rng(devices=[]):  # seeded init, no global side effect
            if config.seed is not None:
                torch.manual_seed(config.seed)
            self.model = RadialPotential(ntypes, rcut=options.rcut, nbasis=options.nbasis,
                                         hidden=options.hidden).to(self.device)

    def _validation_loader(self) -> StatefulLoader | None:
        data = self.config.validation_data
        if data is None:
            return None
        seed = None if self.config.seed is None else self.config.seed + 1
        built = configured_loader(data, type_map=self.config.type_map, seed=seed,
                                  world=self.world, labels=LABELS, num_workers=0)
        built.dataset.print_summary("validation", built.sampler.weights.tolist())
        return built.loader

    def run(self, restart: str | None, stop_after: int | None) -> TrainResult:
        step = 0
        if restart is None:
            self._statistics_on_main()
        self.ddp_model = (DistributedDataParallel(self.model) if self.world.distributed
                          else self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.schedule.start_lr)
        if restart is not None:
            step = self._restore(restart)
        os.makedirs(self.output, exist_ok=True)
        self.lcurve = (Lcurve(os.path.join(self.output, self.config.disp_file),
                              with_validation=self.valid is not None, append=restart is not None)
                       if self.world.is_main else None)
        try:
            return self._loop(step, stop_after)
        finally:
            if self.lcurve is not None:
                self.lcurve.close()

    def _statistics_on_main(self) -> None:
        """Rank 0 computes the statistics (DDP then broadcasts them with the weights); its
        failure (e.g. a system without energy.npy) reaches every rank as one framed error
        instead of leaving the others waiting in the DDP constructor."""
        if not self.world.distributed:
            self._statistics()
            return
        context = "computing the model statistics"
        channel = world_channel(activity=context)
        packet = None
        if channel.is_source:
            try:
                self._statistics()
                packet = data_packet(None, rank=0, context=context)
            except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
                packet = error_packet(exc, rank=0, context=context)
        open_packet(channel.broadcast(packet), rank=self.world.rank)

    def _statistics(self) -> None:
        """Energy bias by least squares and feature scales from a few frames per system."""
        systems = self.train_set.systems
        picks = np.unique(np.linspace(0, len(systems) - 1,
                                      min(len(systems), self.options.stat_systems)).astype(int))
        counts, energies, frames = [], [], []
        for sid in picks:
            nf = min(len(systems[sid]), self.options.stat_frames)
            batch = systems[sid].get_batch(list(range(nf)))
            natoms = batch.get("real_natoms_vec", batch["natoms"])
            counts.append(natoms[:, 2:].numpy())
            energies.append(batch["energy"].numpy().reshape(-1))
            frames.append(batch)
        bias = fit_energy_bias(np.concatenate(counts), np.concatenate(energies))
        feats = []
        with torch.no_grad():
            for batch in frames[:8]:
                box = batch["box"]
                f = self.model.features(batch["coord"][:1].to(self.device, torch.float64),
                                        batch["atype"][:1].long().to(self.device),
                                        None if box is None else
                                        box[:1].to(self.device, torch.float64))
                feats.append(f.reshape(-1, f.shape[-1]))
        self.model.set_statistics(bias, torch.cat(feats))
        log.info("energy bias per type from %d frames: %s", sum(len(e) for e in energies),
                 np.array2string(bias, precision=4))

    def _restore(self, path: str) -> int:
        state = load_checkpoint(path, world_size=self.world.world_size)
        if state["model_args"] != self.model_args:
            raise StateDictError(f"checkpoint {path} holds a model {state['model_args']} but "
                                 f"this run builds {self.model_args}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"][self.world.rank])
        if self.valid is not None and state.get("valid_loader") is not None:
            self.valid.load_state_dict(state["valid_loader"][self.world.rank])
        log.info("restarted from %s at step %d", path, state["step"])
        return int(state["step"])

    def _batches(self) -> Iterator[dict[str, Any]]:
        while True:  # DeePMD-kit's cycle_iterator: each iter() continues the stream
            yield from self.loader

    def _loop(self, start: int, stop_after: int | None) -> TrainResult:
        result = TrainResult(step=start)
        end = self.numb_steps if stop_after is None else min(self.numb_steps, stop_after)
        batches = self._batches()
        bar = tqdm(total=self.numb_steps, initial=start, disable=True if not self.world.is_main
                   else None, desc="train", unit="step", dynamic_ncols=True)
        for step in range(start, end):
            lr = self.schedule.value(step)
            batch = next(batches)
            result.batches.append((step, int(batch["sid"]), tuple(batch["fid"])))
            mse = self._step(batch, lr)
            done = step + 1
            if done % self.config.disp_freq == 0 or done == 1 or done == self.numb_steps:
                self._display(done, lr, mse, result, bar)
            if done % self.config.save_freq == 0 or done == end:
                result.checkpoint = self._save(done)
            result.step = done
            bar.update(1)
        bar.close()
        if self.lcurve is not None:
            result.lcurve = self.lcurve.path
        return result

    def _forward(self, model: Any, batch: dict[str, Any], create_graph: bool
                 ) -> dict[str, torch.Tensor]:
        box = batch["box"]
        return model(batch["coord"].to(self.device), batch["atype"].to(self.device),
                     None if box is None else box.to(self.device), create_graph=create_graph)

    def _labels(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: batch[k].to(self.device, torch.float64) for k in ("energy", "force")}

    def _step(self, batch: dict[str, Any], lr: float) -> dict[str, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        pred = self._forward(self.ddp_model, batch, create_graph=True)
        loss, mse = self.loss_fn(pred, self._labels(batch), lr)
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # The [1, H] output weight gets a grad with strides (1, 1) instead of (H, 1): the
            # same memory layout for a size-1 dimension, yet DDP's reducer warns once per rank.
            warnings.filterwarnings("ignore", message="Grad strides do not match bucket view")
            loss.backward()
        self.optimizer.step()
        return mse

    def _validate(self, lr: float) -> dict[str, float] | None:
        if self.valid is None:
            return None
        totals = np.zeros(3)
        numb = self.config.validation_data.numb_btch  # type: ignore[union-attr]
        batches = iter(self.valid)
        for _ in range(numb):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(self.valid)
                batch = next(batches)
            pred = self._forward(self.model, batch, create_graph=False)
            _, mse = self.loss_fn({k: v.detach() for k, v in pred.items()},
                                  self._labels(batch), lr)
            totals += [mse["mse"], mse["mse_e"], mse["mse_f"]]
        return dict(zip(("mse", "mse_e", "mse_f"), totals / numb))

    def _display(self, done: int, lr: float, mse: dict[str, float], result: TrainResult,
                 bar: tqdm) -> None:
        trn = all_reduce_mean([mse["mse"], mse["mse_e"], mse["mse_f"]])
        result.last_train = rmse_columns(dict(zip(("mse", "mse_e", "mse_f"), trn)))
        val = self._validate(lr)
        if val is not None:
            val_arr = all_reduce_mean([val["mse"], val["mse_e"], val["mse_f"]])
            result.last_valid = rmse_columns(dict(zip(("mse", "mse_e", "mse_f"), val_arr)))
        if self.lcurve is not None:
            self.lcurve.write(done, lr, result.last_train, result.last_valid)
            bar.set_postfix(rmse_f=f"{result.last_train['rmse_f']:.3g}", lr=f"{lr:.1e}")
            log.debug("step %d: train %s valid %s", done, result.last_train, result.last_valid)

    def _save(self, done: int) -> str | None:
        loaders = gather_to_main(self.loader.state_dict())
        valid = gather_to_main(self.valid.state_dict()) if self.valid is not None else None
        if not self.world.is_main:
            return None
        state = {"world_size": self.world.world_size, "model": self.model.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "loader": loaders,
                 "valid_loader": valid, "model_args": self.model_args,
                 "numb_steps": self.numb_steps}
        path = save_checkpoint(self.output, self.config.save_ckpt, done, state)
        log.info("saved checkpoint %s", path)
        return path
