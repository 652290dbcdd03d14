"""The package's import structure: no import cycles, every eager-layer module importable on
its own, and ``vescale.DTensor``'s attributes set only in its own module."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vescale"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module, *, nested: bool) -> list[ast.Import | ast.ImportFrom]:
    """Import statements of ``tree``: module level (``nested=False``) or anywhere."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif _type_checking(node):
            continue
        elif nested or not isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
        ):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _graph(*, nested: bool) -> dict[str, set[str]]:
    """Module -> the vescale modules it imports (a name from a package counts as the
    package, a submodule as itself)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text()), nested=nested):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif node.module and node.level == 0 and node.module in mods:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in mods else node.module)
        graph[name] = deps - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_module_level_imports_have_no_cycle():
    graph = _graph(nested=False)
    assert "vescale.dtensor.dtensor" in graph["vescale.dtensor"]  # the graph is read
    assert _cycles(graph) == []


def test_lazy_imports_add_no_cycle():
    """Imports inside functions too: the seam imports the eager modules whose replacements it
    installs, and none of those imports the seam back for it."""
    assert _cycles(_graph(nested=True)) == []


def test_eager_layer_imports_nothing_of_the_compiler():
    """``vescale.dtensor`` (function-level imports too) imports no ``vescale.fx``,
    ``vescale.passes``, ``vescale.backend`` or ``vescale.plan`` module."""
    graph = _graph(nested=True)
    upper = ("vescale.fx", "vescale.passes", "vescale.backend", "vescale.plan")
    assert "vescale._stack" in graph["vescale.dtensor.explicit"]  # the graph is read
    upward = {
        (a, b)
        for a, deps in graph.items()
        if a.startswith("vescale.dtensor")
        for b in deps
        if b.startswith(upper)
    }
    assert upward == set()


def test_dtensor_module_imports_neither_api_nor_legacy():
    graph = _graph(nested=True)
    assert graph["vescale.dtensor.dtensor"].isdisjoint(
        {"vescale.dtensor.api", "vescale.dtensor._legacy", "vescale.dtensor"}
    )
    assert "vescale.dtensor.dtensor" in graph["vescale.dtensor.api"]


def test_no_module_imports_the_legacy_api_facade():
    """``vescale.dtensor.api`` re-exports for users; vescale's own modules import the homes."""
    graph = _graph(nested=True)
    assert [m for m, deps in graph.items() if "vescale.dtensor.api" in deps] == []


def _dtensor_aliases(tree: ast.Module) -> set[str]:
    """Names bound to ``vescale.DTensor`` by this module's imports."""
    homes = {"vescale", "vescale.dtensor", "vescale.dtensor.dtensor", "vescale.dtensor.api"}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in homes:
            names |= {a.asname or a.name for a in node.names if a.name == "DTensor"}
    return names


def _class_attribute_writes(source: str, name: str) -> list[str]:
    """``DTensor.x = ...`` / ``setattr(DTensor, ...)`` / ``vescale.DTensor.x = ...`` in
    ``source`` (module ``name``), as ``name:line``."""
    tree = ast.parse(source)
    aliases = _dtensor_aliases(tree)

    def is_cls(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in aliases
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "DTensor"
            and (
                ast.unparse(node.value) in ("vescale", "vescale.dtensor", "vescale.dtensor.dtensor")
            )
        )

    hits = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("setattr", "delattr")
            and node.args
            and is_cls(node.args[0])
        ):
            hits.append(f"{name}:{node.lineno}")
        for t in targets:
            if isinstance(t, ast.Attribute) and is_cls(t.value):
                hits.append(f"{name}:{node.lineno}")
    return hits


def test_dtensor_class_attributes_are_set_only_in_its_module():
    home = PACKAGE / "dtensor" / "dtensor.py"
    hits = [
        h
        for n, p in _modules().items()
        if p != home
        for h in _class_attribute_writes(p.read_text(), n)
    ]
    assert hits == []
    probe = "from vescale import DTensor as D\nD.placements = 1\nsetattr(D, 'x', 2)\n"
    assert _class_attribute_writes(probe, "probe") == ["probe:2", "probe:3"]


_ALONE = textwrap.dedent(
    """
    import importlib, os, sys, types

    packages, modules, root = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3]


    def bare_packages():  # empty packages: a module imports nothing but its own needs
        for m in [m for m in sys.modules if m == "vescale" or m.startswith("vescale.")]:
            del sys.modules[m]
        for pkg in packages:
            stub = types.ModuleType(pkg)
            stub.__path__ = [os.path.join(root, *pkg.split("."))]
            sys.modules[pkg] = stub


    bare_packages()
    importlib.import_module("vescale._torch_compat")  # torch's modules, once before the forks
    failed = []
    for name in modules:
        pid = os.fork()
        if pid == 0:
            bare_packages()
            try:
                importlib.import_module(name)
            except BaseException as e:
                print(f"{name}: {type(e).__name__}: {e}", flush=True)
                os._exit(1)
            os._exit(0)
        if os.waitpid(pid, 0)[1] != 0:
            failed.append(name)
    print("FAILED", ",".join(failed))
    """
)


def _import_alone(modules: list[str]) -> str:
    """Import each of ``modules`` before any other vescale module (a fork per module, the
    packages' ``__init__`` files left out, since they would import everything first); the
    helper's last line names those that failed."""
    packages = sorted(n for n, p in _modules().items() if p.name == "__init__.py")
    res = subprocess.run(
        [sys.executable, "-c", _ALONE, ",".join(packages), ",".join(modules), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_the_dtensor_modules_import_first_in_a_fresh_interpreter():
    core = ["api", "dtensor", "_legacy", "layout", "placement_types"]
    out = _import_alone([f"vescale.dtensor.{m}" for m in core])
    assert out.strip().endswith("FAILED"), out[-3000:]


@pytest.mark.full
def test_every_eager_module_imports_first_in_a_fresh_interpreter():
    """Every module directly in ``vescale/dtensor`` (``ops/`` handlers are leaves, covered
    by the import graph above)."""
    mods = [n for n in _modules() if n.count(".") == 2 and n.startswith("vescale.dtensor.")]
    out = _import_alone(sorted(mods))
    assert out.strip().endswith("FAILED"), out[-3000:]
