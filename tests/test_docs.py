"""The docs stay true to the code: the compiler guide's options table is exactly
``BackendOptions`` (names and defaults, read from the dataclass at run time), links and
repository paths in the docs resolve, docstrings cite documents that exist, the docs index
lists every page, and docs/layers.md matches the package's real imports."""

from __future__ import annotations

import ast
import dataclasses
import io
import itertools
import json
import re
import tokenize
import warnings
from collections.abc import Iterator
from pathlib import Path

from vescale.backend import BackendOptions

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md", ROOT / "tests" / "README.md"]
SOURCE_DIRS = ("vescale", "tests", "examples", "benchmarks", "scripts")
REPO_DIRS = (*SOURCE_DIRS, "docs")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without fenced blocks, indented code lines and inline code."""
    text = _FENCE.sub("", text)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return _CODE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def _table(text: str, heading: str) -> list[list[str]]:
    """Body rows (cells stripped) of the first table under ``heading``."""
    section = text.split(f"\n{heading}\n", 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("## "):
            break
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[1:]  # drop the header


def _plain(cell: str) -> str:
    """A table cell as text: links become their text, code spans lose their backticks."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell).replace("`", "")


def _option_cells(field: dataclasses.Field[object]) -> list[str]:
    """The table row of one ``BackendOptions`` field: name, default, and where the field
    documents them (``metadata["env"]``, ``metadata["doc"]``) its env var and meaning."""
    if field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        assert field.default is not dataclasses.MISSING, f"{field.name} has no default"
        default = field.default
    literal = json.dumps(default) if isinstance(default, str) else repr(default)
    cells = [f"`{field.name}`", f"`{literal}`"]
    if "env" in field.metadata:
        cells.append(f"`{field.metadata['env']}`" if field.metadata["env"] else "")
    if "doc" in field.metadata:
        cells.append(field.metadata["doc"])
    return cells


def test_options_table_is_backend_options() -> None:
    rows = _table((DOCS / "compiler.md").read_text(), "## Options")
    expected = [_option_cells(f) for f in dataclasses.fields(BackendOptions)]
    generated = "\n".join("| " + " | ".join(c + [""] * (4 - len(c))) + " |" for c in expected)
    pairs: list[tuple[list[str], list[str]]] = list(
        itertools.zip_longest(rows, expected, fillvalue=[])
    )
    wrong = [
        row[0] if row else cells[0]
        for row, cells in pairs
        if [_plain(c) for c in row[: len(cells)]] != [_plain(c) for c in cells]
    ]
    assert len(rows) == len(expected) and not wrong, (
        f"docs/compiler.md's options table differs from BackendOptions at {wrong}; "
        f"its rows, generated from the dataclass:\n{generated}"
    )


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in _LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(ROOT)} -> {target}"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, broken


def test_repository_paths_in_docs_exist() -> None:
    """Every `dir/...` path in inline code whose first part is a top-level source folder."""
    missing = []
    for page in PAGES:
        text = _FENCE.sub("", page.read_text())
        for code in re.findall(r"`([\w./-]+)`", text):
            if code.split("/", 1)[0] in REPO_DIRS and "/" in code and not (ROOT / code).exists():
                missing.append(f"{page.relative_to(ROOT)}: {code}")
    assert not missing, missing


def _docstrings_and_comments(path: Path) -> Iterator[str]:
    text = path.read_text()
    if ".md" not in text:
        return
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                yield doc
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    yield from (t.string for t in tokens if t.type == tokenize.COMMENT)


def test_docstrings_cite_existing_documents() -> None:
    """In docstrings and comments, a cited bare file name is at the root or in docs/, a
    ``dir/.../name.md`` whose first part is a top-level folder exists; other paths (e.g.
    ``rank<r>/placements.md``, a dump) are not repository paths."""
    missing = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for doc in _docstrings_and_comments(path):
                for cited in re.findall(r"(?<![\w./<>-])[\w./<>-]*\.md\b", doc):
                    if "/" not in cited:
                        found = (ROOT / cited).exists() or (DOCS / cited).exists()
                    elif cited.split("/", 1)[0] in (*REPO_DIRS, "README.md"):
                        found = (ROOT / cited).exists()
                    else:
                        continue
                    if not found:
                        missing.append(f"{path.relative_to(ROOT)}: {cited}")
    assert not missing, f"docs cited but not in the repository: {missing}"


def test_index_lists_every_page() -> None:
    linked = set(_LINK.findall((DOCS / "README.md").read_text()))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert not pages - linked, f"docs/README.md does not list {sorted(pages - linked)}"


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "vescale"


def _imports() -> set[tuple[str, str]]:
    """(importer, imported) vescale module pairs across layers, function-level imports too."""
    pairs = set()
    for path in (ROOT / "vescale").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
                if node.module == "vescale":  # from vescale import _patches: the submodule
                    names = [f"vescale.{a.name}" for a in node.names]
            pairs |= {
                (module, n)
                for n in names
                if n.split(".")[0] == "vescale" and _layer(n) != _layer(module)
            }
    return pairs


def _covers(src: str, dst: str, importer: str, imported: str) -> bool:
    return importer == src and (imported == dst or imported.startswith(dst + "."))


def test_layers_map_covers_every_import() -> None:
    text = (DOCS / "layers.md").read_text()
    rows = _table(text, "## Layers")
    order = [row[0].strip("`") for row in rows]
    documented = {
        (row[0].strip("`"), dep) for row in rows for dep in re.findall(r"`([\w.]+)`", row[3])
    }
    rank = {layer: i for i, layer in enumerate(order)}
    upward = {(a, b) for a, b in documented if rank.get(b, len(rank)) >= rank[a]}
    assert not upward, f"docs/layers.md 'imports' must point down the table: {sorted(upward)}"

    exceptions = {(r[0].strip("`"), r[1].strip("`")) for r in _table(text, "## Upward imports")}
    downward = [(x, y) for x, y in exceptions if rank[_layer(y)] <= rank[_layer(x)]]
    assert not downward, f"docs/layers.md 'Upward imports' lists downward ones: {downward}"
    actual = _imports()
    unlisted_layers = {_layer(m) for pair in actual for m in pair} - set(order)
    assert not unlisted_layers, f"docs/layers.md has no row for {sorted(unlisted_layers)}"
    excepted = {(a, b) for a, b in actual if any(_covers(x, y, a, b) for x, y in exceptions)}
    real = {(_layer(a), _layer(b)) for a, b in actual - excepted}
    assert real <= documented, (
        f"imports docs/layers.md does not allow: {sorted(real - documented)}; a downward one "
        f"goes in its layer's 'imports' cell, an upward one in 'Upward imports'"
    )
    stale = [f"{x} -> {y}" for x, y in exceptions if not any(_covers(x, y, *p) for p in actual)]
    stale += [f"{a} -> {b}" for a, b in sorted(documented - real)]
    if stale:  # the code got cleaner than the doc says: worth a doc edit, not a failure
        warnings.warn(f"docs/layers.md lists imports that are gone: {stale}", stacklevel=1)
