"""The core's shape, read from its source with ``ast`` (core 0.3, "one engine"):
imports point one way (no circle among core modules, function-level imports
included), no module imports another module's private name, and the engine stays
sized for a reader."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core" / "specdec"
#: Applications on top of the core: their functions may be longer (a command's body).
APPS = ("bench", "cli", "testing", "models")


def _modules() -> dict[str, Path]:
    out = {}
    for f in CORE.rglob("*.py"):
        parts = list(f.relative_to(CORE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import in ``path``."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in mods else mod, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
    return [(m, n, line) for m, n, line in out if m.startswith("specdec")]


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for mod, _, _ in _imports(name, path, mods):
            while mod not in mods and "." in mod:
                mod = mod.rsplit(".", 1)[0]
            if mod in mods and mod not in (name, "specdec"):
                edges[name].add(mod)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_core_modules():
    assert not _cycles(_graph()), "import circles (function-level imports count too)"


def test_a_circle_is_found_when_there_is_one():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_name():
    mods = _modules()
    bad = []
    for name, path in mods.items():
        for mod, imported, line in _imports(name, path, mods):
            if imported.startswith("_") and not imported.startswith("__") and mod != name:
                bad.append(f"{path.relative_to(CORE)}:{line} imports {mod}.{imported}")
    assert not bad, bad


def test_the_engine_is_sized_for_a_reader():
    holder = next(f for f in CORE.glob("*.py") if "\nclass Pipeline" in f.read_text())
    assert len(holder.read_text().splitlines()) <= 500, holder.name
    long = []
    for name, path in _modules().items():
        if name.split(".")[1:2] and name.split(".")[1] in APPS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 80:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, long
