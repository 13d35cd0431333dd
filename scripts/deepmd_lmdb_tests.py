"""Run DeePMD-kit's own LMDB tests against mdloader's LMDB names.

Usage::

    python scripts/deepmd_lmdb_tests.py DEEPMD_KIT_CHECKOUT [--python PYTHON] [--keep]

DeePMD-kit's test files are not in its wheel nor its sdist, so this takes a source checkout
(``source/tests/...``), copies ``source/tests/pt/test_lmdb_dataloader.py`` and
``source/tests/common/dpmodel/test_lmdb_data.py`` into a temporary folder, rewrites their
imports of the LMDB names mdloader provides to ``from mdloader import ...`` (every other import
stays DeePMD-kit's), and runs them with pytest under ``PYTHON`` (an interpreter with DeePMD-kit
and pytest; mdloader is put on its path). A test that uses a name still taken from DeePMD-kit's
LMDB modules (its private helpers, or a module it patches) tests DeePMD-kit, not mdloader: it is
left out and listed with the names. :data:`DIFFERENCES` lists the tests left out because
mdloader deliberately behaves otherwise (``docs/migrating.md``). Prints run / passed / failed /
left out; exits 1 when a test that ran failed.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ("source/tests/pt/test_lmdb_dataloader.py",
         "source/tests/common/dpmodel/test_lmdb_data.py")
LMDB_MODULES = ("deepmd.dpmodel.utils.lmdb_data", "deepmd.pt.utils.lmdb_dataset")
#: The names ``mdloader`` exports in place of DeePMD-kit's.
SWAPPED = frozenset({"LmdbDataReader", "LmdbBatchSampler", "DistributedLmdbBatchSampler",
                     "SameNlocBatchSampler", "DistributedSameNlocBatchSampler", "LmdbDataset",
                     "LmdbBatchDataLoader", "merge_lmdb", "compute_block_targets", "is_lmdb"})
#: Private attributes of DeePMD-kit's objects that its tests reach and mdloader's objects have.
PROVIDED_ATTRIBUTES = frozenset({"_reader", "_block_targets", "_batch_sampler"})
#: Tests of behaviour mdloader changes on purpose, and why (``docs/migrating.md``).
DIFFERENCES = {
    "test_merge_rejects_incompatible_type_maps_before_creating_output":
        "mdloader's merge_lmdb remaps differing type maps by element name instead of "
        "refusing them",
    "test_compute_block_targets_logs_dropped_block":
        "asserts the name of DeePMD-kit's logger (mdloader logs the same line under its own)",
}


#: The reference run imports the swapped names from this module: DeePMD-kit's own, the older
#: names as aliases of the newer ones when the installed release has only those.
REFERENCE_NAMES = """
from deepmd.dpmodel.utils import lmdb_data as _d
from deepmd.pt.utils import lmdb_dataset as _p

def _get(name, fallback):
    return getattr(_d, name, None) or getattr(_p, name, None) or getattr(_d, fallback)

LmdbDataReader = _d.LmdbDataReader
merge_lmdb = _d.merge_lmdb
LmdbDataset, LmdbBatchDataLoader = _p.LmdbDataset, _p.LmdbBatchDataLoader
compute_block_targets, is_lmdb = _d.compute_block_targets, _d.is_lmdb
LmdbBatchSampler = _get("LmdbBatchSampler", "SameNlocBatchSampler")
SameNlocBatchSampler = _get("SameNlocBatchSampler", "LmdbBatchSampler")
DistributedLmdbBatchSampler = _get("DistributedLmdbBatchSampler",
                                   "DistributedSameNlocBatchSampler")
DistributedSameNlocBatchSampler = _get("DistributedSameNlocBatchSampler",
                                       "DistributedLmdbBatchSampler")
"""


def rewrite(source: str, home: str = "mdloader") -> tuple[str, set[str]]:
    """The test file with the swapped names imported from ``home`` (``mdloader``), and the
    names it still imports from DeePMD-kit's LMDB modules (module aliases included)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    kept_from_deepmd: set[str] = set()
    edits: list[tuple[int, int, str]] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in LMDB_MODULES:
            names = [(a.name, a.asname or a.name) for a in node.names]
            ours = [(n, alias) for n, alias in names if n in SWAPPED]
            theirs = [(n, alias) for n, alias in names if n not in SWAPPED]
            kept_from_deepmd.update(alias for _, alias in theirs)
            text = ""
            if theirs:
                text += (f"from {node.module} import "
                         f"({', '.join(_alias(n, a) for n, a in theirs)})\n")
            if ours:
                text += f"from {home} import ({', '.join(_alias(n, a) for n, a in ours)})\n"
            edits.append((node.lineno, node.end_lineno or node.lineno, text))
        elif isinstance(node, ast.ImportFrom) and node.module in ("deepmd.dpmodel.utils",
                                                                   "deepmd.utils"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in LMDB_MODULES or alias.name == "lmdb_data":
                    kept_from_deepmd.add(alias.asname or alias.name)
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1:end] = [text]
    return "".join(lines), kept_from_deepmd


def _alias(name: str, alias: str) -> str:
    return name if name == alias else f"{name} as {alias}"


