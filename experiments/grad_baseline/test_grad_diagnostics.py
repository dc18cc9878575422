"""The gradient diagnostics of issue 28 (grad_draws.py, norm_grad_parts.py beside this file): the
rule's false-alarm count on known draws, the trainer's rank among the draws, and CPU dry runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository
sys.path.insert(0, str(HERE))

from grad_draws import null_rule, trainer_case  # noqa: E402


def test_null_rule_counts_the_cases_a_draw_fails():
    # a: five equal draws, never failed. b: one draw ten times the others: judged against the four others
    # (the only set of 4 without it) it fails; every other draw's sets hold it, and pass.
    errors = {"a": [0.01] * 5, "b": [0.01, 0.01, 0.01, 0.01, 0.1]}
    r = null_rule(errors, sizes=(4,))
    assert r["draws"] == 5 and r["parameters"] == 2
    assert set(r) == {"draws", "parameters", "2_rms_of_4", "2_max_of_4"}  # N - 1 = 4: one set size
    for rule in ("2_rms_of_4", "2_max_of_4"):
        assert r[rule] == {"share_of_parameters_failed": 0.1, "parameters_failed_per_case": 0.2,
                           "cases_failed": 0.2}


def test_null_rule_tells_rms_from_max():
    # the largest of 4 draws covers a draw RMS misses: 0.05 against RMS(0.01, 0.01, 0.01, 0.04) = 0.0218
    # (bound 0.0446) fails, against 2 x 0.04 + 0.001 passes
    errors = {"p": [0.01, 0.01, 0.01, 0.04, 0.05]}
    r = null_rule(errors, sizes=(4,))
    assert r["2_rms_of_4"]["cases_failed"] == pytest.approx(1 / 5)
    assert r["2_max_of_4"]["cases_failed"] == 0


def test_trainer_case_ranks_the_trainer_among_the_draws():
    errors = {"x": [0.01, 0.02, 0.03, 0.04, 0.05], "y": [0.01] * 5}
    case = trainer_case(errors, {"x": 0.035, "y": 0.05}, "sdpa", "anchor", 97, orders=4)
    rows = {p["param"]: p for p in case["grads"]["params"]}
    assert rows["x"]["above_draws"] == 3 and rows["x"]["pass"]
    assert rows["y"]["above_draws"] == 5 and not rows["y"]["pass"]  # 0.05 > 2 x 0.01 + 0.001
    assert case["id"] == "cpu/anchor/bf16/sdpa/T97"


def run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / script), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow  # the experiment's dry run (20 s)
def test_grad_draws_with_the_trainer_dry_run(tmp_path):
    out = tmp_path / "draws.json"
    p = run("grad_draws.py", "--model", "random:llama", "--seq-len", 97, "--policy", "sdpa_cpu_bf16",
            "--orders", 3, "--trainer", "sdpa", "--out", out)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    n = len(d["errors"])
    assert sum(d["trainer_rank_histogram"]["counts"]) == n and len(d["trainer_rank_histogram"]["counts"]) == 4
    # 3 draws: no set of the rule's 4 orders, only of the 2 others
    assert set(d["null_rule"]) == {"draws", "parameters", "2_rms_of_2", "2_max_of_2"}
    [case] = d["cases"]
    assert case["engine"] == "sdpa" and set(case["verdicts"]) == {"rms_orders_0-2", "max_orders_0-2"}


@pytest.mark.slow  # the experiment's dry run (25 s)
def test_norm_grad_parts_dry_run(tmp_path):
    out = tmp_path / "parts.json"
    p = run("norm_grad_parts.py", "--model", "random:llama", "--seq-len", 97, "--layers", "0,1", "--out", out)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert d["truth_parts_vs_grad"] < 1e-12  # the captured factors are truth's own: their sum is its gradient
    for layer in d["layers"].values():
        for side in ("emulation", "torch"):
            r = layer[side]
            # bf16 arithmetic: off fp64 by rounding, and the factors' sum is the side's own gradient
            assert 1e-4 < r["dy"] < 0.1 and 1e-4 < r["xhat"] < 0.1, r
            assert abs(r["dw"] - r["dw_grad"]) < 0.5 * r["dw_grad"], r
