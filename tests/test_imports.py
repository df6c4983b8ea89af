"""The import graph: the product never imports the suite, and no module imports itself back.

Every import counts, a function's lazy one too: a cycle or an edge that only runs on some path is
still a dependency. The product is exactness minus exactness.suite; exactness.__main__ (the
command line, which dispatches to both) and proofs/ are the suite's side.
"""

import ast
import inspect
import types
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


# the suite's rooms (issue 69): each imports another only through its face, its __init__.py
ROOMS = ("exactness.suite.gate", "exactness.suite.interpreter", "exactness.suite.mutants",
         "exactness.suite.peers")


def room_of(module: str) -> str | None:
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


def past_a_face(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a room's own modules from outside that room (the suite's top or another
    room): each should name the room's face."""
    return [(a, b) for a, targets in edges.items() for b in targets
            if room_of(b) not in (None, b, room_of(a))]


def test_the_suites_rooms_meet_only_through_their_faces():
    edges = graph()
    assert all(room in edges for room in ROOMS)  # each room is a package with a face
    assert past_a_face(edges) == []


def test_the_checks_can_fail():
    """A planted edge from the product into the suite, a planted cycle, and a planted reach
    past a room's face are all seen."""
    planted = {**graph()}
    planted["exactness.modules"] = planted["exactness.modules"] | {"exactness.suite.reference"}
    assert any(not is_suite(a) and is_suite(b) for a, t in planted.items() for b in t)
    planted["exactness.formats"] = planted["exactness.formats"] | {"exactness.modules"}
    assert cycles(package_edges(planted))
    planted["exactness.suite.gate.verify"] = planted["exactness.suite.gate.verify"] | {
        "exactness.suite.mutants.run", "exactness.suite.gate.ci", "exactness.suite.mutants"}
    assert past_a_face(planted) == [("exactness.suite.gate.verify", "exactness.suite.mutants.run")]


# torch's own members the layers use: an int8 GEMM, a tensor's version counter, nn.Module's hooks
TORCH_PRIVATE = {"_int_mm", "_version", "_load_from_state_dict", "_apply"}
# the standard library's documented names with a leading _: os._exit, how a forked child ends
DOCUMENTED = {"_exit"}


def reaches(source: str) -> list[str]:
    """Where `source` reaches into another object's `_` names: an attribute of anything but
    self and cls (torch's TORCH_PRIVATE aside), or a `_` name imported from a project module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and node.attr not in TORCH_PRIVATE | DOCUMENTED \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                "exactness")):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_the_product_touches_no_private_name_of_another_module():
    """moe, kimi and hf use the layer's public kernel inputs (expected_buffers, checked_input,
    family, weights, no_backward), and the kernels each other's public names: a move or a
    rename inside one file cannot break another silently."""
    found = {str(f.relative_to(ROOT)): reaches(f.read_text())
             for f in ROOT.glob("exactness/**/*.py") if not is_suite(module_name(f))}
    assert not {f: r for f, r in found.items() if r}


def test_a_private_reach_is_seen():
    assert reaches("layer._expected()") == ["line 1: layer._expected"]
    assert reaches("from .modules import _NoBackward") == ["line 1: import _NoBackward"]
    assert reaches("vnni_library._missing_features()") and not reaches("self._plans.clear()")
    assert not reaches("torch._int_mm(a, b)") and not reaches("os._exit(0)")


# kernels/ is one wing per backend (cpu/, triton/), each file one job: a newcomer reads any of
# them whole (issue 43: native.py had grown to 797 lines and six jobs)
KERNEL_FILE_LINES = 300


def too_long(files, limit: int = KERNEL_FILE_LINES) -> dict[str, int]:
    """The files of more than `limit` lines, with their counts."""
    counts = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in files}
    return {f: n for f, n in counts.items() if n > limit}


def test_every_kernel_file_is_a_short_read():
    files = list(ROOT.glob("exactness/kernels/**/*.py"))
    assert len(files) > 20 and not too_long(files)


# and no file of the package over 400 lines (issue 53: kimi.py had grown to 933 lines and five
# jobs, mutants.py to 950, the catalogue's data and its runner in one file)
PACKAGE_FILE_LINES = 400


def test_every_file_of_the_package_is_a_short_read():
    files = list(ROOT.glob("exactness/**/*.py"))
    assert len(files) > 60 and not too_long(files, PACKAGE_FILE_LINES)


def test_the_kimi_package_keeps_every_old_name():
    """exactness.kimi was one module; every name it bound is still importable from it (the
    package's __init__), the private ones tests and mutants name included."""
    from exactness import kimi

    for name in ("KimiConfig", "KimiModel", "KimiMoE", "KimiCheckpoint", "KimiCheckpointError",
                 "KimiConversionError", "ExactExperts", "convert_kimi_to_exact",
                 "expert_parallel", "parse_safetensors_header", "EXPECTED_WEIGHTS", "ROUTED",
                 "brief", "shown_key", "json_kind", "routed_reads", "is_fused_experts"):
        assert hasattr(kimi, name), name
    assert set(kimi.__all__) <= set(vars(kimi))


def test_a_long_kernel_file_is_seen():
    modules = ROOT / "exactness" / "modules.py"  # the layers: longer than a kernel file may be
    assert too_long([modules]) and not too_long([modules], limit=10_000)


def unlisted(module) -> list[str]:
    """The names a facade offers but leaves out of `__all__`, or lists without offering: every
    public name it binds, submodules aside (Hypothesis's strategies/__init__.py asserts the
    same of its own)."""
    public = {name for name, value in vars(module).items()
              if not name.startswith("_") and not inspect.ismodule(value)}
    return sorted(public ^ set(module.__all__))


def test_each_facade_lists_what_it_offers():
    import importlib

    import exactness
    import exactness.kernels

    assert unlisted(exactness) == [] and unlisted(exactness.kernels) == []
    for room in ROOMS:
        assert unlisted(importlib.import_module(room)) == [], room


def test_an_unlisted_name_is_seen():
    facade = types.ModuleType("facade")
    facade.__all__ = ["listed", "gone"]
    facade.listed = facade.offered = 1
    assert unlisted(facade) == ["gone", "offered"]
