"""Runtime of the default precision audit (`anchor audit --model default`) on this machine.

    .venv/bin/python benchmarks/bench_audit.py [--model default] [--out results/audit/audit_runtime_cpu.json]
        [--audit-out DIR] [-- extra run_audit settings as key=value, e.g. random_init=true]

Records the wall time of the whole `run_audit` + `write_audit`, with the machine (platform, CPU count,
load average before and after, versions), the process's CPU seconds (the cost whatever else shares
the cores) and the settings used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--policies", default="fp32,hf_bf16,fa2_bf16,paper_bf16")
    ap.add_argument("--out", default=str(ROOT / "results/audit/audit_runtime_cpu.json"))
    ap.add_argument("--audit-out", default=None, help="also keep the audit's own output here")
    ap.add_argument("settings", nargs="*", help="run_audit overrides, key=value")
    args = ap.parse_args()

    import jax

    from anchor_core.machine import machine
    from parity_tests.audit import run_audit, write_audit

    overrides = dict(s.split("=", 1) for s in args.settings)
    overrides = {k: _value(v) for k, v in overrides.items()}
    load_before = os.getloadavg()
    cpu0 = os.times()
    t0 = time.time()
    result = run_audit(args.model, args.policies, progress=True, **overrides)
    t_run = time.time() - t0
    out_dir = args.audit_out or tempfile.mkdtemp(prefix="bench_audit-")
    write_audit(result, out_dir)
    t_total = time.time() - t0
    cpu1 = os.times()
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    record = {
        "benchmark": "anchor audit (parity_tests.audit.run_audit + write_audit)",
        "model": args.model, "policies": args.policies, "overrides": overrides,
        "settings": result["settings"],
        "wall_s": round(t_total, 1), "run_audit_s": round(t_run, 1), "limit_s": 900,
        "within_limit": t_total <= 900,
        # CPU seconds of this process: what the run costs whatever else shares the cores
        "cpu_s": round(cpu_s, 1), "cores_used_on_average": round(cpu_s / t_total, 2),
        "machine": machine(backend=jax.default_backend(), load_average_before=[round(x, 2) for x in load_before]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
