"""benchmarks/bench_longest_window.py's GPU series (`--device cuda`), dry-run on the CPU with the tiny config: each
length is one fresh `anchor train` step whose peak is read from its own metrics.jsonl, set beside the plan's
prediction for the same run overrides; the series ends at the first length that fails, which the record keeps
with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
