"""The pytest plugin: examples/ci's own tests through the installed entry point, one
passing and one planted bug failing with a paragraph naming the layer; the audit fixture's threshold; without
the oracle extra, each fixture failing at set-up with one line naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pytest(where: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=where, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_ci_example_passes_and_catches_its_planted_bug():
    p = _pytest(ROOT / "examples" / "ci")
    print(p.stdout[-3000:], p.stderr[-2000:])
    assert "1 failed, 2 passed" in p.stdout
    assert "FAILED test_my_stack.py::test_packed_attention_with_a_bug_is_caught" in p.stdout
    message = next(line for line in p.stdout.splitlines() if line.startswith("anchor parity:"))
    assert "variant intra_doc asked: it computes full instead" in message
    assert "first diverges at layer 0, quantity `attn_out`" in message
    assert "Traceback" not in p.stdout


def test_the_audit_fixture_applies_the_users_threshold(tmp_path):
    (tmp_path / "test_audit.py").write_text(
        "def test_strict(anchor_audit):\n"
        "    anchor_audit('random:llama', policy='paper_bf16', max_D=1e-9)\n"
        "def test_lenient(anchor_audit):\n"
        "    r = anchor_audit('random:llama', policy='fp32', max_D=1.0)\n"
        "    assert r['shift_curve']['fp32']['D']\n")
    p = _pytest(tmp_path, "--rootdir", str(tmp_path))
    print(p.stdout[-3000:])
    assert "1 failed, 1 passed" in p.stdout
    assert "anchor audit: random:llama under paper_bf16: shifting every position by" in p.stdout
    assert "above max_D = 1e-09" in p.stdout


def test_without_the_oracle_each_fixture_names_the_extra(tmp_path):
    """JAX made absent (`sys.modules[name] = None`, as tests/test_extras.py does) in the pytest process: each
    fixture fails its test at set-up with one line naming the extra, before the test's body runs."""
    (tmp_path / "test_fixtures.py").write_text(
        "import pathlib\n"
        "def test_parity(anchor_parity):\n    pathlib.Path('ran_parity').touch()\n"
        "def test_audit(anchor_audit):\n    pathlib.Path('ran_audit').touch()\n"
        "def test_step(anchor_check_step):\n    pathlib.Path('ran_step').touch()\n")
    code = ("import sys\nfor m in ('jax', 'jaxlib', 'flax', 'optax', 'orbax'): sys.modules[m] = None\n"
            "import pytest\nsys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--rootdir', '.', 'test_fixtures.py']))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    print(p.stdout[-3000:], p.stderr[-2000:])
    assert "3 errors" in p.stdout and "ModuleNotFoundError" not in p.stdout + p.stderr
    for fixture in ("anchor_parity", "anchor_audit", "anchor_check_step"):
        line = (f'the {fixture} fixture needs the oracle extra (jax is not installed): '
                f'pip install "anchor-toolkit[oracle]"')
        assert line in p.stdout.splitlines() or f"Failed: {line}" in p.stdout, fixture
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith("ran_")) == []
