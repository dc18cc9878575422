"""`anchor bench` killed with SIGKILL: its temporary files are removed by the next bench on the same --out.
The docstring says what is left without that cleanup."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bench.helpers import corpus as _corpus, env as _env, T


# ---------------------------------------------------------------------------------------------
# 3. Temporary files after SIGKILL


def _bench_cmd(out: Path, corpus: Path, steps: int) -> list[str]:
    return [sys.executable, "-c", "from anchor.cli import main; main()", "bench", "--out", str(out), "--model", "random:llama",
            "--data", str(corpus), "--seq-len", str(T), "--distributions", "corpus", "--windows", "1",
            "--repeats", "1", "--no-attention", "--step-steps", str(steps), "--no-progress",
            "--estimate-seq-len", "4096"]


@pytest.mark.slow  # minutes of CPU: make test-all
def test_temporary_files_of_a_killed_bench_are_removed_by_the_next(tmp_path):
    """kill -9 of a bench during its training steps, then a second bench on the same --out: nothing of
    the first is left: not its `$TMPDIR/anchor-bench-*` (the cut model, its pack and the run: 160 MB with
    the default model), which only the next bench can remove."""
    corpus = _corpus(tmp_path / "docs.jsonl")
    env = _env(tmp_path)
    out = tmp_path / "bench"
    first = subprocess.Popen(_bench_cmd(out, corpus, 100000), env=env, cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # a guard against a hang only
    try:
        while not any(p.name == "run-full" for p in tmp_path.rglob("run-*")):  # its steps are training
            assert first.poll() is None, f"the first bench ended: {first.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "the first bench never reached its training steps"
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("run-full"))
    print("left by the killed bench:", left)
    assert left  # there was something to clean

    second = subprocess.run(_bench_cmd(out, corpus, 2), env=env, cwd=tmp_path, capture_output=True, text=True)
    print(second.stdout[-1000:], second.stderr[-2000:])
    assert second.returncode == 0
    assert json.loads((out / "bench.json").read_text())["step"]
    tmpdir = Path(env["TMPDIR"])
    assert [p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench", "cache", "docs.jsonl", "tmpdir"]
    assert not [p.name for p in (tmp_path / "cache" / "bench").iterdir() if ".tmp-" in p.name]
    assert not list(tmp_path.rglob("run-full"))
