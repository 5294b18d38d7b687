"""The mypy runner (.ci/typecheck.py) on a small synthetic repository."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

from tests.support import REPO_ROOT


def _load(name: str):
    # .ci is no package: load each script from its file, under the name the other imports.
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / ".ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


check_imports = _load("check_imports")
typecheck = _load("typecheck")

PYPROJECT = """\
[tool.setuptools.package-dir]
"kvserve" = "kvserve"
"kvserve.shared" = "shared"
"kvserve.kernels" = "kernels"

[tool.mypy]
python_version = "3.11"
ignore_missing_imports = true
"""

TREE = {
    "pyproject.toml": PYPROJECT,
    "kvserve/__init__.py": "",
    "kvserve/app.py": "from kvserve.shared.util import count\n\nname: str = count()\n",
    "shared/__init__.py": "",
    "shared/util.py": "def count() -> int:\n    return 1\n",
    # Named like the folder: mypy must not take kernels/ for a top-level `kernels`.
    "kernels/__init__.py": "",
    "kernels/norm.py": "import kernels\n",
}


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_sources_are_every_shipped_module_under_its_installed_name(tmp_path):
    root = _write_tree(tmp_path, TREE)
    sources = {source.module: Path(source.path) for source in typecheck.sources(root)}
    assert sources == {
        module: path.resolve() for module, path in check_imports.find_modules(root).items()
    }
    assert sources["kvserve.shared.util"] == (root / "shared" / "util.py").resolve()


def test_errors_resolve_installed_names_and_print_repository_paths(tmp_path, capsys):
    root = _write_tree(tmp_path, TREE)
    assert typecheck.run(root, ["--no-incremental"]) == 1
    out = capsys.readouterr().out.splitlines()
    # kvserve.shared.util resolved from shared/util.py, its return type checked in app.py;
    # and no "source file found twice" for kernels/: mypy ran away from the root.
    assert out == [
        'kvserve/app.py:3: error: Incompatible types in assignment (expression has type "int", '
        'variable has type "str")  [assignment]',
        "Found 1 error in 1 file (checked 6 source files)",
    ]
