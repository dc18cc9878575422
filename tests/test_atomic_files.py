"""`anchor_core.atomic.write_text_atomic` leaves nothing behind a killed writer (no
`.metrics.jsonl.tmp-PID` in the run folder after `kill -9`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from anchor_core.atomic import write_text_atomic


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # a writer killed between its write and its rename: its temporary file stays, under its pid
    code = ("import os, sys; from pathlib import Path; p = Path(sys.argv[1]); "
            "t = p.with_name(f'.{p.name}.tmp-{os.getpid()}'); t.write_text('half'); print(os.getpid(), flush=True); "
            "import time; time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    pid = int(child.stdout.readline())
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live_tmp = tmp_path / f".metrics.jsonl.tmp-{alive.pid}"  # a writer still at work: left alone
    live_tmp.write_text("in progress")
    other = tmp_path / ".other.jsonl.tmp-1"  # another file's: not this write's business
    other.write_text("x")
    try:
        os.kill(pid, signal.SIGKILL)
        child.wait()
        assert (tmp_path / f".metrics.jsonl.tmp-{pid}").exists()
        write_text_atomic(path, "step 1\n")
        assert path.read_text() == "step 1\n"
        left = sorted(p.name for p in tmp_path.iterdir())
        print(left)
        assert left == sorted([".metrics.jsonl.tmp-" + str(alive.pid), ".other.jsonl.tmp-1", "metrics.jsonl"])
    finally:
        alive.kill()
        alive.wait()
