"""No import circles in `ddtree_server` or `ddtctl`.

Every import statement counts, wherever it stands: module level, inside a function, under
`if TYPE_CHECKING:`. A function-level import hides a circle from Python at import time, not from
a reader; a type-only import still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"ddtree_server": ROOT / "server", "ddtctl": ROOT}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for both packages (a package's name for its __init__.py)."""
    mods = {}
    for pkg, base in PACKAGES.items():
        for path in sorted((base / pkg).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Our modules that `name` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                       # relative: from the module's package, level - 1 up
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        out |= {t for t in map(lambda n: _known(n, mods), targets) if t and t != name}
    return out


def import_graph() -> dict[str, set[str]]:
    mods = module_files()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_graph_sees_every_kind_of_import():
    """The checker itself: function-level, TYPE_CHECKING and relative imports are edges."""
    graph = import_graph()
    assert len(graph) > 100
    assert "ddtree_server.engine.engine" in graph and "ddtctl.cli.app" in graph
    # the engine reaches the model table; ddtctl's app reaches its command modules
    assert any(t.startswith("ddtree_server.models") for t in graph["ddtree_server.engine.engine"])
    assert any(t.startswith("ddtctl.cli.") for t in graph["ddtctl.cli.app"])


def test_checker_finds_hidden_circles(tmp_path):
    """A circle closed only by a function-level or TYPE_CHECKING import is still a circle."""
    pkg = tmp_path / "ddtctl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from ddtctl import b\n")
    (pkg / "b.py").write_text("def f():\n    from ddtctl.c import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    mods = {n: p for n, p in {"ddtctl": pkg / "__init__.py", "ddtctl.a": pkg / "a.py",
                              "ddtctl.b": pkg / "b.py", "ddtctl.c": pkg / "c.py"}.items()}
    graph = {n: imports_of(n, p, mods) for n, p in mods.items()}
    assert circles(graph) == [["ddtctl.a", "ddtctl.b", "ddtctl.c"]]


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles (each line one circle):\n" + "\n".join(" <-> ".join(c) for c in found)
