"""The import rules of docs/architecture.md, checked on the source: every violation is named."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mdloader"

#: Layer of each module (longest prefix wins) and the layers it may import.
LAYERS = {
    "mdloader": "leaf", "mdloader.errors": "leaf", "mdloader.settings": "leaf",
    "mdloader.world": "leaf", "mdloader.logs": "leaf", "mdloader.transport": "leaf",
    "mdloader.state": "leaf", "mdloader.fs_calls": "leaf", "mdloader.testing": "testing",
    "mdloader.data": "data", "mdloader.catalog": "catalog",
    "mdloader.distributed": "distributed", "mdloader.sampling": "sampling",
    "mdloader.stats": "stats", "mdloader.loading": "loading",
    "mdloader.config": "config",
    "mdloader.cli": "cli", "mdloader.__main__": "cli",
    "mdloader.train": "train", "mdloader.integrations": "integrations",
}
LIBRARY = {"leaf", "data", "catalog", "distributed", "sampling", "stats", "loading"}
ALLOWED = {
    "leaf": {"leaf"},
    "data": {"leaf", "data"},
    "catalog": {"leaf", "data", "catalog"},
    "distributed": {"leaf", "distributed"},
    "sampling": {"leaf", "sampling"},
    "stats": {"leaf", "data", "stats"},
    "loading": LIBRARY,
    "testing": LIBRARY,
    "config": LIBRARY | {"config"},
    "train": LIBRARY | {"config", "train"},
    "integrations": LIBRARY | {"config", "integrations"},
    "cli": LIBRARY | {"config", "cli", "train", "integrations"},
}
#: Only these layers may import ``torch.distributed`` themselves.
TORCH_DISTRIBUTED = {"distributed"}


def layer_of(module: str) -> str:
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")),
               key=len)
    return LAYERS[best]


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in the file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, "." * node.level + (node.module or "")))
            elif node.module == "mdloader":  # from mdloader import X: X may be a subpackage
                found += [(node.lineno, f"mdloader.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module or ""))
    return found


def violations(package: Path = PACKAGE) -> list[str]:
    problems = []
    for path in sorted(package.rglob("*.py")):
        me = module_name(path, package)
        mine = layer_of(me)
        rel = path.relative_to(package.parent)
        for line, target in imports(path):
            where = f"{rel}:{line}: {me} ({mine})"
            if target.startswith("."):
                problems.append(f"{where} uses a relative import {target!r}: write it absolute")
            elif target == "torch.distributed" or target.startswith("torch.distributed."):
                if mine not in TORCH_DISTRIBUTED:
                    problems.append(f"{where} imports {target}: only mdloader.distributed may")
            elif target.startswith("mdloader"):
                theirs = layer_of(target)
                if theirs not in ALLOWED[mine]:
                    problems.append(f"{where} imports {target} ({theirs})")
    return problems


def test_imports_follow_the_layers() -> None:
    problems = violations()
    assert not problems, "import rules of docs/architecture.md broken:\n" + "\n".join(problems)


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "mdloader" / "data" / "_rule_probe.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("import torch.distributed as dist\n"
                   "from mdloader.loading.loader import DpLoaderSet\n"
                   "from .schema import canonical_key\n", encoding="utf-8")
    assert violations(tmp_path / "mdloader") == [
        "mdloader/data/_rule_probe.py:1: mdloader.data._rule_probe (data) imports "
        "torch.distributed: only mdloader.distributed may",
        "mdloader/data/_rule_probe.py:2: mdloader.data._rule_probe (data) imports "
        "mdloader.loading.loader (loading)",
        "mdloader/data/_rule_probe.py:3: mdloader.data._rule_probe (data) uses a relative "
        "import '.schema': write it absolute",
    ]


def test_every_module_has_a_layer() -> None:
    for path in PACKAGE.rglob("*.py"):
        assert layer_of(module_name(path)) in ALLOWED, path
