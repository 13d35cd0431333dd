"""The folder of statistics entries: one entry per (system stamp, key), a stamp that changes
with the system's files, and failures reported once per cause."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from mdloader.stats.store import SUFFIX, StatsStore, system_stamp
from mdloader.testing import make_system

LAYOUT = (True, ("set.000",))  # its own type map, one set: what the catalog says of make_system's


def test_an_entry_is_kept_under_its_system_stamp_and_key(tmp_path: Path) -> None:
    store = StatsStore(str(tmp_path / "cache"))
    assert store.get("ab12", "k") is None
    store.put("ab12", "k", b"payload")
    assert store.path("ab12", "k") == str(tmp_path / "cache" / "ab" / "ab12" / ("k" + SUFFIX))
    assert store.get("ab12", "k") == b"payload"
    assert store.get("ab12", "other") is None and not store.failures


def test_a_store_without_a_folder_keeps_nothing(tmp_path: Path) -> None:
    store = StatsStore(None)
    store.put("ab12", "k", b"payload")
    assert store.get("ab12", "k") is None and not store.failures
    assert not any(tmp_path.iterdir())


def test_the_stamp_changes_with_a_file_of_the_system(tmp_path: Path) -> None:
    system = make_system(tmp_path, natoms=3, nframes=4)
    stamp = system_stamp(system, LAYOUT)
    assert system_stamp(system, LAYOUT) == stamp
    force = os.path.join(system, "set.000", "force.npy")
    np.save(force, np.zeros((5, 9)))  # rewritten in place, another size
    assert system_stamp(system, LAYOUT) != stamp


def test_failures_are_reported_once_per_cause_with_their_count(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "cache"
    folder.write_text("a file, not a folder")
    store = StatsStore(str(folder))
    for key in ("a", "b", "c"):
        store.put("ab12", key, b"payload")
    assert [len(paths) for paths in store.failures.values()] == [3]
    with caplog.at_level(logging.DEBUG, logger="mdloader.stats.store"):
        store.report_failures()
        store.put("ab12", "d", b"payload")
        store.report_failures()  # the same cause again: not repeated as a warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3 entries cannot be saved" in warnings[0], warnings
    assert str(folder) in warnings[0] and not store.failures
    assert any("1 entry cannot be saved" in r.getMessage() for r in caplog.records
               if r.levelno == logging.DEBUG)
