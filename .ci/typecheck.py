"""Run mypy over every shipped module, each under the name it installs as.

    python .ci/typecheck.py [MYPY_FLAGS...]     # exit code: 0 clean, 1 errors, 2 a blocker

The folders do not spell the import names (pyproject.toml's [tool.setuptools.package-dir]:
shared/config.py installs as kvserve.shared.config), and mypy's own file and package discovery
names modules after folders, so it would call that file `shared.config`, or not find
kvserve.shared at all. mypy's Python API takes each source as a (path, module name) pair
instead, and resolves imports among the given sources by module name. So this hands mypy
every module check_imports.py finds (the same mapping, the same rule for what ships).

mypy also searches its working directory for imports; from the repository root, a third-party
`import kernels` (transformers probes for Hugging Face's) would find kernels/ there. So mypy
runs in an empty folder, on absolute paths, and the errors print relative to the root again.

Settings come from pyproject.toml's [tool.mypy], per package from its [[tool.mypy.overrides]];
extra flags on the command line override them, as with mypy itself.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from check_imports import REPO_ROOT, find_modules, read_package_dirs
from mypy import build, util
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource


def sources(root: Path) -> list[BuildSource]:
    """Every module that ships from root, as (absolute path, installed module name)."""
    modules = find_modules(root, read_package_dirs(root))
    return [BuildSource(str(path), module) for module, path in sorted(modules.items())]


def run(root: Path, mypy_args: list[str]) -> int:
    """mypy over root's modules with root's pyproject.toml; prints as mypy does."""
    root = root.resolve()
    _, options = process_options(
        [
            *("--config-file", str(root / "pyproject.toml")),
            *("--cache-dir", str(root / ".mypy_cache")),
            *mypy_args,
        ],
        require_targets=False,
    )
    checked = sources(root)
    messages: list[str] = []

    def flush_errors(_file: str | None, new_messages: list[str], serious: bool) -> None:
        new_messages = [m.removeprefix(f"{root}{os.sep}") for m in new_messages]
        messages.extend(new_messages)
        stream = sys.stderr if serious else sys.stdout
        stream.writelines(message + "\n" for message in new_messages)

    blocked = False
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="kvserve-mypy-") as empty:
        os.chdir(empty)
        try:
            build.build(checked, options, flush_errors=flush_errors)
        except CompileError:
            blocked = True  # build.build flushed its messages before raising
        finally:
            os.chdir(cwd)
    # As mypy's own main(): notes alone pass; errors exit 1, a blocker 2.
    num_errors, num_notes, num_files = util.count_stats(messages)
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    color = options.color_output
    if num_errors or blocked:
        summary = formatter.format_error(
            num_errors, num_files, len(checked), blockers=blocked, use_color=color
        )
        print(summary)
        return 2 if blocked else 1
    print(formatter.format_success(len(checked), color))
    return 1 if len(messages) > num_notes else 0


def main(argv: list[str]) -> int:
    return run(REPO_ROOT, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
