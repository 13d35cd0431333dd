"""The whole path on 2 real gloo ranks: build on rank 0, per-rank streams, disjoint frames,
resume."""
from __future__ import annotations

from collections import defaultdict

import pytest
from support.distributed_utils import run_ranks, values

from mdloader.testing import make_system

TYPE_MAP = ["O", "H"]
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _rank_body(rank: int, world_size: int, roots: list[str], same: bool, seed) -> dict:
    import torch

    from mdloader.loading.loader import DpLoaderSet, get_sampler_from_params
    from mdloader.loading.stateful_loader import StatefulLoader
    from mdloader.sampling.spec import SamplingSpec

    def loader():
        ls = DpLoaderSet(roots, 2, TYPE_MAP, seed=seed,
                         spec=SamplingSpec(2, same_system_across_ranks=same))
        sampler = get_sampler_from_params(ls, {"auto_prob": "prob_sys_size"}, num_samples=40)
        return ls, StatefulLoader(ls, sampler, num_workers=0)

    ls, dl = loader()
    it = iter(dl)
    head = [next(it) for _ in range(15)]
    state = dl.state_dict()
    rest = list(it) + list(dl) + list(dl)
    batches = head + rest
    for b in batches[:10]:   # the batch holds the frames it names
        frame = ls.systems[b["sid"]][b["fid"][0]]
        assert torch.allclose(b["coord"][0], torch.as_tensor(frame["coord"]))
    _, fresh = loader()
    fresh.load_state_dict(state)
    again = list(fresh) + list(fresh) + list(fresh)
    return {
        "systems": [s.system for s in ls.systems], "seed": ls.seed, "index": ls.index,
        "nframes": [len(s) for s in ls.systems], "batch_sizes": ls.batch_sizes.tolist(),
        "stream": [(b["sid"], tuple(b["fid"])) for b in batches],
        "resumed_ok": [(b["sid"], b["fid"]) for b in again] == [(b["sid"], b["fid"])
                                                                  for b in rest],
    }


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    paths = [make_system(root / "npy", "a", natoms=6, nframes=12, seed=1),
             make_system(root / "npy", "b", natoms=3, nframes=7, seed=2),
             make_system(root, "g1", natoms=4, nframes=8, backend="hdf5", seed=3),
             make_system(root, "g2", natoms=5, nframes=9, backend="hdf5", seed=4)]
    return [str(root / "npy"), paths[2].split("#")[0]]


def _passes(result: dict) -> dict[tuple[int, int], list[int]]:
    """Frames read per (system, pass) by one rank, for passes the rank completed."""
    out: dict[tuple[int, int], list[int]] = defaultdict(list)
    counts: dict[int, int] = defaultdict(int)
    for sid, fids in result["stream"]:
        nb = result["index"][sid]
        p = counts[sid] // nb
        counts[sid] += 1
        out[(sid, p)].extend(fids)
    return {k: v for k, v in out.items() if counts[k[0]] >= (k[1] + 1) * result["index"][k[0]]}


@pytest.mark.parametrize("same", [False, True])
def test_two_ranks_npy_and_hdf5(roots, same):
    res = values(run_ranks(_rank_body, 2, roots, same, 17, timeout=90))
    r0, r1 = res
    assert r0["systems"] == r1["systems"] and len(r0["systems"]) == 4
    assert any("#/" in s for s in r0["systems"]), "HDF5 systems are part of the run"
    assert r0["seed"] == r1["seed"] == 17 and r0["index"] == r1["index"]
    assert r0["resumed_ok"] and r1["resumed_ok"]
    if same:
        assert [s for s, _ in r0["stream"]] == [s for s, _ in r1["stream"]]
        for (s0, f0), (_, f1) in zip(r0["stream"], r1["stream"]):
            if r0["nframes"][s0] % (2 * r0["batch_sizes"][s0]) == 0:
                assert not set(f0) & set(f1), "ranks read the same frame at the same step"
    else:
        assert [s for s, _ in r0["stream"]] != [s for s, _ in r1["stream"]]
    p0, p1 = _passes(r0), _passes(r1)
    common = set(p0) & set(p1)
    assert common
    for sid, p in common:
        n = r0["nframes"][sid]
        both = p0[(sid, p)] + p1[(sid, p)]
        assert set(both) == set(range(n)), "a pass across ranks missed frames"
        assert len(both) == 2 * -(-n // 2), "unexpected padding"


def test_two_ranks_agree_on_a_fresh_seed(roots):
    res = values(run_ranks(_rank_body, 2, roots, False, None, timeout=90))
    assert res[0]["seed"] == res[1]["seed"]
    assert res[0]["resumed_ok"] and res[1]["resumed_ok"]