def left_out(source: str, deepmd_names: set[str]) -> dict[str, str]:
    """Test id (``Class::test`` or ``test``) -> why it is left out: the DeePMD-kit names it
    reaches, itself, through the module's helpers, its class's set-up or its fixtures."""
    tree = ast.parse(source)
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def reached(node: ast.AST, seen: set[str]) -> set[str]:
        found: set[str] = set()
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Attribute) and sub.attr.startswith("_")
                    and not sub.attr.startswith("__") and sub.attr not in PROVIDED_ATTRIBUTES
                    and not (isinstance(sub.value, ast.Name)
                             and sub.value.id in ("self", "cls"))):
                found.add(f"private attribute .{sub.attr}")
            name = sub.id if isinstance(sub, ast.Name) else None
            if isinstance(sub, ast.arg) and sub.arg in helpers:
                name = sub.arg  # a fixture taken as an argument
            if name in deepmd_names:
                found.add(name)
            elif name in helpers and name not in seen:
                seen.add(name)
                found |= reached(helpers[name], seen)
        return found

    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            names = reached(node, set())
            if names:
                out[node.name] = _reason(names)
        elif isinstance(node, ast.ClassDef):
            methods = [m for m in node.body if isinstance(m, ast.FunctionDef)]
            shared = set().union(*(reached(m, set()) for m in methods
                                   if not m.name.startswith("test")))
            for method in methods:
                if method.name.startswith("test"):
                    names = shared | reached(method, set())
                    if names:
                        out[f"{node.name}::{method.name}"] = _reason(names)
    for test_id in list(_ids(tree)):
        bare = test_id.rpartition("::")[2]
        if bare in DIFFERENCES and test_id not in out:
            out[test_id] = "deliberate difference: " + DIFFERENCES[bare]
    return out


def _ids(tree: ast.Module) -> list[str]:
    ids = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            ids.append(node.name)
        elif isinstance(node, ast.ClassDef):
            ids.extend(f"{node.name}::{m.name}" for m in node.body
                       if isinstance(m, ast.FunctionDef) and m.name.startswith("test"))
    return ids


def _reason(names: set[str]) -> str:
    return "uses DeePMD-kit's own " + ", ".join(sorted(names))


def _pytest(python: str, folder: Path, names: list[str], deselect: list[str],
            report: Path) -> tuple[dict[str, int], list[str], subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(folder), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
               str(folder), f"--junitxml={report}", *[f"--deselect={d}" for d in deselect],
               *[str(folder / name) for name in names]]
    done = subprocess.run(command, cwd=folder, env=env, text=True, capture_output=True)
    counts, failed = _counts(report)
    return counts, failed, done


def run(checkout: Path, python: str, keep: bool) -> int:
    """Run DeePMD-kit's files as they are (the reference) and with mdloader's names."""
    folder = Path(tempfile.mkdtemp(prefix="deepmd-lmdb-tests-"))
    reference = folder / "reference"
    reference.mkdir()
    (reference / "reference_names.py").write_text(REFERENCE_NAMES, encoding="utf-8")
    deselect: list[str] = []
    reasons: dict[str, str] = {}
    names: list[str] = []
    total = 0
    for rel in FILES:
        source = (checkout / rel).read_text(encoding="utf-8")
        text, deepmd_names = rewrite(source)
        name = Path(rel).name
        names.append(name)
        (folder / name).write_text(text, encoding="utf-8")
        (reference / name).write_text(rewrite(source, "reference_names")[0], encoding="utf-8")
        total += len(_ids(ast.parse(source)))
        for test_id, why in left_out(source, deepmd_names).items():
            deselect.append(f"{name}::{test_id}")
            reasons[f"{name}::{test_id}"] = why
    _, broken, _ = _pytest(python, reference, names, deselect, folder / "reference.xml")
    for node in broken:  # DeePMD-kit's own run fails them: tests of another release's API
        test_id = node.replace(".", ".py::", 1)
        deselect.append(test_id)
        reasons[test_id] = "fails on the installed DeePMD-kit itself (a test of another release)"
    counts, failed, done = _pytest(python, folder, names, deselect, folder / "report.xml")
    if done.returncode not in (0, 1) or failed:
        _say(done.stdout[-8000:] + "\n" + done.stderr[-2000:])
    _say(f"DeePMD-kit checkout: {checkout}")
    _say(f"tests: {total} (a parametrized test counted once); left out: {len(reasons)}")
    for node in sorted(reasons):
        _say(f"  left out {node}: {reasons[node]}")
    _say("run: {run}  passed: {passed}  failed: {failed}  skipped: {skipped}".format(**counts))
    for node in failed:
        _say(f"  FAILED {node}")
    if keep:
        _say(f"kept {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed or done.returncode not in (0, 1) else 0


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")


def _counts(report: Path) -> tuple[dict[str, int], list[str]]:
    counts = {"run": 0, "passed": 0, "failed": 0, "skipped": 0}
    failed: list[str] = []
    if not report.exists():
        return counts, failed
    for case in ET.parse(report).getroot().iter("testcase"):
        counts["run"] += 1
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            counts["failed"] += 1
            failed.append(f"{case.get('classname')}::{case.get('name')}")
        elif "skipped" in tags:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failed


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run; the exit status says whether every run test passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a DeePMD-kit source checkout")
    parser.add_argument("--python", default=sys.executable,
                        help="an interpreter with DeePMD-kit and pytest (default: this one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    missing = [rel for rel in FILES if not (args.checkout / rel).is_file()]
    if missing:
        parser.error(f"{args.checkout} is not a DeePMD-kit source checkout: no {missing[0]}")
    return run(args.checkout.resolve(), args.python, args.keep)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["rewrite", "left_out", "main", "SWAPPED", "DIFFERENCES"]
