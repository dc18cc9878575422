"""metrics.jsonl's `peak_memory_gib` (torchtrain.metrics.peak_memory): the most the process has held so far, what
`anchor plan` predicts a step's peak against. On the CPU it is the peak resident set; on CUDA the allocator's peak
(tests/train/test_cuda_train.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from tests.train.conftest import metrics, run_train

_PROBE = """
import numpy as np, torch
from torchtrain.metrics import peak_memory
before = peak_memory(torch.device("cpu"))["peak_memory_gib"]
x = np.ones(2**28)  # 2 GiB, every page touched
del x
after = peak_memory(torch.device("cpu"))
print(before, after["peak_memory_gib"], sorted(after))
"""


def test_the_peak_counts_memory_held_and_freed_since():
    """The process's own peak, started by a parent that holds more (3 GiB here): getrusage's ru_maxrss would
    report the parent's 3 GiB before and after the child's 2 GiB array."""
    ballast = np.ones(3 * 2**27)  # 3 GiB in this process, every page touched
    before, after, keys = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                                         check=True).stdout.split(maxsplit=2)
    del ballast
    assert float(before) < 1.5  # the child's own: Python, numpy, torch
    assert 1.95 <= float(after) - float(before) < 2.2  # the 2 GiB array, freed before the reading (GiB to 4 places)
    assert keys.strip() == "['peak_memory_gib']"


def test_each_step_logs_the_peak_so_far(packed, tmp_path):
    run_train(tmp_path / "run", "schedule.steps=3", "checkpoint.save_every=0", "eval.window=0", f"data.path={packed}")
    peaks = [r["peak_memory_gib"] for r in metrics(tmp_path / "run")]
    assert len(peaks) == 3 and peaks == sorted(peaks)
    assert 0.2 < peaks[0] < 4  # a tiny model's process: torch and the run, not a machine's worth
