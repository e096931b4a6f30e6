#!/usr/bin/env python3
"""The shape of the package, counted from its source with ``ast`` (nothing is imported or run).

Prints three counts for ``src/moe_offload`` (issue 38), or with ``--floors`` the imports that run up the floors of
the import-linter contract in ``pyproject.toml`` (issue 45; an independent count of what the contract checks):

- the top-level modules: ``.py`` files directly in the package, besides ``__init__.py`` and ``__main__.py``;
- the import circles: strongly connected components of two or more modules of the graph "module A imports module
  B", where every ``import`` / ``from ... import`` statement counts wherever it stands (at module level, inside a
  function or a class, under ``if TYPE_CHECKING:`` too); an import of ``pkg.mod`` counts as an arrow to
  ``pkg.mod`` (``from pkg import mod`` too, when ``mod`` is a module), and a package's ``__init__`` importing its
  own submodules is no arrow to itself;
- the functions (and methods, nested ones included) longer than ``LONG`` lines, from ``def`` to their last line.

    python scripts/house_check.py [--root src/moe_offload] [--floors]

``tests/test_house.py`` asserts the targets (``MAX_TOP_LEVEL``, no circle, at most ``MAX_LONG`` long functions).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "moe_offload"
LONG = 60  # a function of more lines than this is long
MAX_TOP_LEVEL = 6
MAX_LONG = 8


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name (``moe_offload.runtime.engine``; a package's
    ``__init__.py`` under the package's own name) -> its file."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def top_level_modules(root: Path) -> list[str]:
    """The ``.py`` files directly in ``root`` besides ``__init__.py`` and ``__main__.py``, by name."""
    return sorted(p.stem for p in root.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))


def _imports(tree: ast.AST):
    """The import statements of ``tree``, wherever they stand."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _targets(node: ast.Import | ast.ImportFrom, here: str, names: dict[str, Path]) -> tuple[list[str], list[str]]:
    """``(modules, submodules)`` an import statement names: ``import a.b`` -> ``(["a.b"], [])``; ``from pkg import
    x, mod`` -> ``(["pkg"], ["pkg.mod"])`` (the names that are modules of the package; ``here``: the importing
    module's package, for relative imports)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names], []
    if node.level:
        base = here.split(".")
        base = base[:len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    return [mod], [f"{mod}.{alias.name}" for alias in node.names if f"{mod}.{alias.name}" in names]


def _statements(names: dict[str, Path]):
    """``(module, import statement, the module's package)`` for every import statement of the package."""
    for name, path in names.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            yield name, node, here


def import_graph(names: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for what counts)."""
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, node, here in _statements(names):
        mods, subs = _targets(node, here, names)
        graph[name].update(t for t in mods + subs if t in names and t != name)
    return graph


def import_edges(names: dict[str, Path]) -> list[tuple[str, str, int]]:
    """``(module, imported module of the package, line)`` for every import statement, wherever it stands; ``from
    pkg import mod`` is an arrow to ``pkg.mod`` (and to ``pkg`` only when it also imports a name that is not a
    module)."""
    edges = []
    for name, node, here in _statements(names):
        mods, subs = _targets(node, here, names)
        wants = subs + (mods if isinstance(node, ast.Import) or len(subs) < len(node.names) else [])
        edges += [(name, t, node.lineno) for t in wants if t in names and t != name]
    return edges


def upward_imports(layers: list[str], root: Path = ROOT) -> list[tuple[str, str, int]]:
    """The imports that break the floors ``layers`` (top first, as ``pyproject.toml``'s import-linter contract
    writes them; ``"a | b"``: independent packages on one floor): ``(module, imported module, line)`` of every
    import from a floor to a floor above it or to another package of its own floor. Function-local imports count;
    modules outside every floor (the package's ``__init__``) are not checked."""
    floor = {p.strip(): i for i, entry in enumerate(layers) for p in entry.split("|")}

    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in floor else None

    found = []
    for name, target, line in import_edges(module_names(root)):
        a, b = package(name), package(target)
        if a is None or b is None or a == b:
            continue
        if floor[b] < floor[a] or floor[b] == floor[a]:
            found.append((name, target, line))
    return sorted(found)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` of two or more modules (the import circles), each sorted, by
    Tarjan's algorithm (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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


def long_functions(names: dict[str, Path], limit: int = LONG) -> list[tuple[str, int]]:
    """``(module:qualified name, lines)`` of every function or method longer than ``limit`` lines (``def`` to its
    last line, decorators not counted), longest first."""
    found = []
    for name, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qual = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        lines = child.end_lineno - child.lineno + 1
                        if lines > limit:
                            found.append((f"{name}:{qual}", lines))
                    stack.append((child, qual + "."))
                else:
                    stack.append((child, prefix))
    return sorted(found, key=lambda item: (-item[1], item[0]))


def counts(root: Path = ROOT) -> tuple[list[str], list[list[str]], list[tuple[str, int]]]:
    """The top-level modules, the import circles and the long functions of the package at ``root``."""
    names = module_names(root)
    return top_level_modules(root), circles(import_graph(names)), long_functions(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the package's folder (default: src/moe_offload)")
    parser.add_argument("--floors", action="store_true", help="instead: the imports that run up the floors of "
                        "pyproject.toml's import-linter contract (an independent count of what it checks)")
    args = parser.parse_args(argv)
    if args.floors:
        import tomllib

        with open(args.root.parent.parent / "pyproject.toml", "rb") as f:
            contract = next(c for c in tomllib.load(f)["tool"]["importlinter"]["contracts"] if c["id"] == "floors")
        names = module_names(args.root)
        edges = import_edges(names)
        crossing = sum(1 for a, b, _ in edges if a.split(".")[1:2] != b.split(".")[1:2])
        up = upward_imports(contract["layers"], args.root)
        print(f"{len(edges)} imports between modules, {crossing} of them between packages; {len(up)} run up a floor")
        for a, b, line in up:
            print(f"  {a}:{line} -> {b}")
        return 1 if up else 0
    top, found, long = counts(args.root)
    print(f"top-level modules: {len(top)} (target <= {MAX_TOP_LEVEL}): {', '.join(top)}")
    print(f"import circles: {len(found)} (target 0)")
    for members in found:
        print(f"  {len(members)}: {', '.join(members)}")
    print(f"functions over {LONG} lines: {len(long)} (target <= {MAX_LONG})")
    for qual, lines in long:
        print(f"  {lines:4d}  {qual}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
