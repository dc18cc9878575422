"""Run `anchor ARGV` in this process, paused at a chosen point until a file appears (test harness).

    python tests/cli/blocking_run.py POINT READY GO -- pack --model ... --out OUT

POINT: `pack-read` (inside pack's staging folder, before the corpus is read) or `audit-write` (inside
audit's staging folder, before the figures are drawn). On reaching it the process writes its pid to
READY, then waits until GO exists (at most 120 s) and carries on. Signals sent meanwhile arrive in
the wait, as they would in real work.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _pause(ready: Path, go: Path) -> None:
    ready.write_text(str(os.getpid()))
    t0 = time.time()
    while not go.exists() and time.time() - t0 < 120:
        time.sleep(0.05)


def main() -> None:
    point, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    argv = sys.argv[sys.argv.index("--") + 1:]
    if point == "pack-read":
        import anchor_core.data.readers as readers

        original = readers.read_jsonl

        def read_jsonl(*a, **k):
            _pause(ready, go)
            yield from original(*a, **k)

        readers.read_jsonl = read_jsonl
    elif point == "audit-write":
        import parity_tests.audit.report as report

        original_plot = report.plot_figures

        def plot_figures(*a, **k):
            _pause(ready, go)
            return original_plot(*a, **k)

        report.plot_figures = plot_figures
    else:
        raise SystemExit(f"unknown point {point}")
    from anchor.cli import main as anchor_main

    anchor_main(argv)


if __name__ == "__main__":
    main()
