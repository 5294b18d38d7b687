"""Packaging: the repository's top-level folders install under the `kvserve.` namespace.

The layout keeps shared/, services/ and kernels/ at the top of the repository, but generic
top-level import names would collide with other packages (Hugging Face's `kernels`, for one),
so each folder is mapped under `kvserve.`: services/api/ is imported as kvserve.services.api.
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {
    "kvserve": "kvserve",
    "kvserve.shared": "shared",
    "kvserve.services": "services",
    "kvserve.kernels": "kernels",
}


def _packages() -> list[str]:
    packages = []
    for name, folder in PACKAGE_DIRS.items():
        packages.append(name)
        packages += [
            f"{name}.{sub}"
            for sub in find_packages(folder)
            if not sub.startswith(("shared", "services", "kernels"))
        ]
    return packages


setup(package_dir=PACKAGE_DIRS, packages=_packages())
