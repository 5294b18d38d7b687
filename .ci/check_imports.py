"""Check the import graph of the shipped code: no cycles, no old top-level names, layering.

    python .ci/check_imports.py [REPO_ROOT]

Every .py file under the folders of pyproject.toml's [tool.setuptools.package-dir] (in packages,
as setup.py ships them) becomes a module under the package its folder installs as: kvserve.*,
kvserve.shared.* (shared/), kvserve.services.* (services/), kvserve.kernels.* (kernels/).
Every `import` statement counts as an edge, wherever it sits: module level, inside functions,
in try/except, and under `if TYPE_CHECKING:`. TYPE_CHECKING imports never run, but they
still tie the modules together, so they count for cycles and layering like any other; the
report tags them "(TYPE_CHECKING)" so they are easy to tell apart.

An edge goes to the module named: `import a.b` and `from a.b import c` point at a.b (a
package's __init__), or at a.b.c when c is a submodule. The parent packages that Python
imports on the way (a, for a.b) are not edges, so a submodule importing its own package is a
cycle only when it names the package, as `from kvserve.benchmarks import x` does.

Fails (exit 1), listing each, on:
  1. an import cycle among kvserve modules (a strongly connected component of more than one
     module, or a module importing itself), printed as paths that together cover every edge
     of the component;
  2. an import of a top-level `shared`, `services` or `kernels` (the names before
     everything moved under kvserve.);
  3. a layering violation, see LAYERS;
  4. an import of a kvserve.* module that does not ship (an ImportError, and an edge the
     graph would otherwise miss).

Prints each failure, then a one-line summary.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections import deque
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def read_package_dirs(root: Path = REPO_ROOT) -> dict[str, str]:
    """Package -> the folder it installs from: pyproject.toml's [tool.setuptools.package-dir]."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    return pyproject["tool"]["setuptools"]["package-dir"]


PACKAGE_DIRS = read_package_dirs()
# The packages that install from a folder of another name (kvserve.shared from shared/, ...),
# and those folder names, which were top-level import names before the move under kvserve.
CORE_PACKAGES = tuple(name for name in PACKAGE_DIRS if name != "kvserve")
OLD_TOP_LEVEL_NAMES = tuple(PACKAGE_DIRS[name] for name in CORE_PACKAGES)

# (importing package, forbidden packages, why). A package covers its __init__ and everything
# below it; "kvserve facade" stands for kvserve.* outside CORE_PACKAGES (kvserve, llm, cli, ...).
FACADE = "kvserve facade"

# The api's subpackages (services/api/): the HTTP surfaces over the serving core, which drives
# the engine client; tenancy and observability are bookkeeping the others report to. Only
# EngineClient (engine_client.client) is the engine client's public face; only the parts of
# serving that turn engine outputs into text (outputs, output_processor, detokenizer,
# tokenizer, stop_strings) and its errors sit below the engine client.
API = "kvserve.services.api"
API_SUBPACKAGES = tuple(
    f"{API}.{name}"
    for name in ("surfaces", "serving", "parsers", "engine_client", "tenancy", "observability")
)
ENGINE_CLIENT_INTERNALS = tuple(
    f"{API}.engine_client.{name}"
    for name in (
        "connection",
        "liveness",
        "pool",
        "routing",
        "utility",
        "migration",
        "pd_flow",
        "mp_client",
        "dp_router",
    )
)
SERVING_FRONT_END = tuple(
    f"{API}.serving.{name}"
    for name in (
        "base",
        "models",
        "protocol",
        "validation",
        "request_constraints",
        "limits",
        "multimodal",
        "generation_config",
    )
)
API_LAYERS = [
    (
        f"{API}.surfaces",
        ENGINE_CLIENT_INTERNALS,
        "a surface reaches the engines through EngineClient only",
    ),
    (
        f"{API}.serving",
        (f"{API}.surfaces", *ENGINE_CLIENT_INTERNALS),
        "the serving core sits below every surface, over EngineClient",
    ),
    (
        f"{API}.parsers",
        (f"{API}.surfaces", f"{API}.engine_client", f"{API}.tenancy", f"{API}.observability"),
        "a parser reads model text into OpenAI's shapes, nothing more",
    ),
    (
        f"{API}.engine_client",
        (f"{API}.surfaces", f"{API}.parsers", *SERVING_FRONT_END),
        "the engine client takes engine requests and gives outputs: no HTTP, no request checks",
    ),
    (
        f"{API}.tenancy",
        (f"{API}.surfaces", f"{API}.parsers", f"{API}.engine_client"),
        "tenancy is bookkeeping that the serving core and the engine client consult",
    ),
    (
        f"{API}.observability",
        (f"{API}.surfaces", f"{API}.parsers", *ENGINE_CLIENT_INTERNALS),
        "observability reads the surfaces' outcomes and EngineClient, never their internals",
    ),
    *(
        (package, (f"{API}.server",), "build_app assembles the subpackages, none reaches up")
        for package in API_SUBPACKAGES
    ),
]
LAYERS = [
    ("kvserve.shared", ("kvserve.services", FACADE), "shared code sits below every service"),
    ("kvserve.kernels", ("kvserve.services", FACADE), "kernels sit below every service"),
    (
        "kvserve.services.api",
        ("kvserve.services.worker", "kvserve.kernels", "torch", "triton", "xgrammar"),
        "the API process never loads the model side (xgrammar imports torch)",
    ),
    ("kvserve.services.worker", ("kvserve.services.api",), "workers know nothing of the API"),
    (
        "kvserve.services.scheduler",
        ("kvserve.services.api",),
        "the engine core knows nothing of the API",
    ),
    (
        "kvserve.services.scheduler.core",
        (
            "kvserve.services.worker",
            "kvserve.services.scheduler.executors",
            "kvserve.services.scheduler.engine",
            "torch",
        ),
        "the scheduler plans steps from bookkeeping alone: no model, no process around it",
    ),
    (
        "kvserve.services.scheduler.structured_output",
        ("kvserve.services.scheduler.core", "kvserve.services.scheduler.engine"),
        "grammars are a service the engine core calls, beside the scheduler",
    ),
    ("kvserve.services", ("kvserve.training",), "draft training is offline code"),
    *API_LAYERS,
]
CLI_MODULE = "kvserve.cli"
CLI_IMPORTERS = ("kvserve.__main__",)


