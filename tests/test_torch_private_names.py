"""Every private torch name vescale's source uses is in the seam table (issue 28).

Each module of ``vescale/`` but the seam itself is read (AST) for private (``_``-prefixed,
not dunder) torch names:

- imports: a private component of a torch module path (``torch.distributed._functional_
  collectives``) or a private name imported from torch (``from torch... import _x``);
- attribute chains from a torch import (``torch._C._current_graph_task_id``,
  ``DTensor._op_dispatcher._custom_op_handlers``); operator namespaces (``torch.ops.aten._x``,
  ``aten._x``) are op names, not Python API, and are left out;
- any other ``obj._x``, ``getattr(obj, "_x")``, ``f(_x=...)``, ``"_x"`` or method ``def _x``
  whose name a torch class that vescale imports or reaches (or its torch bases) defines: a
  class attribute, an attribute its source assigns, a private parameter; unless a vescale
  class defines it and that class's torch bases do not.

Each name must be an attribute of ``vescale._torch_compat.PRIVATE_ATTRIBUTES`` (pinned by
``tests/test_torch_compat.py``) or a private name the seam module imports or reads itself.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from vescale import _torch_compat as compat

# Resolving torch paths imports Inductor, whose first import warns of torch.jit.script_method
# (torch's own deprecation, not raised by vescale code).
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vescale"
SEAM = PACKAGE / "_torch_compat.py"
_ATTR_CALLS = ("getattr", "hasattr", "setattr", "delattr")


class Use(NamedTuple):
    where: str  # file:line
    owner: str  # the torch path it is read from, or "?" when only the name is known
    name: str


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_identifier(value: object) -> bool:
    return isinstance(value, str) and value.isidentifier() and _private(value)


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; ``None`` unless it is rooted at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _is_torch(module: str | None) -> bool:
    return (module or "").split(".")[0] == "torch"


def _is_vescale(module: str | None) -> bool:
    return (module or "").split(".")[0] == "vescale"


def _is_ops(path: str) -> bool:
    return path == "torch.ops" or path.startswith("torch.ops.")


def torch_bindings(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted torch path it is bound to by an import or a module-level alias
    (``aten = torch.ops.aten``)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_torch(a.name):
                    out[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch(node.module):
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    for node in tree.body:
        if isinstance(node, ast.Assign) and [type(t) for t in node.targets] == [ast.Name]:
            c = _chain(node.value)
            if c and c[0] in out:
                out[node.targets[0].id] = ".".join([out[c[0]], *c[1:]])  # type: ignore[attr-defined]
    return out


def _path_uses(line: int, path: list[str]) -> Iterator[tuple[int, str, str]]:
    for i, part in enumerate(path):
        if _private(part):
            yield line, ".".join(path[:i]), part


def scan(label: str, source: str) -> list[Use]:
    """The private names ``source`` uses: known torch paths, and bare names (owner ``"?"``)
    to be matched against torch's classes."""
    tree = ast.parse(source)
    bind = torch_bindings(tree)
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_torch(a.name):
                    found += _path_uses(node.lineno, a.name.split("."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch(node.module):
            found += _path_uses(node.lineno, node.module.split("."))  # type: ignore[union-attr]
            found += [(node.lineno, node.module, a.name) for a in node.names if _private(a.name)]  # type: ignore[misc]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            c = _chain(node)
            if c and c[0] in bind:
                owner = ".".join([bind[c[0]], *c[1:-1]])
                if not _is_ops(owner):
                    found.append((node.lineno, owner, node.attr))
            else:
                found.append((node.lineno, "?", node.attr))
        elif isinstance(node, ast.ClassDef):  # a method overriding a torch class's hook
            found += [
                (f.lineno, "?", f.name)
                for f in node.body
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and _private(f.name)
            ]
        elif isinstance(node, ast.keyword) and node.arg and _private(node.arg):
            found.append((getattr(node, "lineno", 0), "?", node.arg))
        elif isinstance(node, ast.Constant) and _private_identifier(node.value):
            found.append((node.lineno, "?", node.value))
    return [Use(f"{label}:{line}", owner, name) for line, owner, name in found]


def _resolve(path: str) -> Any:
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i]))
    return obj


def _from_torch(obj: Any) -> bool:
    return _is_torch(getattr(obj, "__module__", None))


