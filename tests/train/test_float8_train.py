"""`anchor train` with FP8 linear layers (model.float8 in torchao's emulation): killed with SIGKILL and run again, it
ends where an uninterrupted run does; on the CPU without emulation it is refused in one line, exit code 2."""

from __future__ import annotations

import numpy as np
import pytest

from tests import fp8
from tests.train.conftest import DETERMINISTIC, ENV, final_weights, kill_when, metrics, run_train, train_args


@pytest.fixture(autouse=True)
def _torchao():
    fp8.use_torchao()


@pytest.mark.slow  # a fresh interpreter (torchao on its path); the check itself: tests/torchtrain/test_float8.py
def test_fp8_without_emulation_on_the_cpu_is_refused_in_one_line(packed, tmp_path):
    p = run_train(tmp_path / "run", f"data.path={packed}", "model.float8=rowwise", check=False, env=fp8.env(ENV))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-2000:]
    assert lines[-1].startswith("anchor train: error: command-line override model.float8=rowwise: the CPU has no FP8 "
                                "matmuls; set model.float8_emulation=true")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_fp8_run_killed_resumes_exactly(packed, tmp_path):
    """bf16 under ZeRO-1 with rowwise FP8 in emulation: killed with SIGKILL after step 5's metrics, run again, it
    ends where an uninterrupted run does, bit for bit (losses, gradient norms, weights)."""
    steps = 8
    args = (f"data.path={packed}", f"schedule.steps={steps}", "checkpoint.save_every=2", "eval.window=0",
            "model.dtype=bfloat16", "parallel.zero_stage=1", "model.float8=rowwise", "model.float8_emulation=true")
    env = fp8.env(ENV)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_train(whole, *args, env=env)
    lines = lambda: len((resumed / "metrics.jsonl").read_text().splitlines()) if (resumed / "metrics.jsonl").is_file() \
        else 0  # noqa: E731
    kill_when(train_args(resumed, *args), lambda: lines() >= 5, env=env)
    assert lines() < steps
    run_train(resumed, *args, env=env)
    a, b = metrics(whole), metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    assert [{k: r[k] for k in DETERMINISTIC} for r in a] == [{k: r[k] for k in DETERMINISTIC} for r in b]
    wa, wb = final_weights(whole, steps), final_weights(resumed, steps)
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[n], wb[n]) for n in wa)


@pytest.mark.slow  # a fresh interpreter with torchao on its path
def test_with_torchao_installed_a_refusal_is_still_one_line(tmp_path):
    """transformers imports torchao wherever it is installed, and torchao's import logs on a CPU torch: the command
    prints its one line of error and nothing else."""
    p = run_train(tmp_path / "run", "model.float8=blockwise", check=False, env=fp8.env(ENV))
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr[-2000:]
    assert "model.float8: expected one of rowwise, tensorwise" in p.stderr
