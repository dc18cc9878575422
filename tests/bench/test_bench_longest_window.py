"""benchmarks/bench_longest_window.py's GPU series (`--device cuda`), dry-run on the CPU with the tiny config: each
length is one fresh `anchor train` step whose peak is read from its own metrics.jsonl, set beside the plan's
prediction for the same run overrides; the series ends at the first length that fails, which the record keeps
with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # minutes: a packed corpus and three training processes (make test-all)
def test_the_gpu_series_reads_each_steps_peak_and_ends_at_the_first_failure(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/bench_longest_window.py", "--device", "cuda", "--dry-run",
                           "--config", "tiny", "--lens", "97,5001,193", "--memory-gib", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "longest_window_cpu-dry-run.json").read_text())
    rows = record["rows"]
    assert [r["seq_len"] for r in rows] == [97, 5001]  # 5001 is beyond tiny's 4096 positions: 193 never runs
    ok, failed = rows
    assert "beyond the model's 4096 positions" in failed["failed"] and "predicted_over_measured" not in failed
    assert ok["peak_reserved_bytes"] >= ok["peak_allocated_bytes"] > 0 and ok["loss_finite"]
    assert ok["predicted_over_measured"] == round(ok["predicted_bytes"] / ok["peak_reserved_bytes"], 3)
    assert record["run"][:2] == ["model.dtype=bfloat16", "parallel.zero_stage=1"]  # what GPU users train in
    assert record["plan_args"][:2] == ["--config", "tiny"] and "gpu_plans" not in record
    assert record["summary"] == {"lengths_measured": 1, "longest_trained": 97,
                                 "worst_predicted_over_measured": abs(ok["predicted_over_measured"] - 1)}
    assert "unfinished" not in record and record["machine"]["commit"]
    # --replan sets the plan beside the measurements again from the record alone (no GPU needed), under its name
    again = subprocess.run([sys.executable, "benchmarks/bench_longest_window.py", "--replan",
                            str(tmp_path / "longest_window_cpu-dry-run.json"), "--out", str(tmp_path / "replanned")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    replanned = json.loads((tmp_path / "replanned" / "longest_window_cpu-dry-run.json").read_text())
    assert replanned["rows"] == rows and replanned["plan_args"] == record["plan_args"]


def test_a_gpus_name_is_the_plans_device_where_one_matches():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_longest_window import gpu_word

    assert gpu_word("NVIDIA H100 80GB HBM3") == "h100" and gpu_word("NVIDIA H200") == "h200"
    assert gpu_word("NVIDIA A100-SXM4-80GB") == "a100-80gb" and gpu_word("NVIDIA A100-PCIE-40GB") == "a100-40gb"
    assert gpu_word("NVIDIA L40S") == "nvidia-l40s"
