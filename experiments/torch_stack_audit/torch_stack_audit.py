"""The audit of the real torch stack against the oracle's emulation of it (issue 13, acceptance 4).

    python experiments/torch_stack_audit/torch_stack_audit.py --engines eager,sdpa,flex --seq-len 512 --num-seqs 2
    python experiments/torch_stack_audit/torch_stack_audit.py --collect runs/audit-eager runs/audit-sdpa ...   # from `anchor audit --stack torch` outputs
    python experiments/torch_stack_audit/torch_stack_audit.py --rerun-oracle   # the oracle side only, against the recorded torch side

Runs `anchor audit --stack torch` (parity_tests.audit.torch_stack.audit_torch_stack) on SmolLM2 per engine in bf16
and records, per engine, D of the torch stack and of the oracle policy that emulates it at every
shift, their ratio, and the largest relative difference, with the machine, into
experiments/torch_stack_audit/results/audit_torch_stack_cpu.json. The acceptance: eager within 5 % of hf_bf16 at every
shift; sdpa and flex within 10 % of their emulations.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
RESULTS = Path(__file__).resolve().parent / "results"
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


RERUN_NOTE = ("D_oracle: today's oracle on the recorded run's windows and shifts (parity_tests.audit.torch_stack.audit_inputs); "
              "D_torch: the recorded run's, valid while torchtrain's path for the engine is unchanged.")


def _rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def rerun_oracle(recorded: Path, out: Path) -> None:
    """The oracle side of a recorded audit_torch_stack.json again, with today's oracle, on the same windows
    and shifts (the recorded D_torch kept: for a change to the oracle alone, minutes instead of an hour)."""
    import numpy as np

    from anchor_core.machine import machine
    from parity_tests.audit.runner import restrict_vocab, shift_curve
    from jaxref.reference import params_from_state
    from jaxref.policy import get_policy
    from parity_tests.audit.torch_stack import audit_inputs

    rows = []
    for r in json.loads(recorded.read_text())["rows"]:
        settings, _, _, spec, state, shift_w, length_w = audit_inputs(
            r["model"], seq_len=r["seq_len"], max_len=r["seq_len"], num_seqs=r["num_seqs"])
        params, remap = restrict_vocab(params_from_state(spec, state), spec, [shift_w, length_w])
        sc = shift_curve(params, spec, remap(shift_w), get_policy(r["oracle_policy"]), settings.shifts,
                         settings.ref_shift, lambda n: None)
        d = [float(x) for x in sc["D"]]
        ratio = np.asarray(r["D_torch"]) / np.asarray(d)
        worst = float(np.abs(ratio - 1).max())
        rows.append({**{k: r[k] for k in ("engine", "oracle_policy", "model", "seq_len", "num_seqs", "shifts", "D_torch")},
                     "D_oracle": d, "ratio": ratio.tolist(), "max_rel_diff": worst, "bound": r["bound"],
                     "within": worst <= r["bound"], "max_rel_diff_recorded": r["max_rel_diff"],
                     "D_oracle_as_recorded": d == r["D_oracle"]})
        print(f"{r['engine']:>22} vs {r['oracle_policy']:<14}: max |D_torch/D_oracle - 1| = {worst:.1%} "
              f"(recorded {r['max_rel_diff']:.1%}, bound {r['bound']:.0%})", flush=True)
    out.write_text(json.dumps({"benchmark": "audit_torch_stack, oracle side recomputed", "recorded": _rel(recorded),
                               "note": RERUN_NOTE, "rows": rows, "machine": machine()}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--engines", default="eager,sdpa,flex")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-seqs", type=int, default=2)
    ap.add_argument("--collect", nargs="*", help="audit folders written by `anchor audit --stack torch` to record instead")
    ap.add_argument("--rerun-oracle", action="store_true",
                    help="recompute only the oracle side of --recorded (same windows and shifts) into --out")
    ap.add_argument("--recorded", default=str(RESULTS / "audit_torch_stack_cpu.json"))
    ap.add_argument("--out", default=None, help="default: audit_torch_stack_cpu.json (audit_torch_stack_oracle_rerun_cpu"
                                                ".json with --rerun-oracle) under results/ beside this script")
    args = ap.parse_args()
    if args.rerun_oracle:
        rerun_oracle(Path(args.recorded), Path(args.out or RESULTS / "audit_torch_stack_oracle_rerun_cpu.json"))
        return
    args.out = args.out or str(RESULTS / "audit_torch_stack_cpu.json")
    if args.collect:
        results = [json.loads((Path(d) / "audit.json").read_text()) for d in args.collect]
    else:
        from parity_tests.audit.torch_stack import audit_torch_stack

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
