"""DeePMD-kit 3.2's LMDB names from ``mdloader``: the same signatures, the same batches as
DeePMD-kit's samplers (run in its own interpreter) for every rule and layout, ``mix:N``'s
padding, and ``merge_lmdb`` remapping type maps without ever swapping species."""

from __future__ import annotations

import inspect
import itertools
import json
import subprocess
import textwrap
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from support.deepmd_env import require_deepmd_python

import mdloader
from mdloader.data.formats.lmdb import codec, environment
from mdloader.data.formats.lmdb.environment import METADATA_KEY, frame_key
from mdloader.testing import make_lmdb, make_system

TYPE_MAP = ["O", "H"]
NAMES = ["LmdbDataReader", "LmdbBatchSampler", "DistributedLmdbBatchSampler", "LmdbDataset",
         "LmdbBatchDataLoader", "merge_lmdb", "compute_block_targets", "is_lmdb"]
RULES = [2, "auto:12", "max:14", "filter:6", "mix:14", "mix:40"]


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Six systems of 3..5 atoms in one database, written by ``mdloader pack``'s writer."""
    root = tmp_path_factory.mktemp("names")
    systems = [make_system(root / "src", f"s{i}", natoms=3 + i % 3, nframes=5 + 2 * i, seed=i)
               for i in range(6)]
    return make_lmdb(root / "train.lmdb", systems)


