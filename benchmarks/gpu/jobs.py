"""The training runs of the GPU check: two inputs, three trainers, two worker counts.

The inputs are the README's main job (DeePMD-kit's water example, ``examples/water/input.json``)
and a small DPA-2 on the same data and sections: the descriptor of DeePMD-kit's DPA-2 example
(the multi-task example the integration tests run) with 2 repformer layers instead of 6 and a
64-wide fitting net. Each input runs ``steps`` steps with a display line every ``disp_freq``
steps and one checkpoint, at the end.

The trainers: ``mdloader train`` (its own reference model, whatever the input's model section
says: the loader, the steps and the data are the input's), ``mdloader dp --pt train`` (DeePMD-kit's
trainer on mdloader) and ``dp --pt train`` (DeePMD-kit 3.2.0 on its own loader). Each reads
``NUM_WORKERS`` / ``--num-workers`` from the run.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any

from benchmarks import REPO

WATER = os.path.join(REPO, "examples", "water")
#: DeePMD-kit's DPA-2 example, the source of the small DPA-2's descriptor.
DPA2_EXAMPLE = os.path.join(REPO, "tests", "fixtures", "deepmd-examples", "water_multi_task",
                            "pytorch_example", "input_torch.json")
JOBS = ("water", "dpa2")
PARTS = {"mdloader train": "b", "mdloader dp": "c", "dp": "d"}


@dataclass(frozen=True)
class Run:
    """One training run: which trainer, on which input, with how many DataLoader workers."""

    trainer: str  # a key of PARTS
    job: str  # one of JOBS
    workers: int

    @property
    def part(self) -> str:
        return PARTS[self.trainer]

    @property
    def name(self) -> str:
        return f"{self.trainer.replace(' ', '-')}_{self.job}_w{self.workers}"


def plan(trainers: tuple[str, ...], jobs: tuple[str, ...] = JOBS,
         workers: tuple[int, ...] = (0, 2)) -> list[Run]:
    """The runs, most wanted first (a budget that runs out cuts the last): per input, the three
    trainers side by side at each worker count; ``mdloader train`` on the DPA-2 input (the same
    loader on the same data as the water input, under its own model) comes last."""
    runs = [Run(t, j, w) for j in jobs for w in workers for t in trainers
            if not (t == "mdloader train" and j != "water")]
    runs += [Run("mdloader train", j, w) for j in jobs for w in workers
             if "mdloader train" in trainers and j != "water"]
    return runs


def water_input(steps: int, disp_freq: int) -> dict[str, Any]:
    """The water example with absolute system paths, ``steps`` steps, a display line every
    ``disp_freq`` steps and one checkpoint at the end."""
    with open(os.path.join(WATER, "input.json")) as fh:
        config = json.load(fh)
    config.pop("_comment", None)
    training = config["training"]
    for section in ("training_data", "validation_data"):
        data = training[section]
        data["systems"] = [os.path.join(WATER, s) for s in data["systems"]]
    training.update(numb_steps=steps, disp_freq=disp_freq, save_freq=steps)
    return config


def dpa2_input(steps: int, disp_freq: int) -> dict[str, Any]:
    """:func:`water_input` with the DPA-2 example's descriptor, 2 repformer layers, and a fitting
    net of three 64-wide layers."""
    with open(DPA2_EXAMPLE) as fh:
        example = json.load(fh)
    descriptor = copy.deepcopy(example["model"]["shared_dict"]["dpa2_descriptor"])
    descriptor.pop("_comment", None)
    descriptor["repformer"]["nlayers"] = 2
    config = water_input(steps, disp_freq)
    config["model"]["descriptor"] = descriptor
    config["model"]["fitting_net"] = {"neuron": [64, 64, 64], "resnet_dt": True, "seed": 1}
    return config


def write_input(folder: str, job: str, steps: int, disp_freq: int) -> str:
    """The input of ``job`` as ``folder/input.json``; its path."""
    config = water_input(steps, disp_freq) if job == "water" else dpa2_input(steps, disp_freq)
    path = os.path.join(folder, "input.json")
    with open(path, "w") as fh:
        json.dump(config, fh, indent=1)
    return path


def command(run: Run, python: str, deepmd_python: str) -> tuple[list[str], dict[str, str]]:
    """The command of ``run`` in its job folder (``input.json`` there, outputs beside it), and
    the environment it adds (DeePMD-kit's ``NUM_WORKERS``)."""
    if run.trainer == "mdloader train":
        return ([python, "-m", "mdloader", "train", "input.json", "--num-workers",
                 str(run.workers), "--output", "."], {})
    # neighbour statistics checked once is enough: the sel of both inputs are explicit
    entry = ["-m", "mdloader", "dp"] if run.trainer == "mdloader dp" else ["-m", "deepmd"]
    return ([deepmd_python, *entry, "--pt", "train", "input.json", "--skip-neighbor-stat"],
            {"NUM_WORKERS": str(run.workers)})