@dataclass(frozen=True)
class Import:
    """One import statement's edge.

    Args:
        source: the importing module.
        target: the module imported, absolute (internal or external).
        lineno: line of the statement in the source's file.
        type_checking: the statement sits under `if TYPE_CHECKING:`.
    """

    source: str
    target: str
    lineno: int
    type_checking: bool

    def where(self) -> str:
        tag = " (TYPE_CHECKING)" if self.type_checking else ""
        return f"{self.source}:{self.lineno}{tag}"


@dataclass
class Report:
    """The graph and everything wrong with it.

    Args:
        modules: module name -> file, for every shipped module.
        edges: (source, target) -> one import making that edge (a runtime one where there is
            one), kvserve targets only.
        cycles: each cycle as its imports in order, the last leading back to the first.
        old_names: imports of a top-level `shared`, `services` or `kernels`.
        layering: (import, rule broken) for each import that crosses a layer the wrong way.
        missing: imports of a kvserve.* module that does not ship (an ImportError waiting).
    """

    modules: dict[str, Path]
    edges: dict[tuple[str, str], Import]
    cycles: list[list[Import]]
    old_names: list[Import]
    layering: list[tuple[Import, str]]
    missing: list[Import]

    @property
    def ok(self) -> bool:
        return not (self.cycles or self.old_names or self.layering or self.missing)

    def summary(self) -> str:
        num_type_checking = sum(imp.type_checking for imp in self.edges.values())
        graph = (
            f"import graph: {len(self.modules)} modules, {len(self.edges)} edges "
            f"({num_type_checking} under TYPE_CHECKING only)"
        )
        if self.ok:
            return f"{graph}, no cycles"
        return (
            f"{graph}: cycles {len(self.cycles)}, old-name imports {len(self.old_names)}, "
            f"layering violations {len(self.layering)}, missing modules {len(self.missing)}"
        )

    def failures(self) -> list[str]:
        lines = [f"cycle: {format_cycle(cycle)}" for cycle in self.cycles]
        lines += [f"old name: {imp.where()} imports {imp.target}" for imp in self.old_names]
        lines += [
            f"layering: {imp.where()} imports {imp.target}: {rule}" for imp, rule in self.layering
        ]
        lines += [
            f"missing: {imp.where()} imports {imp.target}, which does not ship"
            for imp in self.missing
        ]
        return lines


def format_cycle(cycle: list[Import]) -> str:
    """`a:3 -> b:10 -> a`: each hop names the line of the import that makes it."""
    return " -> ".join([imp.where() for imp in cycle] + [cycle[0].source])


