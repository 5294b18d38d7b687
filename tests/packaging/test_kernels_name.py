"""From a checkout's root, the folder `kernels/` must not stand in for PyPI's `kernels`.

transformers >= 5.25 depends on Hugging Face's `kernels` and imports it. A process whose
`sys.path` holds the checkout's root (`python -m ...`, pytest) finds the folder `kernels/` (the
package `kvserve.kernels`) first under that name; the folder hands the name to the installed
package, and says what it is when none is installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO_ROOT


def run_in_checkout(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_installed_kernels_package_wins_over_the_checkout_folder(tmp_path: Path) -> None:
    installed = tmp_path / "site" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("WHO = 'the installed package'\n")
    result = run_in_checkout(
        "import sys\n"
        f"sys.path.insert(1, {str(tmp_path / 'site')!r})\n"
        "import kernels\n"
        "print(kernels.WHO)\n"
        "from kernels import WHO\n"
        "import kvserve.kernels\n"
        "print(kvserve.kernels.linear.__name__)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["the", "installed", "package", "linear"]


def test_without_an_installed_package_the_import_fails_naming_the_folder() -> None:
    result = run_in_checkout(
        f"import sys\nsys.path[:] = [{str(REPO_ROOT)!r}]\n"
        "try:\n    import kernels\nexcept ImportError as e:\n    print('ImportError:', e)\n"
        "print('kernels' in sys.modules)\n"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"ImportError: no package 'kernels' is installed; {REPO_ROOT}/kernels is kvserve.kernels"
    )
    assert lines[1] == "False"