def _assigned(obj: Any) -> set[str]:
    """Private attribute names assigned (``x._a = ...``, ``x._a, x._b = ...``) in ``obj``'s
    source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _private(n.attr)
    }


def _parameters(obj: Any) -> set[str]:
    try:
        return {p for p in inspect.signature(obj).parameters if _private(p)}
    except (TypeError, ValueError):
        return set()


def _class_names(cls: type) -> set[str]:
    """Private names ``cls`` itself defines: class attributes (not those ``vescale._patches``
    installed), attributes its source assigns, slots."""
    slots = getattr(cls, "__slots__", ())
    installed = {n for n, v in vars(cls).items() if _is_vescale(getattr(v, "__module__", None))}
    own = {n for n in vars(cls) if _private(n) and n not in installed} | _assigned(cls)
    return own | {s for s in ([slots] if isinstance(slots, str) else slots) if _private(s)}


def torch_private_names(objects: Iterable[Any]) -> set[str]:
    """Private names of the torch classes among ``objects`` (instances count as their
    class) and their torch bases, and attributes / parameters of torch functions."""
    out: set[str] = set()
    seen: set[type] = set()
    for obj in objects:
        if inspect.ismodule(obj):
            continue
        if callable(obj) and not isinstance(obj, type):
            if _from_torch(obj):
                out |= _assigned(obj) | _parameters(obj)
            continue
        cls = obj if isinstance(obj, type) else type(obj)
        for base in cls.__mro__:
            if base not in seen and _from_torch(base):
                seen.add(base)
                out |= _class_names(base) | _parameters(base)
    return out


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def torch_objects(sources: dict[Path, str]) -> list[Any]:
    """The torch objects vescale names: the seam's exports, and every import from torch and
    attribute chain from one (each prefix) that resolves."""
    out: list[Any] = [getattr(compat, n) for n in compat.__all__]
    for source in sources.values():
        tree = ast.parse(source)
        bind = torch_bindings(tree)
        paths = set(bind.values())
        for node in ast.walk(tree):
            c = _chain(node) if isinstance(node, ast.Attribute) else None
            if c and c[0] in bind:
                paths |= {".".join([bind[c[0]], *c[1:k]]) for k in range(2, len(c) + 1)}
        for path in sorted(p for p in paths if not _is_ops(p)):
            try:
                out.append(_resolve(path))
            except (ImportError, AttributeError):
                continue  # a name that is not there is the seam tests' business
    return out


def vescale_own_names(sources: dict[Path, str]) -> set[str]:
    """Private names vescale's classes define that their torch bases do not."""
    own: set[str] = set()
    for path in sources:
        module = importlib.import_module(_module_name(path))
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == module.__name__:
                torch_bases = [b for b in cls.__mro__ if _from_torch(b)]
                inherited = set().union(*(_class_names(b) | _parameters(b) for b in torch_bases))
                own |= _class_names(cls) - inherited
    return own


def seam_table() -> tuple[set[str], set[str]]:
    """What the seam covers: the attribute names of ``PRIVATE_ATTRIBUTES``, and the torch
    paths (``torch._C._foo``) the seam module imports or reads itself."""
    attrs = {attr for _, attr in compat.PRIVATE_ATTRIBUTES}
    paths = {f"{u.owner}.{u.name}" for u in scan("seam", SEAM.read_text()) if u.owner != "?"}
    return attrs, paths


def missing(
    uses: Iterable[Use], torch_names: set[str], own: set[str], seam: tuple[set[str], set[str]]
) -> list[str]:
    """``file:line owner.name`` of each torch private name used and not in the seam table:
    a name read from a known torch path is covered by its attribute name in the table or its
    path read by the seam; a bare name by its attribute name or a seam path ending in it."""
    attrs, paths = seam
    leaves = {p.rsplit(".", 1)[1] for p in paths}
    out = []
    for u in uses:
        if u.owner == "?":
            absent = u.name in torch_names and u.name not in own | attrs | leaves
        else:
            absent = u.name not in attrs and f"{u.owner}.{u.name}" not in paths
        if absent:
            out.append(f"{u.where} {u.owner}.{u.name}")
    return out