def find_modules(root: Path, package_dirs: dict[str, str] = PACKAGE_DIRS) -> dict[str, Path]:
    """Module name -> file for each .py file that ships (every folder on the way a package)."""
    modules = {}
    for package, folder in package_dirs.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            folders = [base.joinpath(*parts[:i]) for i in range(len(parts))]
            if all((f / "__init__.py").is_file() for f in folders):
                modules[".".join((package, *parts)).removesuffix(".__init__")] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST, type_checking: bool = False):
    """Yield (statement, under TYPE_CHECKING) for every import below node, at any depth."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, type_checking
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _import_nodes(child, True)
        for child in node.orelse:
            yield from _import_nodes(child, type_checking)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _import_nodes(child, type_checking)


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from X import ...` reads from, relative levels resolved."""
    if node.level == 0:
        return node.module
    # Level 1 is the module's own package (a package's __init__ is its own package).
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    assert base, f"{module}: relative import beyond the top-level package"
    return ".".join(base + ([node.module] if node.module else []))


def parse_imports(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import in one file, each target an absolute module name."""
    is_package = path.name == "__init__.py"
    imports = []
    for node, type_checking in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _resolve_from(module, is_package, node)
            # `from pkg import sub` imports the submodule; any other name comes from pkg.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        imports += [
            Import(module, target, node.lineno, type_checking) for target in dict.fromkeys(targets)
        ]
    return imports


def _in_package(name: str, package: str) -> bool:
    if package == FACADE:
        return _in_package(name, "kvserve") and not any(
            _in_package(name, core) for core in CORE_PACKAGES
        )
    return name == package or name.startswith(package + ".")


def layering_rule(imp: Import) -> str | None:
    """The layering rule an import breaks, or None."""
    for package, forbidden, why in LAYERS:
        if not _in_package(imp.source, package):
            continue
        for banned in forbidden:
            if _in_package(imp.target, banned):
                return f"{package} must not import {banned} ({why})"
    if imp.target == CLI_MODULE and imp.source not in CLI_IMPORTERS:
        return f"only {', '.join(CLI_IMPORTERS)} may import {CLI_MODULE}"
    return None


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of graph (node -> successors)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


def _shortest_path(graph: dict[str, list[str]], start: str, goal: str) -> list[str]:
    """Nodes from start to goal along the fewest edges; goal must be reachable."""
    previous = {start: start}
    queue = deque([start])
    while goal not in previous:
        node = queue.popleft()
        for succ in graph[node]:
            if succ not in previous:
                previous[succ] = node
                queue.append(succ)
    path = [goal]
    while path[-1] != start:
        path.append(previous[path[-1]])
    return path[::-1]


def find_cycles(edges: dict[tuple[str, str], Import]) -> list[list[Import]]:
    """Cycles that together cover every edge of each cyclic component.

    Each edge u -> v inside a component closes one shortest cycle u -> v -> ... -> u; an edge
    already on a printed cycle gets none of its own, so every edge to break shows up once.
    """
    graph = {node: [] for edge in edges for node in edge}
    for source, target in sorted(edges):
        graph[source].append(target)
    cycles = []
    for component in strongly_connected(graph):
        members = set(component)
        inner = [(s, t) for s in component for t in graph[s] if t in members]
        if len(component) == 1 and not inner:
            continue
        sub = {s: [t for t in graph[s] if t in members] for s in component}
        covered = set()
        for source, target in inner:
            if (source, target) in covered:
                continue
            path = [source, *_shortest_path(sub, target, source)]
            hops = list(pairwise(path))
            covered.update(hops)
            cycles.append([edges[hop] for hop in hops])
    return cycles


def check(root: Path, package_dirs: dict[str, str] = PACKAGE_DIRS) -> Report:
    """Parse every shipped module under root and check its imports."""
    modules = find_modules(root, package_dirs)
    imports = [imp for name, path in modules.items() for imp in parse_imports(name, path, modules)]
    edges = {}
    for imp in imports:
        if imp.target not in modules:
            continue
        known = edges.get((imp.source, imp.target))
        # One import per edge: the first runtime one, else the first TYPE_CHECKING one.
        if known is None or (known.type_checking and not imp.type_checking):
            edges[(imp.source, imp.target)] = imp
    return Report(
        modules=modules,
        edges=edges,
        cycles=find_cycles(edges),
        old_names=[imp for imp in imports if imp.target.split(".")[0] in OLD_TOP_LEVEL_NAMES],
        layering=[(imp, rule) for imp in imports if (rule := layering_rule(imp))],
        missing=[
            imp
            for imp in imports
            if _in_package(imp.target, "kvserve") and imp.target not in modules
        ],
    )


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else REPO_ROOT
    report = check(root)
    for line in report.failures():
        print(line)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
