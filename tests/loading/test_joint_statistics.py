"""Several statistics in one joint pass (:func:`mdloader.loading.statistics.joint_pass`): one
all-gather for every request of a job, parts equal across requests computed once, a pass that
is not cached never stored, and each request's result that of its own pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mdloader.loading.statistics as st
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.schema import DataRequirementItem
from mdloader.loading.statistics import InputRequest, StatPass, job_input_statistics, joint_pass
from mdloader.stats.env_mat import EnvMatSettings
from mdloader.testing import make_system

TYPE_MAP = ["O", "H"]


def _datasets(paths: list[str]) -> list[DeepmdDataSetForLoader]:
    out = [DeepmdDataSetForLoader(p, TYPE_MAP) for p in paths]
    for ds in out:
        ds.add_data_requirement([DataRequirementItem("energy", 1, atomic=False, must=False,
                                                     high_prec=True)])
    return out


def test_every_request_in_one_gather_and_shared_parts_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = [make_system(tmp_path / "d", f"a{i}", natoms=5 + i, nframes=3, seed=i) for i in range(3)]
    b = [make_system(tmp_path / "d", f"b{i}", natoms=6, nframes=2, seed=9 + i) for i in range(2)]
    near, far = EnvMatSettings(3.0, 0.5, (8, 16), 2), EnvMatSettings(4.0, 0.5, (12, 24), 2)
    # task 1: a with near; task 2: a and b with near (a's parts are task 1's); task 3: b with far
    requests = [InputRequest(_datasets(a), [near], TYPE_MAP),
                InputRequest(_datasets(a + b), [near], TYPE_MAP),
                InputRequest(_datasets(b), [far], TYPE_MAP, frames={0: [1]}.get)]
    gathers, computed = [], []
    real_gather, real_sums = st.gather_from_every_rank, st.system_env_sums
    monkeypatch.setattr(st, "gather_from_every_rank",
                        lambda *a, **k: gathers.append(k["context"]) or real_gather(*a, **k))

    def spy(ds, settings, *, frames=None):  # type: ignore[no-untyped-def]
        computed.append((ds.meta.address, settings.rcut, frames))
        return real_sums(ds, settings, frames=frames)

    monkeypatch.setattr(st, "system_env_sums", spy)
    joint = job_input_statistics(requests, mode="off")
    assert gathers == ["environment/output statistics"]  # one all-gather for the job
    assert sorted(computed, key=str) == sorted(
        [(s, 3.0, None) for s in a + b] + [(b[0], 4.0, [1]), (b[1], 4.0, None)], key=str)
    monkeypatch.setattr(st, "gather_from_every_rank", real_gather)
    for request, (sums, samples) in zip(requests, joint, strict=True):
        alone_sums, alone_samples = job_input_statistics([request], mode="off")[0]
        for x, y in zip(sums, alone_sums, strict=True):
            np.testing.assert_array_equal(x.total, y.total)
            np.testing.assert_array_equal(x.number, y.number)
        assert len(samples) == len(alone_samples) == len(request.datasets)
        for x, y in zip(samples, alone_samples, strict=True):
            for field in ("counts", "labels", "positions"):
                np.testing.assert_array_equal(getattr(x, field), getattr(y, field))


def test_a_pass_not_cached_is_never_stored(tmp_path: Path) -> None:
    paths = [make_system(tmp_path / "d", f"s{i}", natoms=4, nframes=2, seed=i) for i in range(2)]
    cache = tmp_path / "cache"
    calls = []

    def natoms(ds):  # type: ignore[no-untyped-def]
        calls.append(ds.meta.address)
        return {"natoms": ds.meta.natoms}  # any picklable value

    spec = StatPass(_datasets(paths), "probe", {}, TYPE_MAP, natoms, cached=False)
    for _ in range(2):
        results, report = joint_pass([spec], mode="check", folder=str(cache))
        assert results == [[{"natoms": 4}, {"natoms": 4}]]
        assert report.kinds["probe"]["cached"] == 0
    assert len(calls) == 4 and not any(p.is_file() for p in cache.rglob("*"))
