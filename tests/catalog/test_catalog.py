"""The catalog's road (request, load or survey, save), its report, and the one fan-out."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mdloader.catalog.catalog import Catalog, catalog_for
from mdloader.catalog.describe import SystemFailed, fan_out
from mdloader.errors import DataError
from mdloader.loading.build import BuildReport, build_systems_with_report
from mdloader.testing import make_system

TYPE_MAP = ["O", "H"]
SETTLE = 0.05  # seconds: file times here are finer than this


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MDLOADER_INDEX_SETTLE", str(SETTLE))
    monkeypatch.delenv("MDLOADER_INDEX", raising=False)


def _tree(root: Path, n: int = 3) -> str:
    for i in range(n):
        make_system(root, f"sys.{i}", natoms=3 + i, nframes=2 + i, seed=i)
    time.sleep(2 * SETTLE)  # the data's file times fall behind the next start's margin
    return str(root)


def _catalog(root: str, **kwargs: object) -> Catalog:
    return catalog_for(root, TYPE_MAP, None, workers=2, progress=False, **kwargs)


def test_a_survey_is_saved_once_then_loaded(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    first = _catalog(root)
    assert (first.source, first.save_needed, first.described, first.reused) == ("built", True,
                                                                               3, 0)
    assert first.index_file is not None and not os.path.exists(first.index_file)
    assert first.table.origin is None and len(first.table) == 3
    first.save()
    assert os.path.isfile(first.index_file)
    again = _catalog(root)
    assert (again.source, again.save_needed, again.described, again.reused) == ("index", False,
                                                                               0, 3)
    assert again.table.origin == first.index_file
    assert again.table.addresses() == first.table.addresses()


def test_without_an_index_nothing_is_requested_or_saved(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    catalog = _catalog(root, mode="off")
    catalog.save()
    assert (catalog.source, catalog.request, catalog.index_file) == ("built", None, None)
    assert not (tmp_path / "cache").exists()


def test_a_changed_system_is_described_again_and_saved(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    _catalog(root).save()
    make_system(tmp_path / "data", "sys.3", natoms=4, nframes=3, seed=9)
    updated = _catalog(root)
    assert (updated.source, updated.save_needed, updated.described, updated.reused) == (
        "index (updated)", True, 1, 3)


def test_the_report_reads_rank0s_catalog_and_defaults_elsewhere(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data")
    _, report = build_systems_with_report(root, TYPE_MAP)
    (catalog,) = report.catalogs
    assert report.source == catalog.source == "built"
    assert (report.described, report.reused, report.index_file, report.index_seconds) == (
        catalog.described, catalog.reused, catalog.index_file, catalog.check_seconds)
    assert (report.nsys, report.world_size, report.payload_bytes) == (3, 1, 0)
    received = BuildReport(3, 9, 0.1, 0.0, 100, 0, 2)
    assert (received.source, received.described, received.index_file,
            received.discovery_seconds) == ("received", 0, None, 0.0)
    assert "loaded 3 systems" in received.summary()


def test_fan_out_keeps_the_order_and_stops_at_the_first_failure() -> None:
    addresses = [f"s{i:03d}" for i in range(50)]
    assert list(fan_out(addresses, lambda a, listing: a.upper(), 4)) == [
        a.upper() for a in addresses]

    def work(address: str, listing: object) -> str:
        if address in ("s020", "s030"):
            raise RuntimeError(f"cannot read {address}")
        return address

    got: list[str] = []
    with pytest.raises(SystemFailed) as info:
        got.extend(fan_out(addresses, work, 4))
    assert info.value.address == "s020" and got == addresses[:20]
    assert str(info.value.__cause__) == "cannot read s020"


def test_fan_out_passes_a_data_error_as_it_was_raised() -> None:
    def work(address: str, listing: object) -> str:
        raise DataError(f"{address}: no coord.npy")

    with pytest.raises(DataError, match="s000: no coord.npy"):
        list(fan_out(["s000", "s001"], work, 2))
