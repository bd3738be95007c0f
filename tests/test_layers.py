"""Mesh's layers point only down: no module imports from a layer above its own.

The layer order is written once, here (LAYERS, bottom first; docs/design.md draws it). A
module belongs to the layer of the longest prefix that names it; a module no prefix names
fails the test, so a new package is placed on purpose. Every import counts: at the top of
a file, inside a function, under `if TYPE_CHECKING:`. Modules of one layer may import each
other (the base's few modules; the command line and the benchmarks it runs), but not in a
cycle within a package. The control service and the node agent share their vocabulary
through the layers below both, never each other's modules (APART).

Every file is parsed once per session (`scanned`), with the collector paused around the lot
and never run by hand: the layer tests cost the same wherever the suite's heap stands.
"""
from __future__ import annotations

import ast
import functools
import gc
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mesh", "workloads")

# Bottom first. A module may import from its own layer and the layers below it. Packages
# follow processes: mesh.node runs in a node agent, mesh.control in the control service,
# mesh.wire is what crosses between them (docs/design.md, "The map").
LAYERS: list[tuple[str, ...]] = [
    ("mesh", "mesh.paths", "mesh.framing", "mesh.hardware", "mesh.background", "mesh.lifetime", "mesh.tasks",
     "mesh.native_heap", "workloads"),  # base: no Mesh imports
    ("mesh.policy",),  # the pure policy core: batching vocabulary, scheduling and placement rules
    ("mesh.perf",),  # profiles, performance models, every iteration-time model
    ("mesh.modelfiles",),  # model files and their formats: GGUF metadata, shapes, sources, converters
    ("mesh.engines",),  # the engine protocol (engine_api), the engines and their worker processes
    ("mesh.wire",),  # what crosses between the control service and a node agent: typed messages
    ("mesh.weights",),  # weights by network: blocks, frames, the node's transport and receiver
    ("mesh.node",),  # the node agent process: token-level loop, agent server, tokenizers, builds ahead
    ("mesh.control",),  # the control service's decisions: fleet, dispatcher, schedulers, agent clients
    ("mesh.replay",),  # virtual-time replays and the simulator they assemble (local nodes, virtual loop)
    ("mesh.calibration",),  # calibration runs (above the engines they measure)
    ("mesh.ray",),  # Mesh on a Ray cluster
    ("mesh.service",),  # the HTTP control service
    ("mesh.bench", "mesh.commands", "mesh.cli", "mesh.__main__", "mesh.agent"),  # benchmarks and the command line
]


# Names that place only themselves, not the modules under them: `mesh` is the package's
# `__init__`, so a new `mesh.x` package is unplaced until LAYERS names it.
EXACT = {"mesh"}


def layer_of(module: str) -> int | None:
    best, found = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            covers = module == prefix or (prefix not in EXACT and module.startswith(prefix + "."))
            if covers and len(prefix) > best:
                best, found = len(prefix), index
    return found


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of PACKAGES by name, and its file (read once per session)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def parse(path: Path) -> ast.Module:
    """The file's syntax tree. Call it with the collector paused (`scanned` does): on CPython
    3.11 a finalizer that runs while the tree is built (an earlier test's closed event loop's
    transports) raises "SystemError: AST constructor recursion depth mismatch", seen here on
    3.11.7."""
    return ast.parse(path.read_text(), filename=str(path))


def imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The modules one import statement in `package` names, and the submodules it names
    (`from mesh.replay import driver`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names
                       if (ROOT / Path(*target.split("."), alias.name)).with_suffix(".py").exists()
                       or (ROOT / Path(*target.split("."), alias.name, "__init__.py")).exists()]


@dataclass(frozen=True)
class Scanned:
    """What the layer tests read of one module: its file, its imports of PACKAGES (line,
    module) and its classes' and functions' sizes (line, "class" or "function", name, lines)."""

    path: Path
    imports: list[tuple[int, str]]
    sizes: list[tuple[int, str, str, int]]


