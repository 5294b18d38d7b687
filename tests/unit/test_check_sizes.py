"""The size checker (.ci/check_sizes.py) on small synthetic trees, and on the repository."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.support import REPO_ROOT


def _load(name: str):
    # .ci is no package: load each script from its file, under the name the other imports.
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / ".ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_load("check_imports")
check_sizes = _load("check_sizes")

PYPROJECT = """\
[tool.setuptools.package-dir]
"kvserve" = "kvserve"
"kvserve.shared" = "shared"
"""


def _function(name: str, num_body_lines: int, docstring_lines: int = 0, indent: str = "") -> str:
    """A function of 1 + docstring_lines + num_body_lines lines."""
    lines = [f"{indent}def {name}():"]
    if docstring_lines:
        lines += [f'{indent}    """'] + [f"{indent}    doc"] * (docstring_lines - 2)
        lines += [f'{indent}    """']
    lines += [f"{indent}    x = {i}" for i in range(num_body_lines)]
    return "\n".join(lines) + "\n"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"pyproject.toml": PYPROJECT, **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_function_counts_from_def_to_end_less_its_docstring(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "kvserve/__init__.py": "",
            # 1 + 59 = 60 lines, and 20 more of docstring: at the limit.
            "kvserve/ok.py": _function("fits", 59, docstring_lines=20),
            # 1 + 60 = 61 lines: one over.
            "kvserve/long.py": "class Holder:\n" + _function("method", 60, indent="    "),
        },
    )
    found = check_sizes.find_too_long(root)
    assert [(item.name, item.num_lines, item.where) for item in found] == [
        ("kvserve.long:Holder.method", 61, "kvserve/long.py:2")
    ]


def test_a_module_over_650_lines_and_a_named_exception(tmp_path: Path, monkeypatch) -> None:
    root = _tree(
        tmp_path,
        {
            "shared/__init__.py": "",
            "shared/table.py": "ROWS = [\n" + "    1,\n" * 700 + "]\n",
            "shared/small.py": "X = 1\n",
        },
    )
    assert [item.name for item in check_sizes.find_too_long(root)] == ["kvserve.shared.table"]
    monkeypatch.setitem(check_sizes.EXCEPTIONS, "kvserve.shared.table", "a table")
    assert check_sizes.find_too_long(root) == []


def test_the_repository_is_within_the_limits() -> None:
    found = check_sizes.find_too_long(REPO_ROOT)
    assert found == [], "\n".join(map(str, found))
