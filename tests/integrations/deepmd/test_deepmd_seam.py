"""The DeePMD-kit seam (``mdloader.integrations.deepmd.seam``): the version and name check
that runs before ``install()`` patches anything, and the table the docs show.

The in-process tests put a fake DeePMD-kit (every static name of the seam, nothing else) in
``sys.modules``; the last one runs ``mdloader dp`` against the real DeePMD-kit with its
reported version faked.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from support.deepmd_env import require_deepmd_python

from mdloader.errors import ConfigError
from mdloader.integrations.deepmd import SUPPORTED, UnsupportedDeepmdError, install, uninstall
from mdloader.integrations.deepmd.patching import patches
from mdloader.integrations.deepmd.seam import MODULES, SEAM, TRAINING, markdown_table, supported

REPO = Path(__file__).resolve().parents[3]


def _fake_deepmd(monkeypatch: pytest.MonkeyPatch, version: str,
                 drop: str | None = None) -> dict[str, types.ModuleType]:
    """A DeePMD-kit of ``version`` holding every static seam name but ``drop``."""
    mods = {name: types.ModuleType(name) for name in MODULES}
    for entry in SEAM:
        if not entry.static or f"{entry.module}.{entry.name}" == drop:
            continue
        owner: object = mods[entry.module]
        *path, attr = entry.name.split(".")
        for part in path:
            if not hasattr(owner, part):
                setattr(owner, part, type(part, (), {}))
            owner = getattr(owner, part)
        if attr not in vars(owner):  # a class's own, not object's (``__init__``)
            setattr(owner, attr, lambda *a, **k: None)
    training = mods[TRAINING]
    training.torch, training.DDP = torch, type("DDP", (), {})
    package = types.ModuleType("deepmd")
    package.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepmd", package)
    for name, module in mods.items():
        monkeypatch.setitem(sys.modules, name, module)
    real_version = importlib.metadata.version

    def version_of(dist: str) -> str:
        if dist == "deepmd-kit":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(importlib.metadata, "version", version_of)
    return mods


def _snapshot(mods: dict[str, types.ModuleType]) -> dict[str, dict[str, object]]:
    """Every attribute of the fake modules and of their classes."""
    shot = {}
    for name, module in mods.items():
        shot[name] = dict(vars(module))
        for attr, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == "builtins":
                continue
            if isinstance(value, type):
                shot[f"{name}.{attr}"] = dict(vars(value))
    return shot


def _logger_state() -> tuple[object, ...]:
    logger = logging.getLogger("mdloader")
    return logger.level, logger.propagate, list(logger.handlers)


def test_an_unsupported_version_is_one_line_and_patches_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mods = _fake_deepmd(monkeypatch, "3.3.0")
    before, logs = _snapshot(mods), _logger_state()
    with pytest.raises(UnsupportedDeepmdError) as err:
        install()
    assert str(err.value) == (
        f"DeePMD-kit 3.3.0 is installed, but mdloader's DeePMD-kit integration supports "
        f"deepmd-kit{SUPPORTED}; install one of those (nothing was patched)")
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)
    assert _snapshot(mods) == before and _logger_state() == logs


def test_a_missing_name_is_one_line_and_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = f"{TRAINING}.Trainer._run_stat_on_chief"
    mods = _fake_deepmd(monkeypatch, "3.2.1", drop=missing)
    before, logs = _snapshot(mods), _logger_state()
    with pytest.raises(UnsupportedDeepmdError, match=r"^DeePMD-kit 3\.2\.1 lacks "
                       + missing.replace(".", r"\.") + ", which mdloader's DeePMD-kit "
                       "integration uses; it supports deepmd-kit>=3.2.0,<3.3 "):
        install()
    assert _snapshot(mods) == before and _logger_state() == logs


def test_a_supported_version_patches_the_seams_names_and_uninstall_restores_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mods = _fake_deepmd(monkeypatch, "3.2.0")
    before = _snapshot(mods)
    rebinds = {(e.module, e.name) for e in SEAM if e.use in ("patch", "wrap")}
    assert set(patches(mods)) <= rebinds  # nothing is patched that the seam does not list
    install()
    try:
        dataloader = sys.modules["deepmd.pt.utils.dataloader"]
        assert dataloader.DpLoaderSet.__name__ == "DeepmdDpLoaderSet"
        assert _snapshot(mods) != before
    finally:
        uninstall()
    assert _snapshot(mods) == before


@pytest.mark.parametrize(("version", "ok"), [
    ("3.2.0", True), ("3.2.5", True), ("3.2.1.dev3+g1234567", True), ("3.2.0rc1", False),
    ("3.1.9", False), ("3.3.0.dev1", False), ("3.3.0", False), ("not a version", False)])
def test_supported_versions(version: str, ok: bool) -> None:
    assert supported(version) is ok


def test_the_docs_show_the_seams_table() -> None:
    page = (REPO / "docs" / "migrating.md").read_text(encoding="utf-8")
    assert markdown_table() in page
    assert f"deepmd-kit{SUPPORTED}" in page


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mdloader_dp_against_an_unsupported_deepmd_kit(tmp_path: Path) -> None:
    """The real DeePMD-kit, its version reported as 3.3.0: one line, exit 2, no traceback,
    and DeePMD-kit's names are its own afterwards."""
    peer = require_deepmd_python()
    script = (
        "import importlib.metadata as m, sys\n"
        "real = m.version\n"
        "m.version = lambda d: '3.3.0' if d == 'deepmd-kit' else real(d)\n"
        "from mdloader.cli.main import main\n"
        "code = main(['dp', '--pt', 'train', 'input.json'])\n"
        "own = [n for n in ('deepmd.pt.train.training', 'deepmd.pt.entrypoints.main')\n"
        "       if n in sys.modules and 'mdloader' in sys.modules[n].DpLoaderSet.__module__]\n"
        "print('PATCHED', own)\n"
        "sys.exit(code)\n")
    proc = subprocess.run([peer, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"mdloader: error: DeePMD-kit 3.3.0 is installed, but mdloader's DeePMD-kit "
        f"integration supports deepmd-kit{SUPPORTED}; install one of those (nothing was "
        "patched)"]
    assert "PATCHED []" in proc.stdout


def test_statistics_call_records_what_the_action_passes_and_computes_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An action shaped like DeePMD-kit 3.2's ``initialize_statistics`` closure: its arguments
    come back from the callees, which are DeePMD-kit's own again afterwards."""
    import contextlib
    import functools

    from mdloader.integrations.deepmd import DeepmdDpLoaderSet
    from mdloader.integrations.deepmd.seam import statistics_call
    from mdloader.testing import make_dataset

    make_dataset(tmp_path / "d", 2, nframes=4, seed=1)
    data = DeepmdDpLoaderSet([str(tmp_path / "d")], 2, ["O", "H"], seed=[0, 3])
    ran: list[str] = []
    training = types.ModuleType(TRAINING)

    @contextlib.contextmanager
    def open_stat_file(spec: object):  # type: ignore[no-untyped-def]
        ran.append("open_stat_file")
        yield "a stat file"

    training.open_stat_file = open_stat_file  # type: ignore[attr-defined]
    training.make_stat_input = lambda *a, **k: ran.append("make_stat_input")  # type: ignore
    monkeypatch.setitem(sys.modules, TRAINING, training)
    own = (training.open_stat_file, training.make_stat_input)  # type: ignore[attr-defined]

    class Model(torch.nn.Module):
        def compute_or_load_stat(self, sampled_func, stat_file_path=None,  # type: ignore
                                 preset_observed_type=None):
            ran.append("compute_or_load_stat")

    model, spec = Model(), types.SimpleNamespace(path=None)

    @functools.lru_cache
    def get_sample():  # type: ignore[no-untyped-def]
        return training.make_stat_input(data.systems, data.dataloaders, 7,  # type: ignore
                                        min_pair_dist=0.5)

    def initialize_statistics() -> None:
        with training.open_stat_file(spec) as path:  # type: ignore[attr-defined]
            model.compute_or_load_stat(sampled_func=get_sample, stat_file_path=path,
                                       preset_observed_type=["O"])

    call = statistics_call(types.SimpleNamespace(model={"Default": model}),
                           initialize_statistics)
    assert call is not None and ran == []
    assert (call.model, call.get_sample, call.preset_observed_type) == (model, get_sample, ["O"])
    assert (call.stat_file_spec, call.data, call.nbatch, call.min_pair_dist) == (spec, data, 7,
                                                                                 0.5)
    assert (training.open_stat_file, training.make_stat_input) == own  # type: ignore
    assert "compute_or_load_stat" not in vars(model) and get_sample.cache_info().currsize == 0
    initialize_statistics()
    assert ran == ["open_stat_file", "compute_or_load_stat"]


def test_mdloader_imports_deepmd_kit_only_through_the_seam() -> None:
    """No ``import deepmd...`` in mdloader/, and every DeePMD-kit module string that a module
    names is one of the seam's: the table is the whole contact surface."""
    import ast

    found = []
    for path in sorted((REPO / "mdloader").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                      if n == "deepmd" or n.startswith("deepmd.")]
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith("deepmd.") and " " not in node.value
                    and node.value not in MODULES):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value}")
    assert found == []