def _deepmd(script: str, **values: object) -> object:
    """Run ``script`` under DeePMD-kit's interpreter; it prints one JSON value."""
    python = require_deepmd_python()
    head = "".join(f"{name} = {value!r}\n" for name, value in values.items())
    done = subprocess.run([python, "-c", head + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ours(path: str, rule: object, ragged: bool) -> dict[str, object]:
    reader = mdloader.LmdbDataReader(path, TYPE_MAP, rule)
    reader.use_ragged_batches(ragged)
    out: dict[str, object] = {"len": len(reader), "total_batch": reader.total_batch,
                              "batch_size": reader.batch_size}
    for seed, epoch in ((0, 0), (3, 0), (3, 2)):
        sampler = mdloader.LmdbBatchSampler(reader, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        out[f"single {seed} {epoch}"] = list(sampler)
        for world in (2, 3):
            for rank in range(world):
                dist = mdloader.DistributedLmdbBatchSampler(reader, rank, world, seed=seed)
                dist.set_epoch(epoch)
                out[f"dist {seed} {epoch} {rank}/{world}"] = [list(dist), len(dist)]
    out["unshuffled"] = list(mdloader.LmdbBatchSampler(reader, shuffle=False))
    return out


THEIRS = """
import json
from deepmd.dpmodel.utils.lmdb_data import (LmdbDataReader, LmdbBatchSampler,
                                            DistributedLmdbBatchSampler)
result = {}
for rule, ragged in CASES:
    reader = LmdbDataReader(PATH, ["O", "H"], rule)
    reader.use_ragged_batches(ragged)
    out = {"len": len(reader), "total_batch": reader.total_batch,
           "batch_size": reader.batch_size}
    for seed, epoch in ((0, 0), (3, 0), (3, 2)):
        sampler = LmdbBatchSampler(reader, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        out[f"single {seed} {epoch}"] = [[int(i) for i in b] for b in sampler]
        for world in (2, 3):
            for rank in range(world):
                dist = DistributedLmdbBatchSampler(reader, rank, world, seed=seed)
                dist.set_epoch(epoch)
                out[f"dist {seed} {epoch} {rank}/{world}"] = [
                    [[int(i) for i in b] for b in dist], len(dist)]
    out["unshuffled"] = [[int(i) for i in b]
                         for b in LmdbBatchSampler(reader, shuffle=False)]
    result[f"{rule} {ragged}"] = out
print(json.dumps(result))
"""


def test_batches_equal_deepmd_samplers_for_every_rule_and_layout(database: str) -> None:
    cases = [(rule, ragged) for rule in RULES for ragged in (False, True)]
    theirs = _deepmd(THEIRS, PATH=database, CASES=cases)
    for rule, ragged in cases:
        ours = json.loads(json.dumps(_ours(database, rule, ragged)))
        assert ours == theirs[f"{rule} {ragged}"], (rule, ragged)  # type: ignore[index]
    nlocs = mdloader.LmdbDataReader(database, TYPE_MAP).frame_nlocs
    for ragged in (False, True):  # the comparison covered batches of several atom counts
        mixed = _ours(database, "mix:40", ragged)["single 0 0"]
        assert any(len(set(nlocs[batch].tolist())) > 1 for batch in mixed)  # type: ignore


BATCH = """
import json
import numpy as np
from deepmd.dpmodel.utils.lmdb_data import LmdbDataReader
reader = LmdbDataReader(PATH, ["O", "H"], "mix:14")
reader.use_ragged_batches(RAGGED)
batch = reader.decode_batch(INDICES)
print(json.dumps({k: (np.asarray(v).tolist() if k != "fid" else [int(i) for i in v])
                  for k, v in batch.items() if v is not None}))
"""


@pytest.mark.parametrize("ragged", [False, True])
def test_a_mixed_batch_is_padded_with_phantom_atoms_as_deepmd_pads_it(database: str,
                                                                      ragged: bool) -> None:
    reader = mdloader.LmdbDataReader(database, TYPE_MAP, "mix:14")
    reader.use_ragged_batches(ragged)
    nlocs = reader.frame_nlocs
    indices = [int(np.flatnonzero(nlocs == n)[0]) for n in (3, 5, 4)]
    ours = reader.decode_batch(indices)
    theirs = _deepmd(BATCH, PATH=database, RAGGED=ragged, INDICES=indices)
    assert sorted(k for k, v in ours.items() if v is not None) == sorted(theirs)  # type: ignore
    for key, value in theirs.items():  # type: ignore[union-attr]
        np.testing.assert_allclose(np.asarray(ours[key], dtype=float),
                                   np.asarray(value, dtype=float), rtol=0, atol=0, err_msg=key)
    if not ragged:
        assert ours["atype"].shape == (3, 5)
        assert ours["atype"][0].tolist()[3:] == [-1, -1] and ours["atype"][2][4] == -1
        assert not ours["coord"][0, 3:].any() and not ours["force"][0, 3:].any()


SIGNATURES = """
import inspect, json
from deepmd.dpmodel.utils import lmdb_data as d
from deepmd.pt.utils import lmdb_dataset as p
found = {}
for name in NAMES:
    obj = getattr(d, name, None) or getattr(p, name)
    target = obj.__init__ if inspect.isclass(obj) else obj
    found[name] = [[q.name, q.kind.name, repr(q.default)]
                   for q in inspect.signature(target).parameters.values()]
print(json.dumps(found))
"""


def test_public_signatures_are_deepmds() -> None:
    theirs = _deepmd(SIGNATURES, NAMES=NAMES)
    for name in NAMES:
        obj = getattr(mdloader, name)
        target = obj.__init__ if inspect.isclass(obj) else obj
        ours = [[q.name, q.kind.name, repr(q.default)]
                for q in inspect.signature(target).parameters.values()]
        assert ours == theirs[name], name  # type: ignore[index]
    assert mdloader.SameNlocBatchSampler is mdloader.LmdbBatchSampler
    assert mdloader.DistributedSameNlocBatchSampler is mdloader.DistributedLmdbBatchSampler


def test_dataset_iterates_padded_tensors_on_the_cpu(database: str) -> None:
    dataset = mdloader.LmdbDataset(database, TYPE_MAP, batch_size="mix:14")
    loader = mdloader.LmdbBatchDataLoader(
        dataset, mdloader.DistributedLmdbBatchSampler(dataset.reader, 0, 2, seed=1),
        pin_memory=False)
    batches = list(loader)
    assert len(batches) == len(loader) > 0
    for batch in batches + [next(iter(dataset.dataloaders[0]))]:
        assert batch["coord"].device == torch.device("cpu")
        nlocs = (batch["atype"] >= 0).sum(dim=1)
        assert batch["natoms"][:, 0].tolist() == nlocs.tolist()
        assert batch["coord"].shape[1] == int(nlocs.max())
    assert dataset.total_batch == len(dataset.sampler_list[0]) and dataset.mixed_nloc


BLOCKS = """
from deepmd.dpmodel.utils.lmdb_data import (LmdbDataReader, LmdbBatchSampler,
                                            compute_block_targets)
import json
out = {}
for rule in (2, "mix:14"):
    reader = LmdbDataReader(PATH, ["O", "H"], rule)
    blocks = compute_block_targets(STYLE, reader.nsystems, reader.system_nframes)
    sampler = LmdbBatchSampler(reader, seed=4, block_targets=blocks)
    out[str(rule)] = [blocks, [[int(i) for i in b] for b in sampler]]
print(json.dumps(out))
"""


def test_auto_prob_blocks_repeat_frames_as_deepmd_does(database: str) -> None:
    style = "prob_sys_size;0:2:0.7;2:6:0.3"
    theirs = _deepmd(BLOCKS, PATH=database, STYLE=style)
    for rule in (2, "mix:14"):
        reader = mdloader.LmdbDataReader(database, TYPE_MAP, rule)
        blocks = mdloader.compute_block_targets(style, reader.nsystems, reader.system_nframes)
        batches = list(mdloader.LmdbBatchSampler(reader, seed=4, block_targets=blocks))
        assert json.loads(json.dumps([blocks, batches])) == theirs[str(rule)]  # type: ignore
        assert sum(map(len, batches)) > len(reader)  # the first block's frames repeat


def test_late_requirements_and_closed_readers_are_refused(database: str) -> None:
    reader = mdloader.LmdbDataReader(database, TYPE_MAP)
    reader[0]
    with pytest.raises(RuntimeError, match="must be registered before reading any frame"):
        reader.add_data_requirement([mdloader.DataRequirementItem("energy", 1)])
    with pytest.raises(IndexError, match="out of range"):
        reader[len(reader)]
    reader.close()
    with pytest.raises(RuntimeError, match="closed LMDB reader"):
        reader[0]


def _species(path: str) -> list[list[str]]:
    """Every frame's atoms as element names, read under the database's own type map."""
    with environment.metadata_view(path) as (txn, _entries):
        meta = codec.unpack(txn.get(METADATA_KEY), "meta", path, METADATA_KEY)
        names = meta["type_map"]
        return [[names[t] for t in codec.decode_array(codec.unpack(
            txn.get(frame_key(i, meta["frame_idx_fmt"])), "f", path, b"")["atom_types"])]
                for i in range(meta["nframes"])]


def test_merge_remaps_type_maps_and_never_swaps_species(tmp_path: Path) -> None:
    a = make_system(tmp_path / "src", "a", natoms=4, nframes=3, seed=1)
    b = make_system(tmp_path / "src", "b", natoms=5, nframes=2, seed=2)
    first = make_lmdb(tmp_path / "first.lmdb", [a], type_map=["O", "H"])
    second = make_lmdb(tmp_path / "second.lmdb", [b], type_map=["H", "C", "O"])
    expected = _species(first) + _species(second)
    assert {s for frame in _species(second) for s in frame} >= {"H", "O"}
    merged = str(tmp_path / "merged.lmdb")
    assert mdloader.merge_lmdb([first, second], merged) == merged
    assert _species(merged) == expected
    reader = mdloader.LmdbDataReader(merged, ["C", "O", "H"])
    assert reader.frame_system_ids.tolist() == [0, 0, 0, 1, 1]
    for index, frame in enumerate(expected):
        assert [["C", "O", "H"][t] for t in reader[index]["atype"]] == frame
    legacy = str(tmp_path / "legacy.lmdb")
    mdloader.merge_lmdb([first], legacy)
    env = lmdb.open(legacy, subdir=True)
    with env.begin(write=True) as txn:
        meta = codec.unpack(txn.get(METADATA_KEY), "m", legacy, METADATA_KEY)
        del meta["type_map"]
        txn.put(METADATA_KEY, codec.pack(meta))
    env.close()
    with pytest.raises(ValueError, match="mixed type_map metadata") as refused:
        mdloader.merge_lmdb([legacy, second], merged)
    assert "missing" in str(refused.value)
    assert _species(merged) == expected  # a failed merge leaves the destination as it was


@pytest.mark.parametrize("old_world,new_world", [(2, 2), (2, 3), (3, 1)])
def test_a_restored_sampler_reads_exactly_the_rest_of_the_pass(database: str, old_world: int,
                                                              new_world: int) -> None:
    reader = mdloader.LmdbDataReader(database, TYPE_MAP, "mix:14")
    old = [mdloader.DistributedLmdbBatchSampler(reader, r, old_world, seed=3)
           for r in range(old_world)]
    for sampler in old:
        sampler.set_epoch(2)
    steps = 2
    read = [b for sampler in old for b in itertools.islice(sampler, steps)]
    state = old[0].state_dict()
    assert state == {"epoch": 2, "consumed": steps * old_world, "seed": 3}
    fresh = [mdloader.DistributedLmdbBatchSampler(reader, r, new_world, seed=3)
             for r in range(new_world)]
    for sampler in fresh:
        sampler.load_state_dict(state)
    rest = [b for sampler in fresh for b in sampler]
    assert len(fresh[0]) == len(list(fresh[0]))
    whole = mdloader.DistributedLmdbBatchSampler(reader, 0, 1, seed=3)
    whole.set_epoch(2)
    full = list(whole)
    assert {tuple(b) for b in read + rest} == {tuple(b) for b in full}
    assert sorted(map(tuple, read)) == sorted(map(tuple, full[:steps * old_world]))
    assert 0 <= len(read + rest) - len(full) < new_world  # the last step's padding only
    with pytest.raises(ValueError, match="expected"):
        fresh[0].load_state_dict({"epoch": 2, "consumed": 1})
    with pytest.raises(ValueError, match="seed 9"):
        fresh[0].load_state_dict({"epoch": 2, "consumed": 1, "seed": 9})
