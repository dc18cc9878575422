"""The root conftest's limits on what a long-lived xdist worker keeps (conftest.py): a module's own caches and
JAX's programs are dropped when the module ends, and JAX's programs after any test that leaves the process past
half its memory-map limit. Checked in a pytest run of its own that loads the root conftest as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_FIRST = '''
import functools
import jax
import jax.numpy as jnp

@jax.jit
def scaled(x):
    return x * 3

@functools.cache
def table(n):
    return list(range(n))

def test_fill():
    for n in range(1, 6):
        scaled(jnp.ones(n))
        table(n)
    assert scaled._cache_size() == 5 and table.cache_info().currsize == 5

def test_kept_within_the_module():
    assert scaled._cache_size() == 5 and table.cache_info().currsize == 5
'''

_SECOND = '''
import test_a_first as first

def test_the_first_modules_caches_were_dropped_when_it_ended():
    assert first.table.cache_info().currsize == 0
    assert first.scaled._cache_size() == 0
'''

_MAPS = '''
import jax
import jax.numpy as jnp
import conftest

@jax.jit
def shifted(x):
    return x + 1

def test_compile_past_the_limit():
    conftest._MAX_MAPS = 2 * (conftest.map_count() + 60)  # its half: 60 maps from here
    for n in range(1, 61):  # 60 programs, three maps each
        shifted(jnp.ones(n))
    assert shifted._cache_size() == 60

def test_programs_were_dropped_after_the_test_that_passed_half_the_limit():
    assert shifted._cache_size() == 0
'''


@pytest.mark.slow  # a parity worker filled past half its limit: make test-all
def test_a_worker_drops_module_caches_and_programs_past_half_the_map_limit(tmp_path):
    for name, text in (("test_a_first.py", _FIRST), ("test_b_second.py", _SECOND), ("test_c_maps.py", _MAPS)):
        (tmp_path / name).write_text(textwrap.dedent(text))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this folder's run: none of the project's options
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                        str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**_env(), "PYTHONPATH": f"{ROOT}:{tmp_path}"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "5 passed" in p.stdout


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "JAX_COMPILATION_CACHE"))}
