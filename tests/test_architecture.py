"""The rules of docs/architecture.md, checked on the source: every violation is named.

* imports follow the layers (:func:`violations`);
* no import cycle between mdloader modules, imports for type checking included (:func:`cycles`);
* no reach-in to another module's private attributes (:func:`reach_ins`);
* one atomic write and one file stamp, in ``mdloader/persist.py`` (:func:`persistence_outside`);
* one place that makes a DataLoader, one that obtains a job's catalogs, one record per
  DeePMD-kit trainer (:func:`calls_outside`).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mdloader"

#: Layer of each module (longest prefix wins) and the layers it may import.
LAYERS = {
    "mdloader": "leaf", "mdloader.errors": "leaf", "mdloader.settings": "leaf",
    "mdloader.world": "leaf", "mdloader.logs": "leaf", "mdloader.transport": "leaf",
    "mdloader.state": "leaf", "mdloader.fs_calls": "leaf",
    "mdloader.threads": "leaf", "mdloader.persist": "leaf", "mdloader.testing": "testing",
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


# -- no import cycles ---------------------------------------------------------------------------


def _is_type_checking(node: ast.If) -> bool:
    return ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import of the module, in functions too, each with whether it is only for the type
    checker (under ``if TYPE_CHECKING:``)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    todo: list[tuple[ast.AST, bool]] = [(tree, False)]
    while todo:
        node, typing_only = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, typing_only))
        elif isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend((child, True) for child in node.body)
            todo.extend((child, typing_only) for child in node.orelse)
        else:
            todo.extend((child, typing_only) for child in ast.iter_child_nodes(node))
    return sorted(found, key=lambda found: found[0].lineno)


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, str]]:
    """``graph[a][b]``: where module ``a`` imports module ``b`` (``path:line``, and ``, for type
    checking`` when under ``if TYPE_CHECKING:``), both mdloader's.

    ``from p import name`` is an edge to ``p.name`` when that is a module, else to ``p``; the
    packages that Python imports on the way (``p``'s parents) are not edges.
    """
    paths = {module_name(path, package): path for path in sorted(package.rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {me: {} for me in paths}
    for me, path in paths.items():
        for node, typing_only in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.level:  # relative: reported by violations(), not followed here
                continue
            else:
                base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                           for a in node.names]
            for target in targets:
                module = known(target) if target.startswith(package.name) else None
                if module is not None and module != me:
                    rel = path.relative_to(package.parent)
                    note = ", for type checking" if typing_only else ""
                    graph[me].setdefault(module, f"{rel}:{node.lineno}{note}")
    return graph


def _components(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _one_cycle(graph: dict[str, dict[str, str]], members: list[str]) -> str:
    """The shortest cycle through the first module of a component, each import with its line."""
    start, inside = members[0], set(members)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                path.reverse()
                hops = [f"{a} ({graph[a][b]})" for a, b in zip(path, [*path[1:], start])]
                return " -> ".join([*hops, start])
            if child in inside and child not in parent and child != start:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def cycles(package: Path = PACKAGE,
           expected: tuple[frozenset[str], ...] = ()
           ) -> list[str]:
    """Every import cycle between mdloader modules that is not (part of) an expected one.

    Function-level imports count: an import deferred into a function (for a cheap ``import
    mdloader`` or an optional dependency) still makes the two modules depend on each other, and
    a cycle closed that way is a circle the layers hide. Imports under ``if TYPE_CHECKING:``
    count too: they never run, but a module that needs another's types to be understood
    depends on it as much, and such an import is how a runtime cycle is hidden. The packages
    Python imports on the way to a module (its ``__init__`` files) are not edges, only the
    modules an import names.
    """
    graph = import_graph(package)
    return [f"import cycle: {_one_cycle(graph, members)}"
            for members in _components(graph)
            if not any(set(members) <= allowed for allowed in expected)]


def test_no_import_cycles() -> None:
    problems = cycles()
    assert not problems, "\n".join(problems)


def test_the_cycle_checker_names_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "mdloader"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "data" / "__init__.py").write_text("", encoding="utf-8")
    (package / "data" / "a.py").write_text("from mdloader.data import b\n", encoding="utf-8")
    (package / "data" / "b.py").write_text("def f():\n    from mdloader.data.a import x\n",
                                           encoding="utf-8")
    (package / "data" / "c.py").write_text(  # only for the type checker: a cycle all the same
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mdloader.data.d\n",
        encoding="utf-8")
    (package / "data" / "d.py").write_text("import mdloader.data.c\n", encoding="utf-8")
    (package / "data" / "e.py").write_text(  # for the type checker, one way: no cycle
        "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import mdloader.data.a\n"
        "if typing.TYPE_CHECKING:\n    from mdloader.data.d import x\n", encoding="utf-8")
    assert cycles(package, expected=()) == [
        "import cycle: mdloader.data.a (mdloader/data/a.py:1) -> "
        "mdloader.data.b (mdloader/data/b.py:2) -> mdloader.data.a",
        "import cycle: mdloader.data.c (mdloader/data/c.py:3, for type checking) -> "
        "mdloader.data.d (mdloader/data/d.py:1) -> mdloader.data.c"]
    assert cycles(package, expected=(frozenset({"mdloader.data.a", "mdloader.data.b"}),
                                      frozenset({"mdloader.data.c", "mdloader.data.d"}))) == []
    graph = import_graph(package)
    assert graph["mdloader.data.e"] == {"mdloader.data.a": "mdloader/data/e.py:5",
                                        "mdloader.data.d": "mdloader/data/e.py:7, for type "
                                                           "checking"}


# -- no reach-ins to another module's private attributes ----------------------------------------

#: Private names of libraries that mdloader uses on purpose, as ``owner._name`` (the owner's last
#: name part), each with the reason.
LIBRARY_PRIVATES = {
    "os._exit": "the documented way to leave a process without cleanup (a failed rank)",
    "argparse._SubParsersAction": "the type add_subparsers() returns; argparse names it no other "
                                  "way",
    "distributed_c10d._get_default_store": "torch's only way to reach the default group's store, "
                                           "where a failed rank publishes its error",
}


def _defined_names(tree: ast.AST) -> set[str]:
    """Names this module defines: functions, classes, assigned names, ``self.``/``cls.``
    attributes, arguments, and ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                   for t in node.targets)):
            names |= {c.value for c in ast.walk(node.value)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return names


def _owner(node: ast.expr) -> str:
    """The last name part of an attribute's owner: ``a.b._c`` -> ``b``, ``f()._c`` -> ``f()``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ast.unparse(node)


def reach_ins(package: Path = PACKAGE,
              expected: frozenset[str] = frozenset()
              ) -> list[str]:
    """Every ``obj._private`` where ``obj`` is not ``self``/``cls`` and this module does not
    define ``_private`` itself: such code depends on how another module works inside.

    Dunder names are public protocol. A private name the same module defines (a class's own
    attribute read on another instance, as in ``__eq__``) is the module's own business.
    """
    problems = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        mine = _defined_names(tree)
        rel = path.relative_to(package.parent)
        for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__") and node.attr.endswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in mine or f"{_owner(node.value)}.{node.attr}" in LIBRARY_PRIVATES:
                continue
            text = ast.unparse(node)
            if f"{rel}: {text}" not in expected:
                problems.append(f"{rel}:{node.lineno}: {text} reaches into a private attribute "
                                f"defined elsewhere: use (or add) a public one")
    return problems


def test_no_reach_ins_to_private_attributes() -> None:
    problems = reach_ins()
    assert not problems, "\n".join(problems)


def test_the_reach_in_checker_names_each_one(tmp_path: Path) -> None:
    probe = tmp_path / "mdloader" / "train" / "_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        "import os\n"
        "class Box:\n"
        "    def __init__(self, other):\n"
        "        self._mine = other._mine\n"          # defined here: fine
        "        self._n = other.meta._natoms\n"      # defined elsewhere: a reach-in
        "    def __eq__(self, other):\n"
        "        return other.__class__ is Box\n"     # dunder: fine
        "def leave(ds):\n"
        "    os._exit(ds._ntypes)\n", encoding="utf-8")  # library private: allowed; _ntypes: not
    assert reach_ins(tmp_path / "mdloader", expected=frozenset()) == [
        "mdloader/train/_probe.py:5: other.meta._natoms reaches into a private attribute "
        "defined elsewhere: use (or add) a public one",
        "mdloader/train/_probe.py:9: ds._ntypes reaches into a private attribute defined "
        "elsewhere: use (or add) a public one",
    ]


# -- one persistence leaf -----------------------------------------------------------------------

#: Calls that publish or flush a file, or make a temporary one: only ``mdloader/persist.py``.
PERSIST_CALLS = {"os.replace", "os.rename", "os.fsync", "tempfile.mkstemp",
                 "tempfile.NamedTemporaryFile", "mkstemp", "NamedTemporaryFile"}
#: ``stat`` fields that say whether a file changed: only ``mdloader/persist.py`` reads them.
STAMP_FIELDS = ("st_mtime", "st_ctime", "st_ino")
#: Uses outside ``persist.py`` that are no persistence, as ``path: code``, each with the reason.
PERSIST_ALLOWED: dict[str, str] = {}


def persistence_outside(package: Path = PACKAGE,
                        allowed: dict[str, str] = PERSIST_ALLOWED) -> list[str]:
    """Every call of :data:`PERSIST_CALLS` and every read of a :data:`STAMP_FIELDS` field
    outside ``mdloader/persist.py``: a second atomic write or file stamp, with other
    guarantees than the one."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        if rel.as_posix() == "mdloader/persist.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
            if isinstance(node, ast.Call):
                text = ast.unparse(node.func)
                what = "an atomic write" if text in PERSIST_CALLS else None
            elif isinstance(node, ast.Attribute) and node.attr.startswith(STAMP_FIELDS):
                text, what = ast.unparse(node), "a file stamp"
            else:
                continue
            if what is None or f"{rel}: {text}" in allowed:
                continue
            problems.append(f"{rel}:{node.lineno}: {text} is {what} of its own: use "
                            "mdloader.persist")
    return problems


def test_one_atomic_write_and_one_file_stamp() -> None:
    problems = persistence_outside()
    assert not problems, "\n".join(problems)


def test_the_persistence_checker_names_each_one(tmp_path: Path) -> None:
    probe = tmp_path / "mdloader" / "catalog" / "_probe.py"
    probe.parent.mkdir(parents=True)
    (tmp_path / "mdloader" / "persist.py").write_text("import os\nos.replace('a', 'b')\n",
                                                       encoding="utf-8")  # the one place
    probe.write_text(
        "import os, tempfile\n"
        "def save(path, data):\n"
        "    fd, tmp = tempfile.mkstemp(dir='.')\n"
        "    os.fsync(fd)\n"
        "    os.replace(tmp, path)\n"
        "def stamp(path):\n"
        "    st = os.stat(path)\n"               # a stat alone: fine
        "    return st.st_size, st.st_mtime_ns\n", encoding="utf-8")
    assert persistence_outside(tmp_path / "mdloader", allowed={}) == [
        "mdloader/catalog/_probe.py:3: tempfile.mkstemp is an atomic write of its own: use "
        "mdloader.persist",
        "mdloader/catalog/_probe.py:4: os.fsync is an atomic write of its own: use "
        "mdloader.persist",
        "mdloader/catalog/_probe.py:5: os.replace is an atomic write of its own: use "
        "mdloader.persist",
        "mdloader/catalog/_probe.py:8: st.st_mtime_ns is a file stamp of its own: use "
        "mdloader.persist",
    ]
    allowed = {"mdloader/catalog/_probe.py: os.fsync": "a probe"}
    assert len(persistence_outside(tmp_path / "mdloader", allowed=allowed)) == 3


# -- one place for each piece of infrastructure ------------------------------------------------

#: A call and the one module that may make it: a DataLoader is the worker pool's (the one road
#: to workers, errors carried as objects, workers bound to their rank), a catalog the build's
#: (one rank-0 build and one broadcast per job), a weak dictionary keyed by DeePMD-kit's trainer
#: the adapter's hooks' (one record per trainer, nothing else kept beside it).
ONE_PLACE = {"DataLoader": "mdloader/loading/pool.py",
             "catalog_for": "mdloader/loading/build.py",
             "WeakKeyDictionary": "mdloader/integrations/deepmd/hooks.py"}
#: The commands may obtain a catalog for themselves (``index``, ``cache``): they build no job.
ONE_PLACE_EXEMPT = ("mdloader/cli/",)


def calls_outside(package: Path = PACKAGE) -> list[str]:
    """Every call of a :data:`ONE_PLACE` name outside its one module, and any second call in
    that module of a name that is called once (``DataLoader``, ``WeakKeyDictionary``)."""
    problems, seen = [], {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            home = ONE_PLACE.get(name)
            if home is None or rel.startswith(ONE_PLACE_EXEMPT):
                continue
            if rel != home:
                problems.append(f"{rel}:{node.lineno}: {name} is called outside {home}")
            elif name != "catalog_for" and seen.setdefault(name, node.lineno) != node.lineno:
                problems.append(f"{rel}:{node.lineno}: a second {name} in {home}")
    return problems


def test_a_dataloader_a_catalog_and_a_trainers_record_are_made_in_one_place() -> None:
    problems = calls_outside()
    assert not problems, "\n".join(problems)


def test_the_one_place_checker_names_each_call(tmp_path: Path) -> None:
    probe = tmp_path / "mdloader" / "train" / "_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("import weakref\nfrom torch.utils.data import DataLoader\n"
                     "loader = DataLoader([])\nrecords = weakref.WeakKeyDictionary()\n",
                     encoding="utf-8")
    assert calls_outside(tmp_path / "mdloader") == [
        "mdloader/train/_probe.py:3: DataLoader is called outside mdloader/loading/pool.py",
        "mdloader/train/_probe.py:4: WeakKeyDictionary is called outside "
        "mdloader/integrations/deepmd/hooks.py"]
