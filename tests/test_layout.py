"""The layout of utils/: its import graph reads top to bottom (no module imports one that imports it back, even
inside a function), so a reader can take the modules in order."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path):
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports_of_utils(path, modules):
    """The utils modules `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("utils"):
            names = [f"utils.{a.name}" for a in node.names] if node.module == "utils" else [node.module]
            found.update(name for name in names if name in modules)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return found - {module_name(path)}


def a_cycle(graph):
    """One import cycle as a list of modules, or None."""
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            return on_path[on_path.index(module):] + [module]
        if module in done:
            return None
        on_path.append(module)
        for imported in sorted(graph[module]):
            if cycle := visit(imported):
                return cycle
        on_path.pop()
        done.add(module)
        return None

    return next((cycle for module in sorted(graph) if (cycle := visit(module))), None)


def test_the_import_graph_of_utils_has_no_cycle():
    paths = sorted((ROOT / "utils").rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): imports_of_utils(path, modules) for path in paths}
    assert graph["utils.fsdp"] >= {"utils.pytorch_reference"}  # the walk sees the imports
    cycle = a_cycle(graph)
    assert cycle is None, "utils modules import each other: " + " -> ".join(cycle)


def test_a_cycle_is_found():
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert a_cycle({"a": {"b"}, "b": set()}) is None
