"""Packaging: the packages under each folder of pyproject.toml's [tool.setuptools.package-dir].

setuptools reads that mapping itself (shared/ installs as kvserve.shared, ...); what it cannot
express is "every package below each folder, under the mapped name", so this lists them.
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _packages() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = pyproject["tool"]["setuptools"]["package-dir"]
    packages = []
    for name, folder in package_dirs.items():
        packages += [name, *(f"{name}.{sub}" for sub in find_packages(ROOT / folder))]
    return packages


setup(packages=_packages())
