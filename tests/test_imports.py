"""The project's modules (`app/`, `model/`) import each other without a circle, and at the top of the module: an
import of one of them inside a function, which is how a circle gets hidden, fails here too.

The graph is read with `ast` from every import statement anywhere in a module (in a function too), absolute or
relative. `from package import name` is an edge to the submodule `package.name` when there is one, else to the
package: a submodule that imports a sibling by its module path (`from model.kernels import build`, or
`from model.kernels.build import MAX_ROWS`) does not depend on its package's `__init__`, which may re-export it,
though Python runs that `__init__` first; one that takes a name from the package (`from model.kernels import
library`) does, and closes a circle with an `__init__` that imports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests import REPO

PACKAGES = ("app", "model")
# "module: imported module" -> why it is imported inside a function (an optional dependency of the project's own,
# or one that must not load at import time). Third-party imports are not checked: `matplotlib`, `tqdm` and
# `torch.utils.cpp_extension` are imported where they are used, as they are optional or slow to import.
ALLOWED_INSIDE_FUNCTIONS: dict[str, str] = {}


def modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py under `packages` (a package by its own name, not `x.__init__`)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, ast.stmt]]:
    """(imported project module, the statement) for each import of a project module in module `name`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in dict.fromkeys(_targets(node, package, known)):  # once per statement
                yield target, node


def _targets(node: ast.Import | ast.ImportFrom, package: str, known: dict[str, Path]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = alias.name
            while target and target not in known:  # `import a.b.c` of a module a.b that has no c
                target = target.rpartition(".")[0]
            if target:
                yield target
        return
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([base] if base else []))
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            yield f"{base}.{alias.name}"
        elif base in known:
            yield base


def graph(known: dict[str, Path]) -> dict[str, set[str]]:
    return {name: {t for t, _ in imports(name, path, known) if t != name} for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def inside_functions(known: dict[str, Path]) -> list[str]:
    """'module:line imports module' for each import of a project module inside a function."""
    out = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        inner = {(n.lineno, n.col_offset) for f in functions for n in ast.walk(f)
                 if isinstance(n, (ast.Import, ast.ImportFrom))}
        out += [f"{name}:{node.lineno} imports {target}" for target, node in imports(name, path, known)
                if (node.lineno, node.col_offset) in inner and f"{name}: {target}" not in ALLOWED_INSIDE_FUNCTIONS]
    return sorted(out)


def describe(component: list[str], edges: dict[str, set[str]]) -> str:
    inside = set(component)
    return "; ".join(f"{v} -> {', '.join(sorted(edges[v] & inside))}" for v in component)


def test_no_import_circles() -> None:
    known = modules(REPO)
    edges = graph(known)
    assert "app.http.errors" in edges["app.main"] and "model.gpt" in edges["model.checkpoint"]  # the graph is read
    found = circles(edges)
    assert found == [], "import circles: " + " | ".join(describe(c, edges) for c in found)


def test_no_project_imports_inside_functions() -> None:
    found = inside_functions(modules(REPO))
    assert found == [], "imports of the project's modules inside functions (move them to the top): " + "; ".join(found)


def test_allowed_imports_inside_functions_are_still_there() -> None:
    """An entry of the allow-list that no longer matches an import is removed, not left to excuse a new one."""
    known = modules(REPO)
    present = {f"{name}: {target}" for name, path in known.items() for target, _ in imports(name, path, known)}
    assert set(ALLOWED_INSIDE_FUNCTIONS) <= present


def test_the_checks_find_a_circle_hidden_in_a_function(tmp_path: Path) -> None:
    """On a made-up package: a circle closed by an import inside a function is found, and named; a submodule that
    imports a sibling through the package that re-exports it is not a circle, one that takes a re-exported name
    from the package is."""
    files = {
        "pkg/__init__.py": "from pkg.low import helper\nfrom pkg.high import run\n",
        "pkg/low.py": "def helper():\n    from .high import run\n    return run\n",
        "pkg/high.py": "import pkg.low\n\ndef run():\n    return pkg.low.helper\n",
        "kit/__init__.py": "from kit.a import A\nfrom kit.b import B\n",
        "kit/a.py": "A = 1\n",
        "kit/b.py": "from kit import a\nB = a.A\n",
        "bad/__init__.py": "from bad.a import A\nfrom bad.b import B\n",
        "bad/a.py": "A = 1\n",
        "bad/b.py": "from bad import A\nB = A\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    known = modules(tmp_path, ("pkg", "kit", "bad"))
    edges = graph(known)
    assert circles(edges) == [["bad", "bad.b"], ["pkg.high", "pkg.low"]]
    assert describe(["pkg.high", "pkg.low"], edges) == "pkg.high -> pkg.low; pkg.low -> pkg.high"
    assert inside_functions(known) == ["pkg.low:2 imports pkg.high"]
