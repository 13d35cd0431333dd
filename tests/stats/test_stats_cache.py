"""Cache keys change with every input the statistics depend on; payloads round-trip exactly."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from support import stats_data

from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.errors import CorruptFileError
from mdloader.stats.cache import cache_key, dumps, loads
from mdloader.stats.env_mat import EnvMatSettings, system_env_sums
from mdloader.stats.moments import FeatureMoments
from mdloader.stats.neighbours import NeighbourStats, system_neighbour_stats
from mdloader.stats.output import OutputSamples

BASE = dict(stamp="mtime=1:size=2", kind="env_mat",
            settings={"type": "se_e2_a", "rcut": 6.0, "rcut_smth": 0.5, "sel": [46, 92]},
            type_map=["O", "H"], frames=None)


def _key(**change) -> str:
    args = {**BASE, **change}
    return cache_key(args["stamp"], args["kind"], args["settings"], args["type_map"],
                     args["frames"])


def test_key_depends_on_every_input() -> None:
    keys = {
        _key(),
        _key(stamp="mtime=2:size=2"),
        _key(kind="neighbours"),
        _key(settings={**BASE["settings"], "rcut": 6.000001}),
        _key(settings={**BASE["settings"], "rcut_smth": 1.0}),
        _key(settings={**BASE["settings"], "sel": [46, 93]}),
        _key(settings={**BASE["settings"], "type": "dpa1"}),
        _key(type_map=["H", "O"]),
        _key(frames=[0, 1]),
        _key(frames=[0, 2]),
    }
    assert len(keys) == 10
    assert _key() == _key(settings=dict(reversed(list(BASE["settings"].items()))))
    assert _key(frames=[2, 0, 2]) == _key(frames=[0, 2])


def test_payloads_round_trip_bit_for_bit(tmp_path: Path) -> None:
    system = stats_data.generated(tmp_path)["small"][0]
    ds = DeepmdDataSetForLoader(system, ["O", "H"])
    nb = system_neighbour_stats(ds, 6.0, 2)
    assert loads(dumps(nb)) == nb and loads(dumps(nb)).min_distance2 == nb.min_distance2
    empty = NeighbourStats.empty(6.0, 2, True)
    assert math.isinf(loads(dumps(empty)).min_distance2)
    sums = system_env_sums(ds, EnvMatSettings(6.0, 1.0, (4, 6), 2))
    back = loads(dumps(sums))
    for name in ("number", "total", "squared"):
        assert np.array_equal(getattr(back, name), getattr(sums, name))
    samples = OutputSamples("energy", np.array([[2, 4]]), np.array([[-1.5]]),
                            np.array([[3, 0]]))
    back = loads(dumps(samples))
    assert back.key == "energy" and np.array_equal(back.labels, samples.labels)
    moments = FeatureMoments.of_rows(np.random.default_rng(0).random((7, 5)) / 3)
    back = loads(dumps(moments))
    assert back.count == 7 and back.total.tobytes() == moments.total.tobytes()
    assert back.squared.tobytes() == moments.squared.tobytes()


def test_unreadable_payloads_are_named() -> None:
    with pytest.raises(CorruptFileError, match="cache entry cannot be read; file: entry-7"):
        loads(b"\x92garbage", source="entry-7")
    with pytest.raises(CorruptFileError, match="another format.*expected: format 1"):
        loads(dumps(NeighbourStats.empty(6.0, 2, True)).replace(b"\x01", b"\x09", 1))
    with pytest.raises(TypeError, match="no cache format for dict"):
        dumps({})
