"""The wheel ships the packages without their test modules: no `test_*.py` and no `conftest.py` of any package
(parity_tests/ holds fourteen of the first and one of the second), every other module of every package, the
package data, and the pytest plugin's entry point; the plugin imported from the wheel's files offers its
fixtures. The build step that leaves the test modules out is tools/wheel_build.py (pyproject.toml's
`[tool.setuptools.cmdclass]`).

The wheel is built offline as pip builds it from a checkout (`pip wheel --no-deps --no-build-isolation`), from a
copy of what the build reads, so that the build/ folder pip writes beside the sources stays out of the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("anchor_core", "anchor", "jaxref", "torchtrain", "parity_tests")  # pyproject's packages.find
BUILD_FILES = ("pyproject.toml", "README.md", "MANIFEST.in", "tools/wheel_build.py")


def is_test_module(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base == "conftest.py" or (base.startswith("test_") and base.endswith(".py"))


def package_modules() -> list[str]:
    """Every module setuptools finds in the checkout's packages: the .py files of folders that are packages
    (an __init__.py in each folder from the package's root down)."""
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            folders = path.relative_to(ROOT).parents
            if "__pycache__" in path.parts or not all((ROOT / f / "__init__.py").is_file()
                                                       for f in folders if str(f) != "."):
                continue
            found.append(path.relative_to(ROOT).as_posix())
    return sorted(found)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    for rel in BUILD_FILES:
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, work / rel)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, work / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(work / "dist"), str(work)], cwd=work, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (found,) = (work / "dist").glob("anchor_toolkit-*.whl")
    return found


def test_the_wheel_ships_no_test_modules(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    in_checkout = [m for m in package_modules() if is_test_module(m)]
    assert len(in_checkout) >= 15 and "parity_tests/conftest.py" in in_checkout  # what there is to leave out
    assert [n for n in names if is_test_module(n)] == []


def test_the_wheel_ships_every_other_module_and_the_package_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = [m for m in package_modules() if not is_test_module(m)]
    assert len(modules) > 150 and "anchor/pytest_plugin.py" in modules and "parity_tests/blackbox.py" in modules
    assert [m for m in modules if m not in names] == []
    assert "jaxref/kernels/attention_cpu.cc" in names
    assert "anchor_core/configs/train/tiny.yaml" in names and "anchor_core/configs/eval/harness_utils.py" in names
    assert not [n for n in names if n.startswith("tools/")]  # the build step builds; it is not shipped


def test_the_pytest_plugin_is_installed_and_offers_its_fixtures_from_the_wheel(wheel: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (entry_points,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        assert "[pytest11]\nanchor = anchor.pytest_plugin" in z.read(entry_points).decode()
        z.extractall(tmp_path / "site")
    # a user's test module asking for the three fixtures, no import and no conftest; pytest loads the plugin by
    # its entry point, from the wheel's files (first on the path: the checkout's editable install maps them too)
    (tmp_path / "test_user.py").write_text(
        "def test_fixtures(anchor_parity, anchor_audit, anchor_check_step):\n"
        "    import anchor.pytest_plugin\n"
        "    assert callable(anchor_parity) and callable(anchor_audit) and callable(anchor_check_step)\n"
        "    print('plugin from', anchor.pytest_plugin.__file__)\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_user.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"plugin from {tmp_path / 'site' / 'anchor' / 'pytest_plugin.py'}" in done.stdout
