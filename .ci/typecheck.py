"""Run mypy on the packages pyproject.toml's [tool.mypy] lists.

mypy resolves imports from folders, not through setup.py's package_dir, so it cannot find
kvserve.shared in shared/. This lays the installed package tree out as symbolic links in a
temporary folder (kvserve/ -> the facade's files, kvserve/shared -> shared/, ...) and runs
mypy there, then prints the errors with the repository's own paths.

    python .ci/typecheck.py            # exit code: mypy's
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {
    "kvserve.shared": "shared",
    "kvserve.services": "services",
    "kvserve.kernels": "kernels",
}  # as setup.py maps them


def _link_tree(dest: Path) -> None:
    package = dest / "kvserve"
    package.mkdir()
    for entry in (ROOT / "kvserve").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_DIRS.items():
        (dest / name.replace(".", "/")).symlink_to(ROOT / folder)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvserve-mypy-") as tmp:
        tree = Path(tmp)
        _link_tree(tree)
        os.chdir(tree)
        stdout, stderr, status = api.run(
            [
                "--config-file",
                str(ROOT / "pyproject.toml"),
                "--cache-dir",
                str(ROOT / ".mypy_cache"),
            ]
        )
    for name, folder in PACKAGE_DIRS.items():
        stdout = stdout.replace(name.replace(".", "/") + "/", folder + "/")
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
