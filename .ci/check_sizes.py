"""Check that the shipped code stays readable in pieces: no module over 650 lines, no function
over 60.

    python .ci/check_sizes.py [REPO_ROOT]     # exit code: 0 clean, 1 something too long

Every module that ships (check_imports.py's mapping: kvserve/, shared/, services/, kernels/)
is read. A module's size is its line count. A function's size runs from its `def` line (its
decorators excluded) to its last line, less its docstring: a docstring documents, it is not
logic to hold in one's head. Nested functions count inside their parent and again on their own.

Tables and generated data are the one exception, named in EXCEPTIONS with the reason, so the
list stays short and every entry is read in review.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from check_imports import REPO_ROOT, find_modules

MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 60

# "module" or "module:qualified.function" -> why it may be longer. Tables and generated data only.
EXCEPTIONS: dict[str, str] = {}


@dataclass(frozen=True)
class TooLong:
    """One module or function over its limit.

    Args:
        where: `path:line` relative to the repository root.
        name: the module, or `module:qualname` for a function.
        num_lines: its size as counted here.
        limit: the limit it breaks.
    """

    where: str
    name: str
    num_lines: int
    limit: int

    def __str__(self) -> str:
        return f"{self.where}: {self.name} has {self.num_lines} lines (limit {self.limit})"


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def function_sizes(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(qualified name, first line, size) of every function and method in a module."""
    sizes: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                span = (child.end_lineno or child.lineno) - child.lineno + 1
                sizes.append((name, child.lineno, span - _docstring_lines(child)))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return sizes


def find_too_long(root: Path = REPO_ROOT) -> list[TooLong]:
    """Every module and function over its limit, less the named exceptions."""
    found: list[TooLong] = []
    for module, path in sorted(find_modules(root).items()):
        source = path.read_text()
        rel = path.relative_to(root)
        num_lines = len(source.splitlines())
        if num_lines > MAX_MODULE_LINES and module not in EXCEPTIONS:
            found.append(TooLong(f"{rel}:1", module, num_lines, MAX_MODULE_LINES))
        for qualname, lineno, size in function_sizes(ast.parse(source, str(path))):
            name = f"{module}:{qualname}"
            if size > MAX_FUNCTION_LINES and name not in EXCEPTIONS:
                found.append(TooLong(f"{rel}:{lineno}", name, size, MAX_FUNCTION_LINES))
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else REPO_ROOT
    found = find_too_long(root)
    for item in found:
        print(item)
    print(
        f"check_sizes: {len(found)} over the limits "
        f"(modules {MAX_MODULE_LINES} lines, functions {MAX_FUNCTION_LINES})"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
