"""`make parity-all`: the whole parity matrix under xdist, then every case not seen to pass, alone.

    python -m parity_tests.run_all [--workers 2] [--limit-s 5400] [pytest args...]

Pass 1 runs `pytest -n WORKERS --dist loadgroup -m "parity_full and not serial" parity_tests -v`
and reads its verbose lines as they come: the node ids reported PASSED (or SKIPPED) are done; then
the cases marked `serial` (two SmolLM2 gradient cases of 12.5 GB each) run in one process. A worker that dies
(the OOM killer; or XLA, unable to map a compiled program past vm.max_map_count in a long-lived worker,
which the root conftest.py keeps below half that limit) takes its running case
with it, and xdist can then hang on the crashed worker's group (its workers idle, no line for many
minutes); pass 1 is therefore stopped when it has printed
nothing for `--idle-s`, or at `--limit-s`. Pass 2 runs every collected case not
reported passed, one process (`-n 0`), so a case that failed in pass 1 fails again there on its own
and a case lost to a crash gets its run. The exit status is pass 2's (0 when pass 1 passed all).
Nothing is loosened: a case passes only by passing.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

PYTEST = [sys.executable, "-m", "pytest", "parity_tests", "-p", "no:cacheprovider"]
BASE = [*PYTEST, "-m", "parity_full"]
RESULT = re.compile(r"(\S+::\S+) (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)|(PASSED|SKIPPED|FAILED|ERROR) (\S+::\S+)")


def outcome(line: str) -> tuple[str, str] | None:
    """(node id, outcome) of a verbose pytest line (xdist's "[gw0] [ 5%] PASSED id" or "id PASSED [ 5%]")."""
    m = RESULT.search(line)
    if not m:
        return None
    return (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))


def remaining(cases: list[str], seen: dict[str, str]) -> list[str]:
    """The collected cases not reported PASSED or SKIPPED, in collection order."""
    return [n for n in cases if seen.get(n) not in ("PASSED", "SKIPPED")]


def collect(extra: list[str]) -> list[str]:
    out = subprocess.run([*BASE, "--collect-only", "-q", *extra], capture_output=True, text=True, check=False)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    if not ids:
        sys.exit(f"parity-all: collected no cases\n{out.stdout}\n{out.stderr}")
    return ids


def run_pass1(workers: int, limit_s: float, idle_s: float, extra: list[str]) -> tuple[dict[str, str], int | None]:
    """{node id: outcome} of the cases pass 1 reported, and its exit code (None: stopped)."""
    seen, code = watch([*PYTEST, "-m", "parity_full and not serial", "-n", str(workers), "--dist", "loadgroup", "-v",
                        *extra], limit_s, idle_s)
    serial, code_s = watch([*PYTEST, "-m", "parity_full and serial", "-n", "0", "-v", *extra], limit_s, idle_s)
    seen.update(serial)
    if code is None or code_s is None:
        return seen, None
    bad = [c for c in (code, code_s) if c not in (0, 5)]  # 5: nothing selected
    return seen, bad[0] if bad else 0


def watch(cmd: list[str], limit_s: float, idle_s: float) -> tuple[dict[str, str], int | None]:
    """Run pytest `cmd`, echoing its lines; {node id: outcome} it reported and its exit code (None: stopped)."""
    print("parity-all, pass 1:", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: dict[str, str] = {}
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + limit_s
    last = time.monotonic()
    while True:
        try:
            line = lines.get(timeout=5.0)
        except queue.Empty:
            now = time.monotonic()
            if now < deadline and now - last < idle_s:
                continue
            why = f"silent for {now - last:.0f} s" if now - last >= idle_s else f"still running after {limit_s:.0f} s"
            print(f"parity-all: pass 1 {why} (a crashed worker's group?): stopped", flush=True)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return seen, None
        if line is None:
            return seen, proc.wait()
        last = time.monotonic()
        print(line, flush=True)
        got = outcome(line)
        if got:
            seen[got[0]] = got[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit-s", type=float, default=5400.0, help="stop pass 1 after this many seconds")
    ap.add_argument("--idle-s", type=float, default=900.0, help="stop pass 1 after this many seconds without a line")
    args, extra = ap.parse_known_args(argv)
    cases = collect(extra)
    seen, code = run_pass1(args.workers, args.limit_s, args.idle_s, extra)
    rest = remaining(cases, seen)
    print(f"parity-all, pass 1: {len(cases) - len(rest)} of {len(cases)} cases passed or skipped"
          f" (exit {code if code is not None else 'none: stopped'})", flush=True)
    if not rest:
        return 0
    lost = [n for n in rest if n not in seen]
    failed = [n for n in rest if n in seen]
    print(f"parity-all, pass 2: {len(failed)} failed and {len(lost)} never reported (a crashed or stopped worker),"
          " each run again in one process:", flush=True)
    for n in rest:
        print("  ", n, flush=True)
    # the node ids alone (no directory argument: with one, pytest would run the whole suite again)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-v", *extra, *rest]
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
