"""``mdloader stat``: the neighbour statistics of an input.json's descriptor blocks, cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.inputs import write_input

from mdloader.cli.main import main
from mdloader.cli.stat import descriptor_blocks
from mdloader.errors import ConfigError
from mdloader.loading.build import build_systems
from mdloader.loading.statistics import neighbour_statistics
from mdloader.stats.neighbours import min_nbor_dist
from mdloader.testing import make_dataset


def _input(tmp_path: Path, descriptor: dict) -> str:
    systems = make_dataset(tmp_path / "data", 3, nframes=5, seed=3)
    return str(write_input(tmp_path, {
        "model": {"type_map": ["O", "H"], "descriptor": descriptor, "fitting_net": {}},
        "training": {"training_data": {"systems": systems, "batch_size": 1},
                     "numb_steps": 1}}))


def _stat(capsys: pytest.CaptureFixture[str], *argv: str, log: list[str] | None = None) -> dict:
    assert main(["stat", *argv, "--json"]) == 0
    captured = capsys.readouterr()
    if log is not None:
        log.append(captured.err)
    return json.loads(captured.out)


def test_stat_prints_statistics_and_sel_and_uses_the_cache(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    path = _input(tmp_path, {"type": "se_e2_a", "sel": "auto:1.5", "rcut": 4.0,
                             "rcut_smth": 0.5})
    out = _stat(capsys, path)
    datasets = build_systems(json.loads(Path(path).read_text())["training"]["training_data"]
                             ["systems"], ["O", "H"])
    stats = neighbour_statistics(datasets, 4.0, type_map=["O", "H"], mixed_type=False,
                                 mode="off")
    (block,) = out["blocks"]
    assert out["systems"] == 3 and block["block"] == "model.descriptor"
    assert block["min_nbor_dist"] == min_nbor_dist(stats)
    assert block["max_neighbours"] == list(stats.max_neighbours)
    assert block["sel"] == [4 * ((int(n * 1.5) + 3) // 4) for n in stats.max_neighbours]
    log: list[str] = []
    assert _stat(capsys, path, log=log) == out
    assert "cached 3, computed 0" in log[-1]
    assert _stat(capsys, path, "--refresh", log=log) == out
    assert "cached 0, computed 3" in log[-1]
    assert main(["stat", path]) == 0
    text = capsys.readouterr().out
    assert "min_nbor_dist" in text and f"sel             {block['sel']}" in text


def test_stat_mixed_type_sel_is_one_number_and_a_small_sel_warns(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    out = _stat(capsys, _input(tmp_path, {"type": "hybrid", "list": [
        {"type": "se_atten", "sel": "auto", "rcut": 4.0, "rcut_smth": 0.5},
        {"type": "se_e2_a", "sel": [1, 1], "rcut": 3.0, "rcut_smth": 0.5}]}))
    mixed, typed = out["blocks"]
    assert mixed["block"] == "model.descriptor.list[0]" and isinstance(mixed["sel"], int)
    assert len(mixed["max_neighbours"]) == 1
    assert typed["sel"] == [1, 1] and typed["warnings"]  # the data has more neighbours


def test_descriptor_blocks_of_dpa2_and_unknown_descriptors() -> None:
    blocks = descriptor_blocks({"type": "dpa2", "repinit": {"rcut": 6.0, "nsel": 120},
                                "repformer": {"rcut": 4.0, "nsel": 40}})
    assert [(b.path, b.rcut, b.sel, b.mixed_type) for b in blocks] == [
        ("model.descriptor.repinit", 6.0, 120, True),
        ("model.descriptor.repformer", 4.0, 40, True)]
    with pytest.raises(ConfigError, match="model.descriptor"):
        descriptor_blocks({"type": "custom"})


def test_check_says_whether_the_statistics_are_cached(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MDLOADER_CACHE_DIR", str(tmp_path / "cache"))
    path = _input(tmp_path, {"type": "se_e2_a", "sel": "auto", "rcut": 4.0, "rcut_smth": 0.5})
    assert main(["check", path, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["statistics"]
    assert row["cached"] == 0 and row["systems"] == 3 and row["estimate_seconds"] >= 0
    assert main(["check", path]) == 0
    assert "cached for 0 of 3 systems; computing the rest takes roughly" in \
        capsys.readouterr().out
    _stat(capsys, path)
    assert main(["check", path]) == 0
    assert "rcut 4): cached for all 3 systems" in capsys.readouterr().out
