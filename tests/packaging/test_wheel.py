"""The built wheel installs everything under `kvserve.` and nothing at the top level.

A fresh venv gets the kvserve wheel plus a stand-in for Hugging Face's `kernels` package
(which transformers probes for), both with --no-deps. kvserve's dependencies come from the
repository's venv through a .pth file, appended after the fresh venv's own site-packages so the
wheel's `kvserve` and the stand-in `kernels` are found first. Every probe runs with cwd in the
tmp dir, never the repository root, whose folders would shadow the installed packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

# Package -> the repository folder it installs from, as setuptools reads it.
PACKAGE_DIRS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
STAND_IN_MARKER = "hf-kernels-stand-in"

# Below transformers' minimum `kernels` version, so transformers treats the stand-in as absent
# and never imports Hugging Face's API names from it.
STAND_IN_VERSION = "0.0.1"

STAND_IN_PYPROJECT = f"""\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "kernels"
version = "{STAND_IN_VERSION}"

[tool.setuptools]
packages = ["kernels"]
"""

# Runs in the fresh venv and prints one JSON object of facts; the tests assert on them.
PROBE = textwrap.dedent("""\
    import importlib, json, pkgutil, sys

    facts = {}
    import kernels
    facts["kernels"] = {"file": kernels.__file__, "marker": getattr(kernels, "MARKER", None)}
    try:
        import kvserve.kernels
        facts["kvserve_kernels"] = {"file": kvserve.kernels.__file__, "error": None}
    except ImportError as e:
        facts["kvserve_kernels"] = {"file": None, "error": repr(e)}

    facts["top_level"] = {}
    for name in ("shared", "services"):
        try:
            module = importlib.import_module(name)
            facts["top_level"][name] = f"imported from {module.__file__}"
        except ModuleNotFoundError:
            facts["top_level"][name] = None

    import kvserve
    failures, names = {}, []
    def record_walk_error(name):
        failures[name] = repr(sys.exc_info()[1])
    for info in pkgutil.walk_packages(kvserve.__path__, "kvserve.", onerror=record_walk_error):
        if info.name.endswith(".__main__"):
            continue  # importing it would run the CLI
        names.append(info.name)
        try:
            importlib.import_module(info.name)
        except Exception as e:
            failures[info.name] = repr(e)
    facts["modules"] = {name: getattr(sys.modules.get(name), "__file__", None) for name in names}
    facts["import_failures"] = failures

    try:
        import transformers
        from transformers.integrations import hub_kernels  # probes for `kernels` on import
        from transformers.utils.import_utils import is_kernels_available
        facts["transformers"] = {"kernels_available": is_kernels_available(), "error": None}
    except Exception as e:
        facts["transformers"] = {"kernels_available": None, "error": repr(e)}
    print(json.dumps(facts))
""")


def _run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    # No PYTHONPATH or user site: only the fresh venv and its .pth decide what imports.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    out = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"{args} failed:\n{out.stdout}\n{out.stderr}"
    return out


def _copy_sources(dest: Path) -> Path:
    # Building in place would write build/ and *.egg-info into the repository.
    shutil.copytree(
        REPO_ROOT,
        dest,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "tests", "bench", "build", "dist", "*.egg-info", "__pycache__"
        ),
    )
    return dest


def _write_stand_in(dest: Path) -> Path:
    (dest / "kernels").mkdir(parents=True)
    (dest / "pyproject.toml").write_text(STAND_IN_PYPROJECT)
    (dest / "kernels" / "__init__.py").write_text(
        f'"""Stand-in for Hugging Face\'s `kernels`."""\n\n'
        f'MARKER = "{STAND_IN_MARKER}"\n__version__ = "{STAND_IN_VERSION}"\n'
    )
    return dest


def _make_venv(venv: Path, tmp: Path) -> Path:
    """A fresh venv that sees this venv's site-packages after its own."""
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = venv / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site_packages = _run([python, "-I", "-c", code], cwd=tmp).stdout.strip()
    # A .pth line is appended to sys.path after the site-packages folder that holds it.
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site_packages) / "zz_kvserve_deps.pth").write_text("\n".join(deps) + "\n")
    return python


