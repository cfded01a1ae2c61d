"""The package's shape: the import graph of ``src/dyndepth`` has no cycle, no module imports
another inside a function (a lazy import that could hide a cycle), and the library core imports
no application code and no plotting or progress-bar package."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import dyndepth

PACKAGE = pathlib.Path(dyndepth.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path) -> tuple[set[str], list[str]]:
    """``(modules of the package imported at module level, lazily imported ones)``."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top, lazy = set(), []

    def resolve(node):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module.
            subs = [f"{base}.{a.name}" for a in node.names]
            found = [m for m in subs if _exists(m)] or [base]
        else:
            found = [a.name for a in node.names]
        return [f for f in found if f.startswith("dyndepth") and _exists(f)]

    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = resolve(node)
            if node.col_offset == 0:
                top.update(mods)
            else:
                lazy.extend(mods)
    return top - {name}, lazy


def _exists(module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def _graph():
    files = [p for p in PACKAGE.rglob("*.py")]
    return {_module_name(p): _imports(p) for p in files}


def test_no_import_cycle():
    graph = {m: top for m, (top, _) in _graph().items()}
    # A package's __init__ re-exports its modules; an edge into a package is an edge into its
    # __init__, which imports the package's modules: walk those too.
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if n == m or n not in graph:
                continue
            if state.get(n) == 1 and not (m.startswith(n + ".") and n == "dyndepth"):
                cycle = stack[stack.index(n) :] + [n] if n in stack else [m, n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_lazy_imports_in_the_library():
    lazy = {m: found for m, (_, found) in _graph().items() if found}
    assert not lazy, f"imports inside functions: {lazy}"


def test_importing_the_library_pulls_in_no_application_code():
    code = (
        "import dyndepth, dyndepth.nn, sys; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tqdm', 'matplotlib') "
        "or m.startswith('dyndepth_app')]; print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_application_uses_the_public_library_only():
    """``dyndepth_app`` (the command: demos, evaluation, benchmarks) is a client of the
    library: it imports ``dyndepth`` and ``dyndepth.nn``, no private module of them."""
    app = PACKAGE.parent / "dyndepth_app"
    private = []
    for path in sorted(app.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "dyndepth" and any(p.startswith("_") for p in parts[1:]):
                    private.append(f"{path.name}: {name}")
    assert app.is_dir() and not private, private
