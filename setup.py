"""The package list, read from the folders, so that a new subpackage needs no entry anywhere.

pyproject.toml holds everything else; its package-dir installs passes/ as amp_fx.passes and
kernels/ as amp_fx.kernels, which setuptools' own discovery does not follow. Every folder with an
``__init__.py`` under a mapped folder is a package, named under the package its root maps to.
"""

from setuptools import find_packages, setup
from setuptools.config.pyprojecttoml import read_configuration

PACKAGE_DIR = read_configuration("pyproject.toml", expand=False)["tool"]["setuptools"]["package-dir"]


def _subpackages(root: str, folder: str) -> list[str]:
    """The packages under `folder`, named under `root`; mapped roots inside it (amp_fx/passes,
    where a checkout links it) are their own roots."""
    mapped = [name.removeprefix(f"{root}.") for name in PACKAGE_DIR if name.startswith(f"{root}.")]
    exclude = [pattern for name in mapped for pattern in (name, f"{name}.*")]
    return [f"{root}.{package}" for package in find_packages(folder, exclude=exclude)]


setup(packages=[name for root, folder in PACKAGE_DIR.items() for name in (root, *_subpackages(root, folder))])
