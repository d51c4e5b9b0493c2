"""The package's import graph has no cycle: every import of every module under python/nanograph counts, at the top,
in functions and under `if TYPE_CHECKING:`, as an edge to the module it names and to the packages above that one
(their __init__ runs first). A module's own parent packages are left out of the latter: Python has imported them
before the module runs; importing a name from one (`from .. import name`) is still an edge, as it reads that
package. A name that neither a module file nor the package's __init__ provides is a compiled module (nanograph._C)."""
import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "python" / "nanograph"


def module_files(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module under root (a package by its __init__.py)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def parents(name: str) -> list[str]:
    """The packages above name, outermost first: a.b.c -> [a, a.b]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def bound_names(path: Path) -> set[str]:
    """The names a module's source binds anywhere (definitions, assignments, imports): a superset of its
    attributes."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).partition(".")[0])
    return names


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module name (at path) imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = set()  # the modules the import statements name, compiled ones included
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per dot past the first
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                is_package = base in modules and modules[base].name == "__init__.py"
                if submodule in modules or (is_package and alias.name not in bound_names(modules[base])):
                    named.add(submodule)
                else:  # a name the module base defines
                    named.add(base)
    edges = set()
    for target in named:
        if target in modules:
            edges.add(target)
        edges.update(p for p in parents(target) if p in modules and p not in parents(name))
    edges.discard(name)
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of graph as its modules in import order, the first repeated at the end; None if there is none."""
    state = {}  # module -> "open" while on the path, "done" once all it reaches is explored
    path = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def test_the_walker_sees_every_kind_of_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.b import B\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import a\n    import pkg.sub.c\n")
    (package / "sub" / "c.py").write_text("from .. import A, _compiled\n")
    modules = module_files(package)
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub", "pkg.sub.b"}, "pkg.sub": set(),
                     "pkg.sub.b": {"pkg.a", "pkg.sub.c"}, "pkg.sub.c": {"pkg"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "nanograph.engine.llm_engine" in graph and len(graph) > 20
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
