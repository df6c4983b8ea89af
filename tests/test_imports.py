"""The import graph: the product never imports the suite, and no module imports itself back.

Every import counts, a function's lazy one too: a cycle or an edge that only runs on some path is
still a dependency. The product is exactness minus exactness.suite; exactness.__main__ (the
command line, which dispatches to both) and proofs/ are the suite's side.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = ("exactness.suite", "proofs", "exactness.__main__")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (a `from package import name` of a module counts as
    that module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    files = [*ROOT.glob("exactness/**/*.py"), *ROOT.glob("proofs/*.py")]
    modules = {module_name(f) for f in files}
    return {module_name(f): imports(f, modules) for f in files}


def is_suite(module: str) -> bool:
    return any(module == s or module.startswith(s + ".") for s in SUITE)


def test_the_product_never_imports_the_suite():
    edges = [(a, b) for a, targets in graph().items() if not is_suite(a)
             for b in targets if is_suite(b)]
    assert not edges, f"product -> suite imports: {edges}"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's own __init__ importing its submodules is not a cycle: drop edges from a
    package to its children, and from children to their package (whose names they reach)."""
    return {a: {b for b in targets if not b.startswith(a + ".") and not a.startswith(b + ".")}
            for a, targets in edges.items()}


def test_no_import_cycles():
    assert cycles(package_edges(graph())) == []


def test_the_checks_can_fail():
    """A planted edge from the product into the suite, and a planted cycle, are both seen."""
    planted = {**graph()}
    planted["exactness.modules"] = planted["exactness.modules"] | {"exactness.suite.reference"}
    assert any(not is_suite(a) and is_suite(b) for a, t in planted.items() for b in t)
    planted["exactness.formats"] = planted["exactness.formats"] | {"exactness.modules"}
    assert cycles(package_edges(planted))