def scan(module: str, path: Path) -> Scanned:
    """One walk over the file's tree (call it with the collector paused: parse)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    imports, sizes = [], []
    for node in ast.walk(parse(path)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports += [(node.lineno, name) for name in imported(node, package) if name.split(".")[0] in PACKAGES]
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            sizes.append((node.lineno, kind, node.name, (node.end_lineno or node.lineno) - node.lineno + 1))
    return Scanned(path, imports, sizes)


@functools.cache
def scanned() -> dict[str, Scanned]:
    """Every module, parsed once, with the collector paused around all of them (parse). No
    collection first: a full collection per file, on the heap a long suite has built by then,
    was what made the layer tests take a minute each."""
    gc.disable()
    try:
        return {module: scan(module, path) for module, path in modules().items()}
    finally:
        gc.enable()


def upward_imports() -> list[str]:
    found = []
    for module, scan in scanned().items():
        own = layer_of(module)
        for line, target in scan.imports:
            theirs = layer_of(target)
            if theirs is not None and own is not None and theirs > own:
                found.append(f"{scan.path.relative_to(ROOT)}:{line}: {module} (layer {own}, {LAYERS[own][0]}) imports "
                             f"{target} (layer {theirs}, {LAYERS[theirs][0]}), a layer above its own")
    return found


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# Layers below a module's own that it may still not import: the control service and the node
# agent are separate processes that share their vocabulary through the layers below both
# (mesh.policy: nodes, planned instances, admission answers; mesh.wire: the request record),
# never each other's modules. (importer, imported) prefixes.
APART: list[tuple[str, str]] = [("mesh.control", "mesh.node"), ("mesh.service", "mesh.node")]


def imports_across_apart(scans: dict[str, Scanned]) -> list[str]:
    found = []
    for module, scan in scans.items():
        for line, target in scan.imports:
            for importer, imported in APART:
                if within(module, importer) and within(target, imported):
                    found.append(f"{scan.path.relative_to(ROOT)}:{line}: {module} imports {target}: "
                                 f"{importer} does not import {imported}")
    return found


def package_of(module: str) -> str:
    """The package a module sits in: its own name for a package's `__init__`."""
    return module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(start: str) -> None:
        # iterative, so a long chain of imports cannot reach the recursion limit
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
                    cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def package_graph() -> dict[str, set[str]]:
    """module -> the other modules of its own package it imports."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for module, scan in scanned().items():
        package = package_of(module)
        graph[module] = {target for _line, target in scan.imports
                         if target in known and target != module and package_of(target) == package}
    return graph


def test_every_module_has_a_layer():
    unplaced = [m for m in modules() if layer_of(m) is None]
    assert not unplaced, f"place these modules in tests/test_layers.py LAYERS: {unplaced}"


def test_no_module_imports_from_a_layer_above_its_own():
    found = upward_imports()
    assert not found, "imports that point up:\n" + "\n".join(found)


def test_the_control_service_and_the_node_agent_import_neither_the_other():
    found = imports_across_apart(scanned())
    assert not found, "imports across processes (share the noun through a layer below both):\n" + "\n".join(found)


def test_no_package_s_modules_import_each_other_in_a_cycle():
    cycles = import_cycles(package_graph())
    assert not cycles, "modules of one package that import each other in a cycle:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_a_cycle_is_found_and_a_chain_is_not():
    """The cycle finder on small graphs: a two-module cycle, a three-module one beside a
    chain into it, and a chain alone."""
    assert import_cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": {"b"}, "e": {"a"}}) == [["b", "c", "d"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_apart_finds_an_import_of_the_other_process_only():
    """A control module importing a node module is found (by its line); one importing the
    policy, or a node module importing its own package, is not."""
    scans = {
        "mesh.control.x": Scanned(ROOT / "mesh/control/x.py",
                                  [(3, "mesh.node.runtime"), (4, "mesh.policy.node_spec")], []),
        "mesh.node.y": Scanned(ROOT / "mesh/node/y.py", [(5, "mesh.node.runtime")], []),
        "mesh.nodes.z": Scanned(ROOT / "mesh/nodes/z.py", [(6, "mesh.nodes.w")], []),
    }
    found = imports_across_apart(scans)
    assert len(found) == 1 and found[0].startswith("mesh/control/x.py:3: mesh.control.x imports mesh.node.runtime")


@pytest.mark.parametrize("module,layer", [
    ("mesh.policy.batching", "mesh.policy"), ("mesh.perf.times", "mesh.perf"), ("mesh.modelfiles.demo",
                                                                                "mesh.modelfiles"),
    ("mesh.engines.simulated", "mesh.engines"), ("mesh.control.fleet", "mesh.control"), ("mesh.replay.simulator",
                                                                                                "mesh.replay"),
    ("mesh.calibration.runner", "mesh.calibration"), ("mesh.node.runtime", "mesh.node"), ("mesh.framing", "mesh"),
    ("mesh.commands.replay", "mesh.bench"), ("mesh.agent", "mesh.bench"),
])
def test_the_longest_prefix_places_a_module(module, layer):
    assert LAYERS[layer_of(module)][0] == layer


@pytest.mark.parametrize("module", ["mesh.newpackage", "mesh.newpackage.part", "engines", "meshy"])
def test_a_package_no_layer_names_is_unplaced(module):
    """The base layer's `mesh` places the package's `__init__` only: a new `mesh.x` fails
    `test_every_module_has_a_layer` until it is placed on purpose."""
    assert layer_of(module) is None


# The vocabulary both sides speak, and its one home: imported from anywhere else, through a
# module that merely imports it too, a noun would have two homes again.
SHARED_NOUNS = {
    "NodeSpec": "mesh.policy.node_spec", "InstancePlan": "mesh.policy.admission", "Admission": "mesh.policy.admission",
    "ServedRequest": "mesh.wire.served_request", "Outcome": "mesh.wire.served_request",
}
FROM_IMPORT = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+(\([^)]*\)|[^\n]*)", re.MULTILINE)


def imports_of_a_noun_away_from_its_home(files: dict[str, str]) -> list[str]:
    """`file: noun from module, not its home` for each such import in `files` (name -> text)."""
    found = []
    for name, text in files.items():
        for match in FROM_IMPORT.finditer(text):
            names = {part.split(" as ")[0].strip() for part in match.group(2).split("#")[0].strip("()").split(",")}
            for noun in sorted(names & set(SHARED_NOUNS)):
                if match.group(1) != SHARED_NOUNS[noun]:
                    found.append(f"{name}: {noun} from {match.group(1)}, not {SHARED_NOUNS[noun]}")
    return found


def test_the_shared_nouns_are_imported_from_their_home_only():
    paths = [*modules().values(), *sorted((ROOT / "tests").glob("*.py"))]
    found = imports_of_a_noun_away_from_its_home({str(p.relative_to(ROOT)): p.read_text() for p in paths})
    assert not found, "\n".join(found)


def test_an_import_of_a_noun_from_elsewhere_is_found():
    text = ("from mesh.node.runtime import (\n    NodeRuntime,\n    NodeSpec as Spec,\n)\n"
            "from mesh.policy.admission import Admission  # its home\n")
    assert imports_of_a_noun_away_from_its_home({"x.py": text}) == [
        "x.py: NodeSpec from mesh.node.runtime, not mesh.policy.node_spec"]


def test_no_two_modules_share_a_file_name():
    """One home per noun (issue 34 item 5): a file name says what a module holds, once."""
    seen: dict[str, list[str]] = {}
    for module, path in modules().items():
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(module)
    shared = {name: found for name, found in seen.items() if len(found) > 1}
    assert not shared, f"modules that share a file name: {shared}"


MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 120


def test_no_product_class_or_function_does_everything():
    """Issue 34: a class that grows past 400 lines, or a function past 120, is split along
    its seams (the agent server's connection, instances and requests; the cluster control's
    membership, catalogue and request path)."""
    found = []
    for scan in scanned().values():
        for line, kind, name, lines in scan.sizes:
            if lines > (MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES):
                found.append(f"{scan.path.relative_to(ROOT)}:{line}: {kind} {name} has {lines} lines")
    assert not found, "\n".join(found)


def test_the_repository_root_is_where_the_workers_run():
    """Worker processes run `python -m mesh...` from the checkout (PYTHONPATH, cwd) and find
    `.venv-vllm` beside it: REPO_ROOT must be the checkout, wherever its module lives."""
    from mesh.engines.worker_process import REPO_ROOT

    assert REPO_ROOT == ROOT and (REPO_ROOT / "mesh" / "__init__.py").is_file()
