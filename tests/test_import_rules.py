"""The import rules of docs/DESIGN.md section 2, read from the source with `ast` (nothing is imported).

Every `import` and `from ... import` of a `spillway.*` module in the four packages counts, wherever it
stands (module level, inside a function, under `if TYPE_CHECKING:`): a function-local import still ties the
two files together. Two checks, each printing the offending edges:

* direction: a lower room never imports a higher one (the rooms below);
* cycles: no file reaches itself through the imports of others.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"layers": "spillway.layers", "models": "spillway.models", "recipes": "spillway.recipes",
                "data": "spillway.data"}

# Room -> what a module of that room may import of ours (besides its own room), as module-name prefixes.
# The first room whose prefix names the module applies (most specific first).
ROOMS: list[tuple[str, tuple[str, ...]]] = [
    ("spillway.layers", ()),
    ("spillway.data", ("spillway.layers.errors",)),
    ("spillway.models", ("spillway.layers",)),
    ("spillway.recipes.optim", ("spillway.layers",)),
    ("spillway.recipes.targets", ("spillway.layers.errors",)),
    ("spillway.recipes.config", ("spillway.layers", "spillway.models", "spillway.data", "spillway.recipes.optim",
                                 "spillway.recipes.targets", "spillway.recipes.blocks",
                                 "spillway.recipes.lora_targets")),
    ("spillway.recipes.train", ("spillway.layers", "spillway.models", "spillway.data", "spillway.recipes.optim",
                                "spillway.recipes.targets", "spillway.recipes.config",
                                "spillway.recipes.registry", "spillway.recipes.blocks",
                                "spillway.recipes.lora_targets",
                                "spillway.recipes.sampling", "spillway.recipes.train")),
    ("spillway.recipes", ("spillway.layers", "spillway.models", "spillway.data", "spillway.recipes")),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = [PACKAGE_DIRS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    found = {}
    for folder in PACKAGE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            found[module_name(path)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` (a module, or a module's attribute) stands for."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_edges(known: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the spillway modules it imports (an attribute imported from a package resolves to the
    submodule of that name when there is one, else to the package)."""
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}")
        resolved = {_resolve(t, known) for t in targets if t.startswith("spillway.")}
        edges[name] = {t for t in resolved if t and t != name}
    return edges


def _room(name: str) -> tuple[str, tuple[str, ...]]:
    for prefix, allowed in ROOMS:
        if name == prefix or name.startswith(prefix + "."):
            return prefix, allowed
    raise AssertionError(f"{name} is in no room")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for source, targets in sorted(edges.items()):
        room, allowed = _room(source)
        for target in sorted(targets):
            if not _within(target, (room, *allowed)):
                bad.append(f"{source} -> {target}  (room {room} may import only {', '.join(allowed) or 'itself'})")
    return bad


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(components)


def _cycle_edges(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    members = set(component)
    return [f"{a} -> {b}" for a in component for b in sorted(edges[a] & members)]


def test_the_parser_sees_the_packages():
    """Guards the two checks below against passing because they read nothing."""
    known = source_modules()
    edges = import_edges(known)
    assert {"spillway.layers.block", "spillway.models.registry", "spillway.recipes.cli",
            "spillway.data.tokenizer"} <= set(known)
    assert "spillway.layers.errors" in edges["spillway.data.sources"]
    assert "spillway.layers.block" in edges["spillway.layers.stack"]


def test_no_room_imports_a_higher_one():
    bad = upward_imports(import_edges(source_modules()))
    print(f"{len(bad)} upward imports:", *bad, sep="\n  ")
    assert not bad, f"{len(bad)} upward imports:\n  " + "\n  ".join(bad)


def test_no_import_cycle_between_files():
    edges = import_edges(source_modules())
    cycles = import_cycles(edges)
    lines = [f"{' <-> '.join(c)}: " + "; ".join(_cycle_edges(c, edges)) for c in cycles]
    print(f"{len(cycles)} import cycles:", *lines, sep="\n  ")
    assert not cycles, f"{len(cycles)} import cycles:\n  " + "\n  ".join(lines)


def test_test_file_names_are_unique_across_folders():
    """pytest imports test files by basename (tests/ has no __init__.py): two test_x.py in different folders
    make the whole run stop at collection ("import file mismatch"), which a run of one folder never shows."""
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
