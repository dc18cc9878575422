"""The pytest plugin: examples/ci's own tests through the installed entry point, one
passing and one planted bug failing with a paragraph naming the layer; the audit fixture's threshold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(where: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=where, capture_output=True, text=True, timeout=600)


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
