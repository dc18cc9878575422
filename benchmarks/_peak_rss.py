"""What the memory benchmarks share: an `anchor` verb in a fresh process under GNU time, and the corpus packed
for a window length outside the measured process.

    from _peak_rss import measure, pack, require_time
    data = pack(corpus, 8192, tmp / "pack-8192", model="default")
    row = measure(["train", "--config", "tiny", "--out", str(run), f"data.path={data}"])
    # {"peak_rss_bytes": ..., "seconds": ...} or {"failed": "exit 2: [...]", "seconds": ...}

The peak is `/usr/bin/time -v`'s "Maximum resident set size": the whole process (Python, torch, DeepSpeed,
the model, the work), which is what a user's machine must hold.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIME = "/usr/bin/time"
GiB = 2**30


def require_time() -> None:
    if not Path(TIME).is_file():
        raise SystemExit(f"{TIME} is missing (GNU time: apt-get install time)")


def anchor_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "anchor", *args]


def measure(args: list[str]) -> dict:
    """`anchor ARGS` in a fresh process under `/usr/bin/time -v`: its peak RSS and wall seconds, or why it
    failed (the last two lines of its own stderr)."""
    t0 = time.perf_counter()
    done = subprocess.run([TIME, "-v", *anchor_cmd(*args)], capture_output=True, text=True, check=False, cwd=ROOT)
    seconds = round(time.perf_counter() - t0, 1)
    if done.returncode != 0:
        return {"failed": failure(done), "seconds": seconds}
    kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    return {"peak_rss_bytes": kib * 1024, "seconds": seconds}


def failure(done: subprocess.CompletedProcess) -> str:
    """Why a process failed: its exit code and the last two lines of its own stderr (GNU time's report, indented
    by a tab, left out)."""
    tail = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("\t")][-2:]
    return f"exit {done.returncode}: {tail}"


def pack(corpus: Path, T: int, out: Path, *, model: str, budget: int | None = None) -> Path:
    """`corpus` packed for `model` into windows of T slots (`budget` tokens, by default max(60000, 2 T): at least
    one window), in its own process: not measured."""
    budget = budget or max(60000, 2 * T)
    done = subprocess.run(anchor_cmd("pack", "--model", model, "--data", str(corpus), "--seq-len", str(T), "--budget",
                                     str(budget), "--out", str(out), "--no-progress"),
                          capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"packing {model} at T={T} failed: {done.stderr.strip().splitlines()[-1:]}")
    return out
