"""discover_systems: a list keeps its order and repetitions, each entry expands sorted, one
walk, HDF5 aware."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mdloader import fs_calls as overlap
from mdloader.catalog.discover import discover, discover_systems
from mdloader.data.system import build_system_meta
from mdloader.errors import ConfigError, NoSystemsFoundError
from mdloader.testing import make_system
from tests.support.deepmd_env import require_deepmd_python


@pytest.fixture
def tree(tmp_path):
    for name in ["b/data_1", "a/data_0", "a/deeper/data_2", "c/other"]:
        make_system(tmp_path, name, nframes=2)
    (tmp_path / "a" / "not_a_system").mkdir()
    return tmp_path


def test_a_list_keeps_its_order_and_repetitions_each_entry_expands_sorted(tree):
    found = discover_systems([str(tree / "b"), str(tree), str(tree / "a" / "data_0")])
    walk = sorted(str(tree / p) for p in ["a/data_0", "a/deeper/data_2", "b/data_1", "c/other"])
    assert found == [str(tree / "b" / "data_1"), *walk, str(tree / "a" / "data_0")]


def test_a_repeated_system_stays_repeated(tree):
    data_0 = str(tree / "a" / "data_0")
    assert discover_systems([data_0, data_0 + "/", data_0]) == [data_0] * 3
    later_first = [str(tree / "c" / "other"), data_0]
    assert discover_systems(later_first) == later_first  # not sorted across entries


def test_a_glob_is_one_entry_expanded_in_place(tree):
    found = discover_systems([str(tree / "c"), str(tree / "*" / "data_*")])
    assert found == [str(tree / "c" / "other"), str(tree / "a" / "data_0"),
                     str(tree / "b" / "data_1")]


def test_rglob_patterns_match_system_dirs_at_any_depth(tree):
    found = discover_systems(str(tree), rglob_patterns=["data_*"])
    assert [os.path.basename(p) for p in found] == ["data_0", "data_2", "data_1"]


def test_glob_entries(tree):
    found = discover_systems(str(tree / "*" / "data_*"))
    assert sorted(os.path.basename(p) for p in found) == ["data_0", "data_1"]


def test_same_order_whatever_the_hash_seed(tree):
    code = ("import json,sys; from mdloader.catalog.discover import discover_systems;"
            f"print(json.dumps(discover_systems({str(tree)!r}, rglob_patterns=['data_*','oth*'])))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ["0", "1", "12345"]}
    assert len(outs) == 1


def test_hdf5_groups_and_root_system(tmp_path):
    make_system(tmp_path, "g1", backend="hdf5", h5_file="multi.h5")
    make_system(tmp_path, "g0", backend="hdf5", h5_file="multi.h5")
    make_system(tmp_path, "", backend="hdf5", h5_file="root.h5")
    multi = str(tmp_path / "multi.h5")
    assert discover_systems(multi) == [f"{multi}#/g0", f"{multi}#/g1"]
    assert discover_systems(f"{multi}#/g1") == [f"{multi}#/g1"]
    root = str(tmp_path / "root.h5")
    assert discover_systems(root) == [f"{root}#/"]
    assert discover_systems([root, multi, f"{multi}#/g0"]) == [  # each file in place
        f"{root}#/", f"{multi}#/g0", f"{multi}#/g1", f"{multi}#/g0"]


def test_nothing_found_says_where(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoSystemsFoundError, match=r"no DeePMD system .* found under: .*empty"):
        discover_systems([str(tmp_path / "empty")])
    make_system(tmp_path, "sys")
    with pytest.raises(NoSystemsFoundError, match=r"matching \['zzz\*'\]"):
        discover_systems(str(tmp_path), rglob_patterns=["zzz*"])


def test_an_entry_that_does_not_exist_is_an_error_naming_its_json_path(tmp_path):
    """DeePMD-kit fails on it too (FileNotFoundError, without the key); a warning would train on
    the other entries, the data of this one silently dropped."""
    good = make_system(tmp_path, "sys")
    key = "training.training_data.systems"
    with pytest.raises(ConfigError, match=r"^training\.training_data\.systems\[1\]: .*/nope "
                                          r"does not exist$"):
        discover_systems([good, str(tmp_path / "nope")], key=key)
    with pytest.raises(ConfigError, match=r"^training\.training_data\.systems: .*/nope "
                                          r"does not exist$"):
        discover_systems(str(tmp_path / "nope"), key=key)
    with pytest.raises(ConfigError, match=r"^systems\[0\]: .*/nope\.h5#/g does not exist$"):
        discover_systems([str(tmp_path / "nope.h5#/g"), good])
    with pytest.raises(ConfigError, match=r"^systems\[1\]: the pattern .*/zz\* matches nothing$"):
        discover_systems([good, str(tmp_path / "zz*")])


def test_an_entry_that_holds_no_system_is_an_error_naming_its_json_path(tmp_path):
    """DeePMD-kit keeps a listed folder as a system and fails reading it; dropping it would
    train on the other entries only."""
    good = make_system(tmp_path, "sys")
    (tmp_path / "empty").mkdir()
    key = "training.training_data.systems"
    with pytest.raises(NoSystemsFoundError, match=r"^training\.training_data\.systems\[1\]: no "
                       r"DeePMD system .* found under: .*/empty$"):
        discover_systems([good, str(tmp_path / "empty")], key=key)
    with pytest.raises(NoSystemsFoundError, match=r"^systems\[0\]: .* matching \['sys'\] found "
                       r"under: .*/empty$"):
        discover_systems([str(tmp_path / "empty"), str(tmp_path)], rglob_patterns=["sys"])


@pytest.mark.parametrize("where", ["root", "subfolder"])
def test_a_symlink_loop_is_ignored_as_rglob_ignores_it(tmp_path, where, caplog):
    """``a -> b``, ``b -> a``: ``DirEntry.is_dir()`` raises ELOOP; DeePMD-kit's ``rglob`` skips
    the entry and finds every system, so does the walk (with a warning naming it)."""
    systems = [make_system(tmp_path / "sub", f"sys_{i}", nframes=2) for i in range(3)]
    systems += [make_system(tmp_path, f"top_{i}", nframes=2) for i in range(2)]
    folder = tmp_path if where == "root" else tmp_path / "sub"
    os.symlink(folder / "b", folder / "a")
    os.symlink(folder / "a", folder / "b")
    with caplog.at_level("WARNING"):
        found = discover_systems(str(tmp_path))
    assert found == sorted(systems)
    assert str(folder / "a") in caplog.text


def _count_listings(monkeypatch) -> list[str]:
    listed = []
    real = os.scandir

    def counting(path=".", *a, **k):
        listed.append(os.fspath(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "scandir", counting)
    return listed


def test_walks_the_tree_once_without_stat_per_entry(tree, monkeypatch):
    listed = _count_listings(monkeypatch)
    calls = {"stat": 0}
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda *a, **k: calls.__setitem__("stat", calls["stat"] + 1)
                        or real_stat(*a, **k))
    found = discover(str(tree))
    assert len(listed) == len(set(listed)) == len(found.walked) and calls["stat"] <= 3  # entry
    systems = {p for p, is_system in found.walked.items() if is_system}
    assert systems == set(found.addresses) == set(found.listings)


def test_systems_nested_in_a_system_are_found_but_set_folders_are_not_walked(tmp_path,
                                                                            monkeypatch):
    outer = make_system(tmp_path, "outer", nframes=2, nsets=2)
    inner = make_system(tmp_path / "outer" / "more", "inner", nframes=2)
    deepest = make_system(tmp_path / "outer" / "more" / "inner" / "sub", "deepest", nframes=2)
    not_a_system_dir = tmp_path / "set.000"  # a set.* name outside a system is still walked
    found_there = make_system(not_a_system_dir, "sys", nframes=2)
    found = discover(str(tmp_path))
    walked = [os.path.relpath(p, tmp_path) for p in found.walked]
    assert found.addresses == sorted([outer, inner, deepest, found_there])
    assert not [w for w in walked if "outer" in w and os.path.basename(w).startswith("set.")]
    assert os.path.join("outer", "more", "inner", "sub") in walked


def test_links_to_folders_are_not_descended_into_but_linked_sets_are_read(tmp_path):
    real = make_system(tmp_path / "data", "real", nframes=2)
    os.symlink(tmp_path / "data", tmp_path / "link")  # a link below the root: not walked below
    linked_set = make_system(tmp_path / "data", "linked", nframes=3)
    os.rename(os.path.join(linked_set, "set.000"), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(linked_set, "set.000"))
    found = discover(str(tmp_path))
    assert found.addresses == [linked_set, real]
    assert build_system_meta(linked_set, listing=found.listings[linked_set]).nframes == 3


@pytest.mark.parametrize("threads", [1, 4])
def test_the_walk_and_build_overlap_when_calls_wait(tmp_path, monkeypatch, threads):
    """Measured waits send the rest of the walk to threads; the result does not change."""
    for i in range(50):
        make_system(tmp_path / f"g{i % 3}", f"s{i:02d}", nframes=2, seed=i)
    serial = discover(str(tmp_path), workers=1)
    monkeypatch.setattr(overlap, "WAIT", 0.0 if threads > 1 else 1.0)
    monkeypatch.setattr(overlap, "IO_SHARE", 0.0 if threads > 1 else 1.0)
    monkeypatch.setattr(overlap, "PROBE", 4)
    pools = []
    real_pool = overlap.ThreadPoolExecutor
    monkeypatch.setattr(overlap, "ThreadPoolExecutor",
                        lambda *a, **k: pools.append(k) or real_pool(*a, **k))
    found = discover(str(tmp_path), workers=threads)
    assert found.addresses == serial.addresses and found.walked == serial.walked
    assert found.listings == serial.listings
    assert bool(pools) == (threads > 1)


def test_a_busy_cpu_alone_does_not_look_like_a_slow_disk():
    """Calls that return at once keep the work in one thread, however long the Python around
    them takes (a loaded node), and calls that wait send it to threads."""
    fast = overlap.Measurement(wall=1.0, in_calls=0.9, calls=100_000)  # 9 us per call
    assert not fast.io_bound
    slow = overlap.Measurement(wall=1.0, in_calls=0.8, calls=1000)  # 0.8 ms per call
    assert slow.io_bound
    waiting_but_rare = overlap.Measurement(wall=1.0, in_calls=0.2, calls=100)
    assert not waiting_but_rare.io_bound
    assert (fast.threads(32), slow.threads(32), slow.threads(3), slow.threads(1)) == (1, 5, 3, 1)
    assert overlap.Measurement(wall=1.0, in_calls=0.99, calls=100).threads(32) == 32


def _linked_tree(tmp_path):
    """A data root mixing folders and links: to a system, to a folder of systems, to a folder
    holding a link, into an ancestor, to itself, a link loop, and a root that is only a link."""
    ext = tmp_path / "ext"
    for name in ["b", "c/d", "e/f"]:
        make_system(ext, name, nframes=2)
    root = tmp_path / "root"
    make_system(root, "a", nframes=2)
    make_system(root, "g/h", nframes=2)
    links = {"root/lb": "ext/b", "root/lc": "ext/c", "root/lext": "ext", "root/g/le": "ext/e",
             "root/a/up": "root", "root/g/back": "root/g", "root/self": "root/self",
             "root/g/x": "root/g/y", "root/g/y": "root/g/x", "ext/c/lf": "ext/e/f",
             "only/link": "ext/b", "root/a/set.001": "ext/b/set.000"}
    (tmp_path / "only").mkdir()
    for link, target in links.items():
        os.symlink(tmp_path / target, tmp_path / link)
    return tmp_path


@pytest.mark.parametrize("patterns", [None, ["*"], ["l*"]])
def test_links_to_system_folders_are_followed_as_deepmd_process_systems_follows_them(
        tmp_path, patterns, caplog):
    """The systems DeePMD-kit 3.2's ``process_systems`` finds on a tree mixing links and
    folders, run in its own interpreter; loops are ignored with a warning."""
    python = require_deepmd_python()
    tree = _linked_tree(tmp_path)
    entries = [str(tree / "root"), str(tree / "only")]
    script = ("import json, sys\nfrom deepmd.utils.data_system import process_systems\n"
              "print(json.dumps(process_systems(json.loads(sys.argv[1]), "
              "json.loads(sys.argv[2]))))")
    out = subprocess.run([python, "-c", script, json.dumps(entries), json.dumps(patterns)],
                         capture_output=True, text=True, timeout=300, check=True)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    with caplog.at_level("WARNING"):
        ours = discover_systems(entries, patterns)
    assert sorted(set(ours)) == sorted(set(theirs))
    assert str(tree / "root" / "lb") in ours and str(tree / "only" / "link") in ours
    assert str(tree / "root" / "self") in caplog.text
