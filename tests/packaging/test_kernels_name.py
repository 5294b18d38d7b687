"""From a checkout's root, the folder `kernels/` must not stand in for PyPI's `kernels`.

transformers >= 5.25 depends on Hugging Face's `kernels` and imports it. A process whose
`sys.path` holds the checkout's root (`python -m ...`, pytest) finds the folder `kernels/` (the
package `kvserve.kernels`) first under that name; the folder hands the name to the installed
package, and when none is installed it is an empty namespace package, which a probe for the
package (transformers' own) finds absent.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
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


def test_without_an_installed_package_a_probe_finds_it_absent() -> None:
    result = run_in_checkout(
        f"import sys\nsys.path[:] = [{str(REPO_ROOT)!r}]\n"
        "import kernels\n"
        "print(getattr(kernels, '__file__', None), kernels.__spec__.submodule_search_locations)\n"
        "try:\n    from kernels import get_kernel\nexcept ImportError:\n    print('no names')\n"
        "try:\n    import kernels.layer\nexcept ImportError:\n    print('no submodules')\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["None []", "no names", "no submodules"]


def test_transformers_finds_no_kernels_package_from_the_checkout_root(tmp_path: Path) -> None:
    """vLLM-CPU started from a checkout failed here: transformers found `kernels` by its spec,
    imported it for a version, and got an ImportError."""
    # The environment's site-packages, less the installed `kernels` (a dependency of
    # transformers here): one link per entry, the kernels package and its metadata left out.
    site = Path(sysconfig.get_paths()["purelib"])
    bare_site = tmp_path / "site"
    bare_site.mkdir()
    for entry in site.iterdir():
        if entry.name != "kernels" and not entry.name.startswith("kernels-"):
            (bare_site / entry.name).symlink_to(entry)
    result = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            f"import site\nsite.addsitedir({str(bare_site)!r})\n"
            "from transformers.utils.import_utils import is_kernels_available\n"
            "print(is_kernels_available())\n"
            "import kernels, kvserve.kernels\n"
            "print(kernels is kvserve.kernels, kvserve.kernels.linear.__name__)\n",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False", "False linear"]
