"""attn_grad_diag.py dry-run here (issue 28's gradient question, run on a GPU): capture a random Llama's
attention inputs and output gradients as bf16 bits, then one layer's backward through the varlen engine
(torch's fused CPU kernel here) against fp64 and the emulations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository
DIAG = Path(__file__).resolve().parent / "attn_grad_diag.py"


def diag(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DIAG), *map(str, args)], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow  # the experiment's dry run (20 s)
def test_capture_then_run_on_the_cpu(tmp_path):
    npz, out = tmp_path / "in.npz", tmp_path / "diag.json"
    p = diag("capture", "--model", "random:llama", "--seq-len", 97, "--layers", "0,1", "--out", npz)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["layers"] == [0, 1]
    p = diag("run", npz, "--out", out, "--device", "cpu")
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert d["engines"] == ["varlen", "sdpa"] and set(d["layers"]) == {"0", "1"}
    for row in d["layers"].values():
        assert set(row["vs_fp64"]) == {"emu_autodiff", "emu_fa2", "emu_flex", "emu_flex_d16", "emu_cpu", "varlen", "sdpa"}
        for errs in row["vs_fp64"].values():  # bf16 arithmetic: off fp64, but by its rounding only
            assert all(1e-4 < e < 0.05 for e in errs.values()), errs
        # torch's CPU kernel rounds dS to bf16 before dQ, as the written-out FA-2 backward does and the
        # autodiff of the forward does not
        to = row["kernel_to_emulation"]["varlen"]
        assert 2 * to["emu_fa2"]["dq"] < to["emu_autodiff"]["dq"], to
        # and, on the whole window (sdpa), adds dV into a bf16 gradient block by block, as emu_cpu does
        to = row["kernel_to_emulation"]["sdpa"]
        assert 2 * to["emu_cpu"]["dv"] < min(to[e]["dv"] for e in ("emu_autodiff", "emu_fa2", "emu_flex", "emu_flex_d16")), to
