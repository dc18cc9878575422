"""metrics.jsonl's `peak_memory_gib` (torchtrain.training.metrics.peak_memory): the most the process has held so far, what
`anchor plan` predicts a step's peak against. On the CPU it is the peak resident set; on CUDA the allocator's peak
(tests/train/test_cuda_train.py)."""

from __future__ import annotations

import subprocess
import sys

import torch

import torchtrain.training.metrics as metrics_module
from tests.train.conftest import metrics, run_train
from torchtrain.training.metrics import peak_memory

_PROBE = """
import numpy as np, torch
from torchtrain.training.metrics import peak_memory
before = peak_memory(torch.device("cpu"))["peak_memory_gib"]
x = np.ones(2**27)  # 1 GiB, every page touched
del x
after = peak_memory(torch.device("cpu"))
print(before, after["peak_memory_gib"], sorted(after))
"""

# The probe's parent: a process holding 2 GiB (not the pytest worker, whose memory another worker shares).
_PARENT = """
import subprocess, sys
import numpy as np
ballast = np.ones(2 * 2**27)  # 2 GiB, every page touched
probe = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True, check=True)
print(probe.stdout, end="")
"""


def test_the_peak_counts_memory_held_and_freed_since():
    """The process's own peak, started by a parent that holds more (2 GiB here): getrusage's ru_maxrss would
    report the parent's 2 GiB before and after the child's 1 GiB array."""
    before, after, keys = subprocess.run([sys.executable, "-c", _PARENT, _PROBE], capture_output=True, text=True,
                                         check=True).stdout.split(maxsplit=2)
    assert float(before) < 1.5  # the child's own: Python, numpy, torch
    assert 0.95 <= float(after) - float(before) < 1.2  # the 1 GiB array, freed before the reading (GiB to 4 places)
    assert keys.strip() == "['peak_memory_gib']"


def test_the_logged_peak_never_decreases(monkeypatch):
    """VmHWM comes from the kernel's approximate RSS counters and can read a little lower than before; the logged
    peak is the most read so far in this process, and a forked child starts its own."""
    readings = iter([2 * 2**30, 2 * 2**30 - 2**18, 2**30])
    monkeypatch.setattr(metrics_module, "peak_rss", lambda: next(readings))
    monkeypatch.setattr(metrics_module, "_cpu_peak", (-1, 0))
    cpu = torch.device("cpu")
    assert [peak_memory(cpu)["peak_memory_gib"] for _ in range(2)] == [2.0, 2.0]
    monkeypatch.setattr(metrics_module.os, "getpid", lambda: -2)  # another process: its own readings only
    assert peak_memory(cpu)["peak_memory_gib"] == 1.0


def test_each_step_logs_the_peak_so_far(packed, tmp_path):
    run_train(tmp_path / "run", "schedule.steps=3", "checkpoint.save_every=0", "eval.window=0", f"data.path={packed}")
    peaks = [r["peak_memory_gib"] for r in metrics(tmp_path / "run")]
    assert len(peaks) == 3 and peaks == sorted(peaks)
    assert 0.2 < peaks[0] < 4  # a tiny model's process: torch and the run, not a machine's worth
