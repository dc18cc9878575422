"""The wheel's build step: every module of the packages except the test modules (pyproject.toml,
`[tool.setuptools.cmdclass]`).

parity_tests/ holds the parity suite's library (what `anchor parity`, `anchor audit`, `anchor.check_step` and the
pytest plugin import) beside its own tests (`test_*.py`, `conftest.py`), which pytest runs from the checkout.
setuptools takes every `*.py` of a package into the wheel, and neither `exclude-package-data` nor MANIFEST.in
applies to modules, so this build step leaves the test modules out; the source distribution follows it.
tests/test_wheel_contents.py builds the wheel and holds it to that.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from setuptools.command.build_py import build_py

TEST_MODULES = ("test_*.py", "conftest.py")  # pytest's own names for test files and their shared set-up


def is_test_module(path: str) -> bool:
    """True for a file pytest collects as tests or set-up, by its name."""
    return any(fnmatch.fnmatch(Path(path).name, pattern) for pattern in TEST_MODULES)


class BuildPy(build_py):
    """setuptools' build_py without the test modules of any package."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        return [m for m in super().find_package_modules(package, package_dir) if not is_test_module(m[2])]
