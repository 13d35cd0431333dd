"""Small se_e2_a inputs for ``mdloader dp`` tests: one head, or several sharing a descriptor,
on 4-frame generated systems with validation data."""

from __future__ import annotations

from pathlib import Path

from mdloader.testing import make_dataset, make_system

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


def full_validation_input(root: Path, *, numb_steps: int = 6) -> dict:
    """A one-head float64 se_e2_a input with DeePMD-kit 3.2's full validation every 2 steps over
    three periodic validation systems of 5, 3 and 4 frames (with virials: the stress columns) and
    a non-periodic one of 3 frames without virials.

    Its learning rate (1e-30) leaves the weights as they were made, and its statistics read
    every frame (``data_stat_nbatch``), so ``dp`` and ``mdloader dp``, which draw different
    training batches, validate the same model: their full validations can be compared to
    rounding."""
    keys = ("energy", "force", "virial")
    train = [make_system(root / "train", f"t{i}", natoms=6 + 2 * i, nframes=6, seed=10 + i,
                         keys=keys) for i in range(2)]
    valid = [make_system(root / "valid", f"v{i}", natoms=5 + i, nframes=n, seed=20 + i,
                         keys=keys) for i, n in enumerate((5, 3, 4))]
    valid.append(make_system(root / "valid", "nopbc", natoms=5, nframes=3, seed=33,
                             keys=("energy", "force"), pbc=False))
    descriptor = dict(DESCRIPTOR, precision="float64")
    return {"model": {"type_map": ["O", "H"], "data_stat_nbatch": 100, "descriptor": descriptor,
                      "fitting_net": {"neuron": [8], "seed": 1, "precision": "float64"}},
            "learning_rate": {"type": "exp", "decay_steps": 5, "start_lr": 1e-30,
                              "stop_lr": 1e-30},
            "loss": dict(LOSS, start_pref_v=1, limit_pref_v=1),
            "training": {"training_data": {"systems": [str(s) for s in train], "batch_size": 1},
                         "validation_data": {"systems": [str(s) for s in valid],
                                             "batch_size": 2, "numb_btch": 1},
                         "numb_steps": numb_steps, "seed": 7, "disp_freq": 2, "save_freq": 3},
            "validating": {"full_validation": True, "validation_freq": 2, "full_val_start": 0.0,
                           "validation_metric": "E:MAE", "max_best_ckpt": 2}}
