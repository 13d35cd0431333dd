"""The supported versions: declared exactly as ``scripts/test-matrix.sh`` tests them, and what
differs between them handled in one module each."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A name that only means something because releases differ, and the one module allowed to use it.
VERSION_SPECIFIC = {"group_src": "mdloader/distributed/torch_versions.py",
                    "torch.__version__": "mdloader/distributed/torch_versions.py",
                    "sys.version_info": "mdloader/errors.py",
                    ".add_note(": "mdloader/errors.py"}


def matrix_ends() -> dict[str, dict[str, str]]:
    """``{"torch": {"lowest": "2.3.1", "newest": ...}, "numpy": ..., "python": ...}``."""
    text = (ROOT / "scripts" / "test-matrix.sh").read_text(encoding="utf-8")
    ends = {}
    for name in ("PYTHON", "TORCH", "NUMPY"):
        line = re.search(rf"^declare -A {name}=\((.*)\)$", text, re.M).group(1)
        values = {k: re.sub(r'^"\$\{\w+:-(.*)\}"$', r"\1", v)  # "${VAR:-default}"
                  for k, v in re.findall(r"\[(\w+)\]=(\S+)", line)}
        ends[name.lower()] = {k: v.removeprefix("python") for k, v in values.items()}
    return ends


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def next_minor(version: str) -> str:
    major, mid = version.split(".")[:2]
    return f"{major}.{int(mid) + 1}"


def test_the_declared_ranges_are_the_tested_ends() -> None:
    ends = matrix_ends()
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for package in ("torch", "numpy"):
        low, new = ends[package]["lowest"], ends[package]["newest"]
        wanted = f'"{package}>={minor(low)},<{next_minor(new)}"'
        assert wanted in pyproject, f"pyproject.toml should declare {wanted}"
    low, new = ends["python"]["lowest"], ends["python"]["newest"]
    assert f'requires-python = ">={low},<{next_minor(new)}"' in pyproject
    floor = re.search(r"^DEEPMD_TORCH=(\S+)$", (ROOT / "scripts" / "test-matrix.sh").read_text(
        encoding="utf-8"), re.M).group(1)
    assert f'"torch>={floor}"' in pyproject, "the deepmd extra's torch floor is the matrix's"
    guide = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    for package, label in (("python", "Python"), ("torch", "torch"), ("numpy", "numpy")):
        row = f"| {label} | {minor(ends[package]['lowest'])} | {minor(ends[package]['newest'])} |"
        assert row in guide, f"docs/getting-started.md should have the row {row}"


def version_checks_outside(package: Path) -> list[str]:
    """Each use of a :data:`VERSION_SPECIFIC` name outside its one module."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name, home in VERSION_SPECIFIC.items():
                if name in line and rel != home:
                    problems.append(f"{rel}:{number}: {name} outside {home}")
    return problems


def test_release_differences_are_handled_in_one_module_each() -> None:
    problems = version_checks_outside(ROOT / "mdloader")
    assert not problems, "\n".join(problems)


def test_the_version_checker_names_each_use(tmp_path: Path) -> None:
    probe = tmp_path / "mdloader" / "train" / "_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("import sys, torch\nOLD = torch.__version__ < '2.6'\n"
                     "if sys.version_info < (3, 11): pass\n", encoding="utf-8")
    assert version_checks_outside(tmp_path / "mdloader") == [
        "mdloader/train/_probe.py:2: torch.__version__ outside "
        "mdloader/distributed/torch_versions.py",
        "mdloader/train/_probe.py:3: sys.version_info outside mdloader/errors.py"]