def _source_module_names() -> set[str]:
    names = set()
    for package, folder in PACKAGE_DIRS.items():
        for path in (REPO_ROOT / folder).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT / folder).with_suffix("").parts
            names.add(".".join((package, *parts)).removesuffix(".__init__"))
    return names - {"kvserve", "kvserve.__main__"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build both wheels, install them in a fresh venv and probe it once."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "-w",
            dist,
            _copy_sources(tmp / "src"),
            _write_stand_in(tmp / "stand_in"),
        ],
        cwd=tmp,
    )
    python = _make_venv(tmp / "venv", tmp)
    # The stand-in goes in first, as when Hugging Face's `kernels` is already installed:
    # the kvserve wheel must not overwrite it.
    for pattern in ("kernels-*.whl", "kvserve-*.whl"):
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                python,
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                "--disable-pip-version-check",
                *dist.glob(pattern),
            ],
            cwd=tmp,
        )
    (tmp / "probe.py").write_text(PROBE)
    # -I: neither cwd nor the script's folder goes on sys.path.
    facts = json.loads(_run([python, "-I", tmp / "probe.py"], cwd=tmp).stdout)
    return {
        "tmp": tmp,
        "venv": tmp / "venv",
        "wheel": next(dist.glob("kvserve-*.whl")),
        "facts": facts,
    }


def test_wheel_ships_only_kvserve_and_the_c_sources(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"kvserve"}, top_level
    sources = {
        f"kvserve/kernels/csrc/{p.name}"
        for p in (REPO_ROOT / "kernels" / "csrc").iterdir()
        if p.suffix in (".c", ".h")
    }
    assert sources and sources <= set(names), sorted(sources - set(names))
    # The status page's HTML, script and style (services/api/observability/dashboard_static).
    static = {
        f"kvserve/services/api/observability/dashboard_static/{p.name}"
        for p in (REPO_ROOT / "services" / "api" / "observability" / "dashboard_static").iterdir()
    }
    assert static and static <= set(names), sorted(static - set(names))


def test_top_level_kernels_is_the_stand_in(installed):
    kernels = installed["facts"]["kernels"]
    assert kernels["marker"] == STAND_IN_MARKER, f"`import kernels` found {kernels['file']}"


def test_kvserve_kernels_comes_from_the_wheel(installed):
    kvserve_kernels = installed["facts"]["kvserve_kernels"]
    assert kvserve_kernels["error"] is None, kvserve_kernels["error"]
    assert Path(kvserve_kernels["file"]).is_relative_to(installed["venv"]), kvserve_kernels


def test_old_top_level_names_are_gone(installed):
    assert installed["facts"]["top_level"] == {"shared": None, "services": None}


def test_every_kvserve_module_imports_from_the_wheel(installed):
    facts = installed["facts"]
    assert not facts["import_failures"], facts["import_failures"]
    missing = _source_module_names() - set(facts["modules"])
    assert not missing, f"in the repository but not in the wheel: {sorted(missing)}"
    outside = {
        name: path
        for name, path in facts["modules"].items()
        if not Path(path).is_relative_to(installed["venv"])
    }
    assert not outside, outside


def test_transformers_kernels_probe_survives(installed):
    transformers = installed["facts"]["transformers"]
    assert transformers == {"kernels_available": False, "error": None}, transformers


def test_docker_build_copies_every_package_folder():
    # Docker reads no TOML: the Dockerfile's source stage names each folder, and .dockerignore
    # lets each into the build context. A folder added to the mapping must reach the image.
    dockerfile = (REPO_ROOT / "Dockerfile").read_text().splitlines()
    allowed = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    for folder in PACKAGE_DIRS.values():
        assert f"COPY {folder} /src/{folder}" in dockerfile, f"Dockerfile: COPY {folder}"
        assert f"!{folder}/" in allowed, f".dockerignore: !{folder}/"


def test_console_script_runs(installed):
    out = _run([installed["venv"] / "bin" / "kvserve", "--help"], cwd=installed["tmp"])
    assert out.stdout.startswith("usage: kvserve"), out.stdout