def test_scan_finds_each_kind_of_private_use():
    probe = (
        "import torch\n"
        "import torch.distributed._functional_collectives as funcol\n"
        "from torch.distributed.tensor import DTensor\n"
        "from torch.utils._python_dispatch import _disable_current_modes\n"
        "aten = torch.ops.aten\n"
        "x = torch._C._current_graph_task_id()\n"
        "DTensor._op_dispatcher.wrap\n"
        "aten._unsafe_view.default, torch.ops._c10d_functional.wait_tensor\n"
        "mesh._get_root_mesh(), getattr(mesh, '_dim_group_names'), M(_rank=0), obj.__class__\n"
        "class S(DTensorSpec):\n"
        "    def _hash_impl(self): ...\n"
    )
    got = {(int(u.where.split(":")[1]), u.owner, u.name) for u in scan("probe", probe)}
    assert got == {
        (2, "torch.distributed", "_functional_collectives"),
        (4, "torch.utils", "_python_dispatch"),
        (4, "torch.utils._python_dispatch", "_disable_current_modes"),
        (6, "torch", "_C"),
        (6, "torch._C", "_current_graph_task_id"),
        (7, "torch.distributed.tensor.DTensor", "_op_dispatcher"),
        (9, "?", "_get_root_mesh"),
        (9, "?", "_dim_group_names"),
        (9, "?", "_rank"),
        (11, "?", "_hash_impl"),
    }


class Facts(NamedTuple):
    sources: dict[Path, str]
    torch_objects: list[Any]
    torch_names: set[str]
    own: set[str]


@pytest.fixture(scope="module")
def facts() -> Facts:
    """The package's sources, the torch objects they reach and those objects' private names,
    vescale's own private names."""
    sources = _sources()
    objects = torch_objects(sources)
    return Facts(sources, objects, torch_private_names(objects), vescale_own_names(sources))


def test_torch_names_are_told_from_vescale_ones(facts):
    names, own = facts.torch_names, facts.own
    # torch's: DeviceMesh methods, DTensor's payload, a DTensorSpec hook VescaleSpec overrides
    assert {"_get_root_mesh", "_local_tensor", "_stable_hash", "_init_backend"} <= names - own
    assert {"_record", "_view"} <= own  # the deferred-init tensor's own fields
    uses = [Use("probe:1", "?", "_stable_hash"), Use("probe:2", "?", "_record")]
    assert missing(uses, names, own, (set(), set())) == ["probe:1 ?._stable_hash"]
    assert "_unpad_tensor" not in names  # vescale's own helper, installed on upstream's Shard
    # a path is covered by the seam reading that path, not another one ending in the name
    paths = [
        Use("probe:3", "torch.distributed.tensor", "_redistribute"),
        Use("probe:4", "torch.distributed", "_redistribute"),
    ]
    assert missing(paths, names, own, seam_table()) == ["probe:4 torch.distributed._redistribute"]


def name_tests(label: str, source: str, class_names: set[str]) -> list[str]:
    """``file:line`` of each ``... .__name__ == "X"`` (or ``!=``, ``in``) with ``X`` one of
    ``class_names``: a class told by its name instead of by the class from the seam."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(n, ast.Attribute) and n.attr == "__name__" for n in sides)
            strings = {
                e.value
                for n in sides
                for e in ([n] if isinstance(n, ast.Constant) else getattr(n, "elts", []))
                if isinstance(e, ast.Constant)
            }
            if named and strings & class_names:
                out.append(f"{label}:{node.lineno}")
    return out


def test_no_torch_class_is_told_by_its_name(facts):
    classes = {
        k.__name__
        for obj in facts.torch_objects
        if isinstance(obj, type)
        for k in obj.__mro__
        if _from_torch(k)
    }
    assert "_StridedShard" in classes
    probe = (
        'type(p).__name__ == "_StridedShard"\n'
        'x.__name__ in ("Shard", "Mine")\n'
        'type(p).__name__ == "Mine"\n'
    )
    assert name_tests("probe", probe, classes) == ["probe:1", "probe:2"]
    hits = [
        h
        for path, source in facts.sources.items()
        for h in name_tests(str(path.relative_to(ROOT)), source, classes)
    ]
    assert not hits, (
        f"torch classes told by name (use the class from vescale._torch_compat): {hits}"
    )


def test_every_private_torch_name_used_is_in_the_seam_table(facts):
    uses = [
        u
        for path, source in facts.sources.items()
        if path != SEAM
        for u in scan(str(path.relative_to(ROOT)), source)
    ]
    absent = sorted(set(missing(uses, facts.torch_names, facts.own, seam_table())))
    assert not absent, (
        "private torch names used outside vescale/_torch_compat.py and missing from its "
        "PRIVATE_ATTRIBUTES (add them there, pinned by tests/test_torch_compat.py):\n"
        + "\n".join(absent)
    )
