"""The audit of the real torch stack against the oracle's emulation of it (issue 13, acceptance 4).

    python benchmarks/bench_audit_torch.py --engines eager,sdpa,flex --seq-len 512 --num-seqs 2
    python benchmarks/bench_audit_torch.py --collect runs/audit-eager runs/audit-sdpa ...   # from `anchor audit --stack torch` outputs

Runs `anchor audit --stack torch` (torchtrain.audit.audit_torch_stack) on SmolLM2 per engine in bf16
and records, per engine, D of the torch stack and of the oracle policy that emulates it at every
shift, their ratio, and the largest relative difference, with the machine, into
benchmarks/results/audit_torch_stack.json. The acceptance: eager within 5 % of hf_bf16 at every
shift; sdpa and flex within 10 % of their emulations.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOUNDS = {"eager": 0.05, "sdpa": 0.10, "flex": 0.10, "flash_varlen": 0.10, "flash_varlen_emulated": 0.10}


def entry(result: dict) -> dict:
    comp, stack, s = result["comparison"], result["stack"], result["settings"]
    bound = BOUNDS[stack["engine"]]
    return {"engine": stack["engine"], "dtype": stack["dtype"], "oracle_policy": comp["oracle"],
            "model": result["model"], "seq_len": s["seq_len"], "num_seqs": s["num_seqs"], "shifts": comp["shifts"],
            "D_torch": comp["D_torch"], "D_oracle": comp["D_oracle"], "ratio": comp["ratio"],
            "max_rel_diff": comp["max_rel_diff"], "bound": bound, "within": comp["max_rel_diff"] <= bound,
            "runtime_s": round(result["runtime_s"], 1), "machine": result["machine"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--engines", default="eager,sdpa,flex")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-seqs", type=int, default=2)
    ap.add_argument("--collect", nargs="*", help="audit folders written by `anchor audit --stack torch` to record instead")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "audit_torch_stack.json"))
    args = ap.parse_args()
    if args.collect:
        results = [json.loads((Path(d) / "audit.json").read_text()) for d in args.collect]
    else:
        from torchtrain.audit import audit_torch_stack

        results = [audit_torch_stack(args.model, e, "bfloat16", seq_len=args.seq_len, num_seqs=args.num_seqs,
                                     max_len=args.seq_len, progress=True) for e in args.engines.split(",")]
    rows = [entry(r) for r in results]
    out = {"benchmark": "audit_torch_stack", "rows": rows,
           "command": "anchor audit --stack torch --engine E --dtype bfloat16 --model default --seq-len 512 "
                      "--max-len 512 --num-seqs N"}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for r in rows:
        print(f"{r['engine']:>22} vs {r['oracle_policy']:<14} windows {r['num_seqs']}: max |D_torch/D_oracle - 1| = "
              f"{r['max_rel_diff']:.1%} (bound {r['bound']:.0%}) {'ok' if r['within'] else 'OVER'}")


if __name__ == "__main__":
    main()
