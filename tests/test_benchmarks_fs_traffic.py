"""The file-system traffic benchmark: its trace counting on recorded lines, and a run at tiny
size whose results file has every field (not their values)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.fs_traffic import report, run, trace

ROOT = "/data/water"
LOG = f"""\
100 10.000000 newfstatat(AT_FDCWD</repo>, "/.mdloader-bench-marker/fst-w0-cold-begin-rank0", \
0x7ffd, 0) = -1 ENOENT (No such file or directory)
100 10.100000 newfstatat(AT_FDCWD</repo>, "{ROOT}/sys.1/set.000/coord.npy", {{...}}, 0) = 0
100 10.200000 openat(AT_FDCWD</repo>, "{ROOT}/sys.1/set.000/force.npy", O_RDONLY|O_CLOEXEC) \
= 7<{ROOT}/sys.1/set.000/force.npy>
100 10.300000 newfstatat(7<{ROOT}/sys.1/set.000/force.npy>, "", {{...}}, AT_EMPTY_PATH) = 0
101 10.400000 pread64(7<{ROOT}/sys.1/set.000/force.npy>, <unfinished ...>
100 10.450000 read(3</usr/lib/python3.11/os.py>, ""..., 4096) = 4096
101 10.500000 <... pread64 resumed>""..., 128, 0) = 128
102 10.550000 read(9<{ROOT}/sys.2/set.000/box.npy>, ""..., 4096) = 200
103 10.560000 newfstatat(8<{ROOT}/d.lmdb/data.mdb>, "",  <unfinished ...>
103 10.570000 <... newfstatat resumed>{{...}}, AT_EMPTY_PATH) = 0
100 10.600000 newfstatat(AT_FDCWD</repo>, "/.mdloader-bench-marker/fst-w0-cold-end-rank0", \
0x7ffd, 0) = -1 ENOENT (No such file or directory)
100 10.700000 openat(AT_FDCWD</repo>, "{ROOT}/sys.3/type.raw", O_RDONLY) = 8<{ROOT}/sys.3/type.raw>
"""


def test_trace_counts_calls_and_bytes_under_the_tree_inside_the_window() -> None:
    counts = trace.count(LOG.splitlines(), ROOT)
    assert counts["w0-cold"] == {
        "lookups": 1, "opens": 1, "fstats": 2, "reads": 2, "other": 0, "reopens": 0,
        "by_call": {"newfstatat": 3, "openat": 1, "pread64": 1, "read": 1},
        "bytes_requested": 328}


def test_a_path_beside_the_tree_is_not_under_it() -> None:
    assert trace.under(f'AT_FDCWD</x>, "{ROOT}/sys.0"', ROOT)
    assert not trace.under(f'AT_FDCWD</x>, "{ROOT}2/sys.0"', ROOT)
    assert not trace.under(f"AT_FDCWD<{ROOT}>, \"/etc/hosts\"", ROOT)  # the working directory


FIELDS = {"kind", "impl", "format", "workers", "nofile", "nofile_asked", "window", "batches",
          "pass_batches", "frames_per_batch", "payload_bytes_per_batch", "per_batch", "by_call",
          "processes", "wall_s", "tree_bytes", "resident_after_evict_bytes", "fs_tool",
          "loadavg_1min", "nofile_in_run"}
PER_BATCH = {*trace.COUNTED, "bytes_requested", "bytes_from_storage", "bytes_of_pages_spanned"}


def test_a_tiny_run_writes_every_field(tmp_path: Path) -> None:
    """mdloader alone (a DeePMD-kit launch would double the time), 3 systems, npy and LMDB,
    one limit, workers 0, and again with direct reads (``--direct``): the records and the
    section have their fields, the direct launch its own rows."""
    impls = "mdloader"
    out = tmp_path / "fs.jsonl"
    args = ["--nsys", "3", "--warmup", "2", "--batches", "4", "--pass-batches", "2", "--tail",
            "2", "--formats", "npy,hdf5,lmdb", "--workers", "0", "--nofile", "1024", "--impls",
            impls, "--data-base", str(tmp_path / "data"), "--out", str(out), "--no-report",
            "--timeout", "60", "--direct"]
    traced = run.strace_usable()
    assert run.main(args if traced else [*args, "--no-strace"]) == 0
    meta, recs = report.load(str(out))
    assert meta["failed"] == []
    assert {"started", "cpus", "nsys", "fs_tool", "payload_bytes_per_frame"} <= set(meta)
    expected = {(i, (f, "1024", 0, w)) for i in [*impls.split(","), run.DIRECT]
                for f in ("npy", "hdf5", "lmdb") for w in ("cold", "per-pass")}
    assert set(recs) == expected
    for rec in recs.values():
        assert set(rec) == FIELDS
        assert rec["fs_tool"].startswith("strace" if traced else "none: strace not usable")
        assert set(rec["per_batch"]) == PER_BATCH
        if traced:  # no path looked up, no file opened again (a first open may still come)
            per = rec["per_batch"]
            assert (per["lookups"], per["reopens"]) == (0, 0), (rec["format"], rec["by_call"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "meta"
    text = report.section(str(out))
    for row in (r"\| npy \| 1,024( → [\d,]+)? \| 0 \| cold once \|",
                r"\| npy \| 1,024( → [\d,]+)? \| 0 \| cold every pass \|",
                r"\| lmdb \| 1,024( → [\d,]+)? \| 0 \| cold once \|",
                r"\| npy, direct reads \| 1,024( → [\d,]+)? \| 0 \| cold every pass \|"):
        assert re.search(row, text), row


REOPEN_LOG = f"""\
100 9.000000 openat(AT_FDCWD</repo>, "{ROOT}/s/coord.npy", O_RDONLY) = 7<{ROOT}/s/coord.npy>
100 9.100000 clone3({{flags=CLONE_VM|CLONE_FS|CLONE_FILES|CLONE_THREAD|CLONE_SYSVSEM}}, 88) = 101
100 9.200000 clone(child_stack=NULL, flags=CLONE_CHILD_CLEARTID|SIGCHLD) = 102
100 9.300000 newfstatat(AT_FDCWD</repo>, \
"/.mdloader-bench-marker/fst-w2-start-begin-rank0", 0x7ffd, 0) = -1 ENOENT
100 9.400000 openat(AT_FDCWD</repo>, "{ROOT}/s/coord.npy", O_RDONLY) = 7<{ROOT}/s/coord.npy>
100 10.000000 newfstatat(AT_FDCWD</repo>, "/.mdloader-bench-marker/fst-w2-cold-begin-rank0", \
0x7ffd, 0) = -1 ENOENT (No such file or directory)
101 10.100000 openat(AT_FDCWD</repo>, "{ROOT}/s/coord.npy", O_RDONLY) = 8<{ROOT}/s/coord.npy>
102 10.200000 openat(AT_FDCWD</repo>, "{ROOT}/s/coord.npy", O_RDONLY) = 7<{ROOT}/s/coord.npy>
102 10.300000 openat(AT_FDCWD</repo>, "{ROOT}/s/force.npy", O_RDONLY) = 8<{ROOT}/s/force.npy>
100 10.600000 newfstatat(AT_FDCWD</repo>, "/.mdloader-bench-marker/fst-w2-cold-end-rank0", \
0x7ffd, 0) = -1 ENOENT (No such file or directory)
"""


def test_an_open_again_by_the_same_process_is_a_reopen_whatever_its_thread() -> None:
    """A thread of process 100 opens a file 100 opened before the window (after the start of
    its configuration; the open before that is the build's): a re-open; the forked 102 opens
    it for the first time in its process: not one."""
    counts = trace.count(REOPEN_LOG.splitlines(), ROOT)["w2-cold"]
    assert (counts["opens"], counts["reopens"]) == (3, 1)


def test_the_warm_case_with_and_without_direct_reads_lands_in_the_section(tmp_path: Path) -> None:
    """``warm --direct --out``: one record per format and mode, appended, and their table."""
    from benchmarks.fs_traffic import warm

    out = tmp_path / "fs.jsonl"
    out.write_text(json.dumps({"kind": "meta", "nsys": 3}) + "\n")
    assert warm.main(["--nsys", "3", "--formats", "npy", "--warmup", "2", "--batches", "3",
                      "--repeats", "2", "--data-base", str(tmp_path / "data"), "--direct",
                      "--out", str(out)]) == 0
    meta, _recs = report.load(str(out))
    assert [(r["format"], r["direct_reads"], len(r["ms_per_batch"])) for r in meta["warm"]] == [
        ("npy", False, 2), ("npy", True, 2)]
    text = report.section(str(out))
    assert re.search(r"\| npy \| page cache \| [\d.]+ \([\d.]+–[\d.]+\) \|", text), text
    assert re.search(r"\| npy \| direct \(O_DIRECT\) \| [\d.]+ ", text), text
