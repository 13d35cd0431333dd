"""Small se_e2_a inputs for ``mdloader dp`` tests: one head, or several sharing a descriptor,
on 4-frame generated systems with validation data."""

from __future__ import annotations

from pathlib import Path

from mdloader.testing import make_dataset

LOSS = {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
        "limit_pref_f": 1}
DESCRIPTOR = {"type": "se_e2_a", "sel": [12, 24], "rcut_smth": 0.5, "rcut": 4.0,
              "neuron": [4, 8], "axis_neuron": 4, "seed": 1}
LR = {"type": "exp", "decay_steps": 5, "start_lr": 1e-3, "stop_lr": 1e-3}
NFRAMES, BATCH = [4, 4], [1, 1]   # every training set: 2 systems of 4 frames, batch 1


def make_task_data(root: Path) -> Path:
    """Training (2 systems) and validation (1 system) data of tasks ``a`` and ``b`` in
    ``root``."""
    for i, name in enumerate(("a", "b")):
        make_dataset(root / f"train_{name}", 2, nframes=4, seed=3 + i)
        make_dataset(root / f"valid_{name}", 1, nframes=4, seed=53 + i)
    return root


def _data(root: Path, name: str) -> dict:
    return {"training_data": {"systems": [str(root / f"train_{name}")], "batch_size": 1},
            "validation_data": {"systems": [str(root / f"valid_{name}")], "batch_size": 1,
                                "numb_btch": 2}}


def single_task_input(root: Path) -> dict:
    """A one-head se_e2_a input on 4-frame systems, with validation data."""
    return {"model": {"type_map": ["O", "H"], "descriptor": DESCRIPTOR,
                      "fitting_net": {"neuron": [8], "seed": 1}},
            "learning_rate": LR, "loss": LOSS,
            "training": {**_data(root, "a"), "seed": 7, "disp_freq": 1, "save_freq": 100}}


def multi_task_input(root: Path, tasks: tuple[str, ...] = ("a", "b"),
                     data: dict[str, str] | None = None, disp_freq: int = 1) -> dict:
    """A multi-head se_e2_a input sharing one descriptor, each head its own data (or the data
    ``data`` names for it)."""
    data = data or {}
    head = {"type_map": "type_map_all", "descriptor": "shared_descriptor",
            "fitting_net": {"neuron": [8], "seed": 1}}
    return {"model": {"shared_dict": {"type_map_all": ["O", "H"],
                                      "shared_descriptor": DESCRIPTOR},
                      "model_dict": {t: dict(head) for t in tasks}},
            "learning_rate": LR, "loss_dict": dict.fromkeys(tasks, LOSS),
            "training": {"data_dict": {t: _data(root, data.get(t, t)) for t in tasks},
                         "model_prob": dict.fromkeys(tasks, 1.0),
                         "seed": 7, "disp_freq": disp_freq, "save_freq": 100}}
