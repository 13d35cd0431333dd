"""DpLoaderSet and the samplers on real files generated into tmp_path (single process)."""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from mdloader.data.collate import collate_batch
from mdloader.data.dataset import DeepmdDataSetForLoader
from mdloader.data.schema import DataRequirementItem
from mdloader.errors import ConfigError, CorruptFileError, StateDictError, WorkerLostError
from mdloader.loading.loader import DpLoaderSet, get_sampler_from_params, get_weighted_sampler
from mdloader.loading.pool import lost_worker_error
from mdloader.loading.stateful_loader import StatefulLoader
from mdloader.loading.system_list import SystemDatasets
from mdloader.sampling.samplers import BatchKey
from mdloader.testing import make_system
from mdloader.world import World

TYPE_MAP = ["O", "H"]


@pytest.fixture(scope="module")
def systems(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    spec = [(6, 10), (3, 7), (12, 1), (6, 16)]       # (natoms, nframes)
    paths = [make_system(root, f"sys{i}", natoms=n, nframes=f, seed=i)
             for i, (n, f) in enumerate(spec)]
    h5 = make_system(root, "grp", natoms=4, nframes=9, backend="hdf5", seed=9)
    return paths, h5, root


@pytest.fixture(scope="module")
def water192(tmp_path_factory):
    root = tmp_path_factory.mktemp("water")
    return make_system(root, "data_0", natoms=192, nframes=4, keys=("energy", "force"))


@pytest.mark.parametrize("rule,expected", [("auto:384", 2), ("auto:383", 2), ("auto:193", 2),
                                           ("auto:192", 1), ("auto:191", 1), ("auto:32", 1),
                                           ("auto", 1), ("max:384", 2), ("max:383", 1),
                                           ("max:193", 1), ("max:192", 1), ("max:191", 1),
                                           ("filter:193", 1), ("filter:192", 1), (2, 2), (3, 3),
                                           ([3], 3)])
def test_deepmd_dploaderset_batch_sizes(water192, rule, expected):
    ls = DpLoaderSet([water192], rule, TYPE_MAP, seed=0)
    assert ls.batch_sizes[0] == expected


def test_deepmd_dploaderset_errors(water192, caplog):
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        with pytest.raises(ValueError, match="No system left after removing systems with more "
                                             "than 191 atoms"):
            DpLoaderSet([water192], "filter:191", TYPE_MAP)
    assert "Remove 1 systems with more than 191 atoms" in caplog.text
    with pytest.raises(ValueError, match="Unsupported batch size rule: unknown"):
        DpLoaderSet([water192], "unknown", TYPE_MAP)
    with pytest.raises(ConfigError, match="not supported"):
        DpLoaderSet([water192], 1, TYPE_MAP, modifier=object())


def test_attributes_and_int_indexing(systems):
    paths, h5, _ = systems
    ls = DpLoaderSet(paths + [h5], 3, TYPE_MAP, seed=1)
    assert len(ls) == 5 and [s.system for s in ls.systems] == paths + [h5]  # the order given
    assert ls.index == [-(-len(s) // 3) for s in ls.systems]
    assert sorted(ls.index) == [1, 3, 3, 4, 6]
    assert ls.total_batch == sum(ls.index)
    sid = [s.system for s in ls.systems].index(paths[3])
    frames = []
    for _ in range(ls.index[sid]):
        batch = ls[sid]
        assert batch["sid"] == sid
        np.testing.assert_allclose(batch["coord"][0].numpy(),
                                   ls.systems[sid][batch["fid"][0]]["coord"])
        frames += batch["fid"]
    assert sorted(frames) == list(range(16))
    second = sum((ls[sid]["fid"] for _ in range(ls.index[sid])), [])
    assert sorted(second) == list(range(16)) and second != frames, "next pass not reshuffled"


def test_key_indexing_equals_collate_of_frames(systems):
    paths, h5, _ = systems
    ls = DpLoaderSet(paths + [h5], 2, TYPE_MAP, seed=1)
    for sid in range(len(ls)):
        fids = (0, len(ls.systems[sid]) - 1)
        got = ls[BatchKey(sid, fids, 0)]
        ref = collate_batch(ls.systems[sid].get_frames(list(fids)))
        assert got.pop("sid") == sid
        assert set(got) == set(ref)
        for k, v in ref.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(got[k], v), k
            else:
                assert got[k] == v or (v is None and got[k] is None), k


def test_sampler_precedence_and_weights(systems):
    paths, _, _ = systems
    ls = DpLoaderSet(paths, 1, TYPE_MAP, seed=3)
    nb = np.asarray(ls.index, dtype=float)
    s = get_sampler_from_params(ls, {"sys_probs": [0.1, -1, 0.2, -1], "auto_prob": "prob_uniform"})
    rest = 0.7 * nb[[1, 3]] / nb[[1, 3]].sum()
    np.testing.assert_allclose(s.weights.numpy(), [0.1, rest[0], 0.2, rest[1]])
    s = get_sampler_from_params(ls, {"sys_probs": None, "auto_prob": "prob_uniform"})
    np.testing.assert_allclose(s.weights.numpy(), [0.25] * 4)
    s = get_sampler_from_params(ls, {}, num_workers=3)
    np.testing.assert_allclose(s.weights.numpy(), nb / nb.sum())
    assert len(s) == ls.total_batch * 3 and ls.sampler is s
    with pytest.raises(ConfigError, match="sys_probs: sys_probs has 3 entries but there are 4"):
        get_sampler_from_params(ls, {"sys_probs": [0.1, 0.4, 0.5]})
    with pytest.raises(ConfigError, match="auto_prob: unknown probability style"):
        get_weighted_sampler(ls, "prob_sys_sze")


def test_filter_remaps_sys_probs(systems):
    paths, _, _ = systems
    # natoms 6, 3, 12, 6 (sorted order sys0..sys3): filter:6 drops sys2.
    ls = DpLoaderSet(paths, "filter:6", TYPE_MAP, seed=0)
    assert len(ls) == 3
    s = get_weighted_sampler(ls, [0.5, 0.25, 0.0, 0.25], sys_prob=True)
    np.testing.assert_allclose(s.weights.numpy(), [0.5, 0.25, 0.25])
    s = get_weighted_sampler(ls, "prob_sys_size;0:2:0.5;2:4:0.5")
    assert s.weights[2] == pytest.approx(0.5)


def test_a_filter_keeps_the_systems_unmade_and_in_order(systems):
    """filter:N over a built table makes no dataset up front (10^6 systems stay cheap), and the
    kept systems still pickle for workers."""
    paths, _, _ = systems
    ls = DpLoaderSet(paths, "filter:6", TYPE_MAP, seed=0)
    assert isinstance(ls.systems, SystemDatasets) and set(ls.systems._made) == {None}
    assert [os.path.basename(s.system) for s in ls.systems] == ["sys0", "sys1", "sys3"]
    assert list(ls.nframes) == [len(s) for s in ls.systems]
    again = pickle.loads(pickle.dumps(ls.systems))
    assert [s.system for s in again] == [s.system for s in ls.systems]


def test_dataloaders_are_lazy_iterables(systems):
    paths, h5, _ = systems
    ls = DpLoaderSet(paths + [h5], 4, TYPE_MAP, seed=0)
    assert len(ls.dataloaders) == len(ls)
    assert not isinstance(ls.dataloaders[0], DataLoader)
    for sid, dl in enumerate(ls.dataloaders):
        assert len(dl) == ls.index[sid] and dl.dataset is ls.systems[sid]
        first = [b["fid"] for b in dl]
        assert [b["fid"] for b in dl] == first, "a fresh iter() restarts"
        assert sorted(sum(first, [])) == list(range(len(ls.systems[sid])))
    with pytest.raises(IndexError):
        ls.dataloaders[len(ls)]


def test_print_summary(systems, caplog):
    paths, _, _ = systems
    ls = DpLoaderSet(paths, 2, TYPE_MAP, seed=0)
    s = get_weighted_sampler(ls, "prob_sys_size")
    with caplog.at_level(logging.INFO, logger="mdloader"):
        ls.print_summary("training", s.weights.tolist())
    lines = [r.getMessage() for r in caplog.records]
    assert any("natoms  bch_sz   n_bch" in line for line in lines)
    row = next(line for line in lines if line.startswith(ls.systems[0].system))
    assert row.split()[1:] == ["6", "2", str(ls.index[0]), f"{s.weights[0]:.3e}", "T"]
    caplog.clear()
    other = DpLoaderSet(paths, 2, TYPE_MAP, seed=0, world=World(rank=1, world_size=2))
    with caplog.at_level(logging.INFO, logger="mdloader"):
        other.print_summary("training", [0.25] * 4)
    assert caplog.records == []


def test_no_global_side_effects(systems):
    paths, _, _ = systems
    torch_state = torch.get_rng_state()
    np_state = np.random.get_state()[1].copy()
    strategy = torch.multiprocessing.get_sharing_strategy()
    ls = DpLoaderSet(paths, 2, TYPE_MAP, seed=123)
    list(get_weighted_sampler(ls, "prob_uniform", num_samples=10))
    assert torch.equal(torch.get_rng_state(), torch_state)
    np.testing.assert_array_equal(np.random.get_state()[1], np_state)
    assert torch.multiprocessing.get_sharing_strategy() == strategy


def test_seed_conventions(systems):
    paths, _, _ = systems
    a = DpLoaderSet(paths, 2, TYPE_MAP, seed=[1, 77], world=World(rank=1, world_size=2))
    assert a.seed == 77
    b = DpLoaderSet(paths, 2, TYPE_MAP)
    c = DpLoaderSet(paths, 2, TYPE_MAP)
    assert b.seed != c.seed, "seed=None draws a fresh seed"


def test_prebuilt_systems_pass_through(systems):
    paths, _, _ = systems
    built = [DeepmdDataSetForLoader(p, TYPE_MAP) for p in paths]
    ls = DpLoaderSet(built, 1, TYPE_MAP, seed=0)
    assert ls.systems[0] is built[0]
    metas = DpLoaderSet([b.meta for b in built], 1, TYPE_MAP, seed=0)
    assert [s.system for s in metas.systems] == [s.system for s in ls.systems]


def _ids(batches):
    return [(b["sid"], tuple(b["fid"])) for b in batches]


def test_outer_dataloader_with_workers_no_duplicates(systems):
    paths, h5, _ = systems
    ls = DpLoaderSet(paths + [h5], 2, TYPE_MAP, seed=5)
    sampler = get_weighted_sampler(ls, "prob_sys_size", num_workers=2)
    dl = DataLoader(ls, sampler=sampler, batch_size=None, num_workers=2, collate_fn=lambda b: b)
    got = _ids(dl) + _ids(dl)        # two outer epochs, as DeePMD's cycle_iterator does
    ref_ls = DpLoaderSet(paths + [h5], 2, TYPE_MAP, seed=5)
    ref = get_weighted_sampler(ref_ls, "prob_sys_size", num_workers=2)
    expected = [(k.sid, k.fids) for k in list(ref) + list(ref)]
    assert got == expected
    # within each system, every pass is a permutation of its frames: nothing repeated/skipped
    for sid in range(len(ls)):
        fr = [f for s, fids in got if s == sid for f in fids]
        n, nb_frames = len(ls.systems[sid]), ls.index[sid] * ls.batch_sizes[sid]
        full = (len(fr) // n) * n if nb_frames == n else 0
        for start in range(0, full, n):
            assert sorted(fr[start:start + n]) == list(range(n))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_identical_stream(systems, num_workers):
    paths, h5, _ = systems
    k = 9

    def new():
        ls = DpLoaderSet(paths + [h5], 2, TYPE_MAP, seed=11)
        return StatefulLoader(ls, get_weighted_sampler(ls, "prob_sys_size", num_samples=30),
                              num_workers=num_workers)

    a = new()
    it = iter(a)
    head = [next(it) for _ in range(k)]
    state = a.state_dict()
    rest = list(it) + list(a)
    b = new()
    b.load_state_dict(state)
    again = list(b) + list(b)
    assert _ids(again) == _ids(rest) and len(head) == k
    for x, y in zip(again, rest):
        assert torch.equal(x["coord"], y["coord"])


def test_loader_state_dict(systems):
    paths, _, _ = systems
    ls = DpLoaderSet(paths, 2, TYPE_MAP, seed=2)
    sampler = get_weighted_sampler(ls, "prob_uniform", num_samples=10)
    keys = [sampler.next_key() for _ in range(4)]
    ls[1], ls[1], ls[3]
    state, sampler_state = ls.state_dict(), sampler.state_dict()
    assert state["cursor_sids"] == [1, 3] and state["cursor_counts"] == [2, 1]
    nxt = (ls[1]["fid"], sampler.next_key())
    other = DpLoaderSet(paths, 2, TYPE_MAP, seed=2)
    get_weighted_sampler(other, "prob_uniform", num_samples=10).load_state_dict(sampler_state)
    other.load_state_dict(state)
    assert (other[1]["fid"], other.sampler.next_key()) == nxt and len(keys) == 4
    with pytest.raises(StateDictError, match="keys"):
        other.load_state_dict({"version": 2})
    reseeded = DpLoaderSet(paths, 2, TYPE_MAP, seed=3)
    with pytest.raises(StateDictError, match="seed 2 but this loader has 3"):
        reseeded.load_state_dict(state)


def _assert_same_batches(got, ref):
    """Same keys, types, dtypes, shapes and values; batches are plain dicts as without workers."""
    assert len(got) == len(ref)
    for x, y in zip(got, ref):
        assert type(x) is dict and set(x) == set(y)
        for k, v in y.items():
            if isinstance(v, torch.Tensor):
                assert type(x[k]) is torch.Tensor and x[k].dtype == v.dtype, k
                assert x[k].shape == v.shape and torch.equal(x[k], v), k
            else:
                assert type(x[k]) is type(v) and (x[k] == v or v is None), k


def test_numpy_transport_yields_the_same_batches(systems):
    paths, h5, _ = systems

    def batches(num_workers, **kw):
        ls = DpLoaderSet(paths + [h5], 2, TYPE_MAP, seed=4)
        sampler = get_weighted_sampler(ls, "prob_sys_size", num_samples=12)
        return list(StatefulLoader(ls, sampler, num_workers=num_workers, **kw))

    _assert_same_batches(batches(2), batches(0))


def test_deepmd_outer_dataloader_same_batches_with_workers(systems, tmp_path):
    # DeePMD-kit's trainer: DataLoader(ls, sampler, batch_size=None, collate_fn=lambda b: b).
    paths, h5, _ = systems
    nopbc = make_system(tmp_path, "nopbc", natoms=5, nframes=6, pbc=False, seed=7)

    def batches(num_workers):
        ls = DpLoaderSet(paths + [h5, nopbc], 2, TYPE_MAP, seed=5)
        ls.add_data_requirement([DataRequirementItem(k, ndof=n, atomic=a, must=False)
                                 for k, n, a in (("energy", 1, False), ("force", 3, True),
                                                 ("dipole", 3, False))])  # dipole: find 0
        sampler = get_weighted_sampler(ls, "prob_uniform", num_samples=24)
        return list(DataLoader(ls, sampler=sampler, batch_size=None, num_workers=num_workers,
                               collate_fn=lambda b: b))

    ref = batches(0)
    assert any(b["box"] is None for b in ref) and any(b["box"] is not None for b in ref)
    assert all(b["find_dipole"] == 0 and type(b["find_energy"]) is np.float32
               and b["dipole"].dtype == torch.float64 and type(b["fid"]) is list
               and type(b["sid"]) is int for b in ref)
    _assert_same_batches(batches(2), ref)


def test_transport_batch_pickles_tensors_as_numpy(systems, monkeypatch):
    from multiprocessing.reduction import ForkingPickler

    from mdloader.transport import TransportBatch

    ls = DpLoaderSet(systems[0], 2, TYPE_MAP, seed=1)
    assert type(ls[BatchKey(0, (0, 1), 0)]) is dict and type(ls[0]) is dict
    # "in a worker", without what a real worker does to its own process (freezing its heap,
    # dying with its parent, ignoring stop signals): this is the test process
    monkeypatch.setattr("mdloader.loading.loader.get_worker_info", lambda: object())
    monkeypatch.setattr("mdloader.loading.loader.settle_worker", lambda: None)
    monkeypatch.setattr("mdloader.loading.loader.bind_to_rank", lambda: None)
    assert type(ls[BatchKey(0, (0, 1), 0)]) is TransportBatch
    assert type(ls[0]) is TransportBatch
    batch = {"coord": torch.arange(6.0).reshape(1, 2, 3), "atype": torch.tensor([[0, 1]]),
             "box": None, "find_energy": np.float32(1.0), "fid": [3], "sid": 2,
             "half": torch.ones(2, dtype=torch.bfloat16)}   # numpy cannot hold it: torch's path
    func, (sent, keys) = TransportBatch(batch).__reduce__()
    assert set(keys) == {"coord", "atype"} and isinstance(sent["coord"], np.ndarray)
    got = ForkingPickler.loads(ForkingPickler.dumps(TransportBatch(batch)))
    _assert_same_batches([got], [batch])


def test_unseeded_loader_adopts_the_saved_seed(systems):
    paths, _, _ = systems
    a = DpLoaderSet(paths, 2, TYPE_MAP)
    sa = get_weighted_sampler(a, "prob_uniform", num_samples=10)
    [sa.next_key() for _ in range(3)]
    state, sampler_state = a.state_dict(), sa.state_dict()
    b = DpLoaderSet(paths, 2, TYPE_MAP)
    get_weighted_sampler(b, "prob_uniform", num_samples=10).load_state_dict(sampler_state)
    b.load_state_dict(state)
    assert b.seed == a.seed and b.sampler.next_key() == sa.next_key()
    assert [x["fid"] for x in b.dataloaders[0]] == [x["fid"] for x in a.dataloaders[0]]


# -- failures inside DataLoader workers ----------------------------------------------------------
def _loader_over(root, workers: int) -> StatefulLoader:
    path = make_system(root, "s", natoms=4, nframes=6, nsets=2, keys=("energy", "force"))
    ls = DpLoaderSet([path], 1, TYPE_MAP, seed=1)
    ls.add_data_requirement([DataRequirementItem("force", 3, atomic=True, must=True)])
    return StatefulLoader(ls, get_sampler_from_params(ls, {}, num_workers=workers),
                          num_workers=workers)


@pytest.mark.timeout(60)
def test_a_worker_error_reaches_the_main_process_with_its_system_and_file(tmp_path):
    """torch re-raises a worker's exception as ``type(exc)(traceback text)``: a DataError would
    arrive without system and file, its message a traceback. The loader carries it whole."""
    loader = _loader_over(tmp_path, workers=1)
    path = tmp_path / "s" / "set.001" / "force.npy"
    os.truncate(path, path.stat().st_size - 8)
    others = set(multiprocessing.active_children())
    with pytest.raises(CorruptFileError, match=r"^the npy file is shorter than its header") as info:
        list(loader)
    assert (info.value.system, info.value.file) == (str(tmp_path / "s"), str(path))
    # the error's traceback holds the DataLoader iterator: its worker has ended all the same
    assert set(multiprocessing.active_children()) <= others


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sig", "said"), [
    (signal.SIGKILL, r"is killed by signal SIGKILL \(killed from outside or out of memory: see "
                     r"the kernel log \(dmesg\)\)"),
    (signal.SIGBUS, r"is killed by signal SIGBUS \(a memory-mapped file may have been truncated "
                    r"while it was read\)")])
def test_a_killed_worker_is_a_worker_lost_error(tmp_path, sig, said):
    """Found from the worker processes themselves, wherever torch noticed it: never from the
    text of torch's error."""
    loader = _loader_over(tmp_path, workers=1)
    others = set(multiprocessing.active_children())
    batches = iter(loader)
    next(batches)
    # this loader's worker only: torch raises once per iterator whose worker died, so killing a
    # worker another test left alive would raise a second time, inside the first one's handling
    for child in set(multiprocessing.active_children()) - others:
        os.kill(child.pid, sig)
    with pytest.raises(WorkerLostError, match=rf"^DataLoader worker \(pid \d+\) {said}$"):
        try:
            for _ in batches:
                time.sleep(0.05)
        except RuntimeError as exc:  # torch's SIGCHLD handler may raise it outside the loader
            raise (lost_worker_error() or exc) from exc
    batches.close()
    assert lost_worker_error() is None  # the loader's pool ended: nothing left to find


def test_probability_errors_name_the_full_json_path(systems):
    """As ``mdloader check`` does: the key under its section, not a bare ``sys_probs``."""
    paths, _, _ = systems
    ls = DpLoaderSet(paths, 1, TYPE_MAP, seed=0)
    with pytest.raises(ConfigError, match=r"^training\.training_data\.sys_probs: sys_probs has 3 "
                       r"entries but there are 4 systems"):
        get_sampler_from_params(ls, {"sys_probs": [0.2, 0.3, 0.5]},
                                json_path="training.training_data")
    with pytest.raises(ConfigError, match=r"^training\.validation_data\.auto_prob: "):
        get_sampler_from_params(ls, {"auto_prob": "prob_sys_sze"},
                                json_path="training.validation_data")


@pytest.mark.parametrize("rank", [0, 1])
def test_whole_system_loaders_give_every_frame_once_on_any_rank(tmp_path, rank) -> None:
    """What DeePMD-kit's own statistics action reads under ``MDLOADER_STAT_FRAMES=all``: every
    frame of each system once, in file order, in batches of its batch size (the last short),
    whatever the rank's shard; this rank's ``dataloaders`` read its shard of pass 0 only."""
    from mdloader.loading.loader import WholeSystemLoaders
    from mdloader.testing import make_dataset
    from mdloader.world import World

    paths = make_dataset(tmp_path / "d", 2, nframes=7, seed=4)
    ls = DpLoaderSet(paths, 3, ["O", "H"], seed=5, world=World(rank, 2))
    whole = WholeSystemLoaders(ls)
    for sid in range(len(whole)):
        fids = [list(b["fid"]) for b in whole[sid]]
        assert fids == [[0, 1, 2], [3, 4, 5], [6]] and len(whole[sid]) == 3
        assert all(b["sid"] == sid for b in whole[sid])
        shard = [f for b in ls.dataloaders[sid] for f in b["fid"]]
        assert len(shard) < 7
