"""``MDLOADER_STAT_FRAMES=all``: ``mdloader train``'s statistics read every frame of every
training system, whatever ``data_stat_nbatch``: the same values as a ``data_stat_nbatch`` that
covers every system, and other values than the default sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mdloader import DpLoaderSet
from mdloader.errors import ConfigError
from mdloader.testing import make_system
from mdloader.train import statistics
from mdloader.train.job import LABELS
from mdloader.train.model import RadialPotential
from mdloader.train.statistics import fit_statistics


def _fitted(paths: list[str], nbatch: int) -> dict[str, np.ndarray]:
    data = DpLoaderSet(paths, 2, ["O", "H"], seed=3)
    data.add_data_requirement(LABELS)
    model = RadialPotential(2, rcut=2.5, nbasis=4)
    fit_statistics(model, data, nbatch=nbatch, device=torch.device("cpu"))
    return {name: model.get_buffer(name).numpy().copy()
            for name in ("energy_bias", "feat_mean", "feat_std")}


def test_every_frame_equals_a_data_stat_nbatch_covering_every_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [make_system(tmp_path / "data", f"s{i}", natoms=5 + i, nframes=12, seed=i,
                         keys=("energy", "force")) for i in range(4)]
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MDLOADER_STAT_FRAMES", raising=False)
    sample = _fitted(paths, nbatch=1)
    with monkeypatch.context() as patched:  # the feature scales read every statistics batch
        patched.setattr(statistics, "FEATURE_NBATCH", 1000)
        covering = _fitted(paths, nbatch=1000)  # 6 batches of 2 cover each system of 12 frames
    monkeypatch.setenv("MDLOADER_STAT_FRAMES", "all")
    every = _fitted(paths, nbatch=1)
    for name in every:
        np.testing.assert_allclose(every[name], covering[name], rtol=1e-12, atol=1e-15,
                                   err_msg=name)
    for name in every:
        assert not np.allclose(sample[name], every[name], rtol=1e-6), name
    monkeypatch.setenv("MDLOADER_STAT_FRAMES", "every")
    with pytest.raises(ConfigError, match=r"^MDLOADER_STAT_FRAMES: expected one of sample, all"):
        _fitted(paths, nbatch=1)
