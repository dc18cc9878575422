"""Wall time of `python -m anchor --help` (what every `anchor` command pays before its verb starts).

    .venv/bin/python benchmarks/bench_cli_startup.py [--runs 15] [--out results/speed/cli_startup_cpu.json]
        [--baseline DIR --baseline-module anchor_app]

    git worktree add /tmp/base COMMIT     # an older tree, for --baseline /tmp/base (its command's module name)

Each run is a fresh process of this Python. With --baseline, the older tree's command runs in turn with this
one (one after the other, run by run: the cores are shared, so compare runs of one session); the JSON holds
every time, the mean and median of each, their ratio, and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from anchor_core.machine import machine

ROOT = Path(__file__).resolve().parent.parent


def _once(module: str, tree: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", module, "--help"], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _summary(times: list[float]) -> dict:
    return {"runs": len(times), "mean_s": round(statistics.mean(times), 4),
            "median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
            "max_s": round(max(times), 4), "times_s": [round(t, 4) for t in times]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "results/speed/cli_startup_cpu.json"))
    ap.add_argument("--baseline", default=None, help="an older tree whose command runs in turn with this one")
    ap.add_argument("--baseline-module", default="anchor_app", help="the command's module in that tree")
    args = ap.parse_args()
    _once("anchor", ROOT)  # the first process pays the disk's cold reads: not counted
    if args.baseline:
        _once(args.baseline_module, Path(args.baseline))
    load_before = os.getloadavg()
    now, base = [], []
    for _ in range(args.runs):
        now.append(_once("anchor", ROOT))
        if args.baseline:
            base.append(_once(args.baseline_module, Path(args.baseline)))
    record = {"benchmark": "`python -m anchor --help`, a fresh process per run", "this_tree": _summary(now),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "machine": machine(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.baseline:
        commit = subprocess.run(["git", "-C", args.baseline, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
        record["baseline"] = {"tree": str(args.baseline), "commit": commit, "module": args.baseline_module,
                              **_summary(base)}
        record["ratio_this_over_baseline"] = {
            "mean": round(statistics.mean(now) / statistics.mean(base), 3),
            "median": round(statistics.median(now) / statistics.median(base), 3)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in record if k in ("this_tree", "baseline", "ratio_this_over_baseline")},
                     indent=1))


if __name__ == "__main__":
    main()
