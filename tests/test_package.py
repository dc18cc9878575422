"""`import anchor`, `python -m anchor` and the `anchor` command reach the application (docs/DESIGN.md
§Architecture): its functions resolve, and importing it loads neither JAX nor torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import anchor

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(anchor.API))
def test_each_name_of_the_api_resolves(name):
    assert callable(getattr(anchor, name)) and name in dir(anchor)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        anchor.nothing_here  # noqa: B018


def test_import_anchor_loads_no_framework():
    code = ("import sys, anchor, anchor_core; heavy = [m for m in ('jax', 'torch', 'transformers') if m in sys.modules];"
            " print(anchor.__version__ == anchor_core.__version__, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.split() == ["True", "[]"]


def test_python_m_anchor_is_the_command():
    out = subprocess.run([sys.executable, "-m", "anchor", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "Usage: anchor" in out.stdout and "train" in out.stdout
