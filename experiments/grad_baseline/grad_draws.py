"""How far one bf16 gradient is from fp64 in each summation order: the gradient rule's baseline, drawn.

    python experiments/grad_baseline/grad_draws.py --model default --variant anchor --seq-len 1025 --orders 8 \
        [--parity results/gpu/parity/parity_T1025_h200.json] --out experiments/grad_baseline/results/grad_draws_cpu.json
    python experiments/grad_baseline/grad_draws.py --policy sdpa_cpu_bf16 --orders 12 --trainer sdpa \
        --out experiments/grad_baseline/results/grad_draws_cpu_sdpa.json          # the CPU's trainer beside its emulation
    python experiments/grad_baseline/grad_draws.py --from RECORD.json [--parity P.json] --out FILE.json   # judged again

The oracle's gradients at the starting parameters (a parity case's inputs, `parity_tests.cases`) in fp64
and under the emulation (`--policy`, fa2_bf16: what torch's varlen and flex kernels are held against on
CUDA) in orders 0 … N-1 (`parity_tests.grads.oracle_grad_draws`: the same model, its units listed in
another order); per parameter, each order's rel. L2 against fp64. With `--parity` (a parity.json with
gradient cases of the same model, variant and length), also each trainer's error beside the draws, and
the verdicts two rules would give with the first k orders, k = 4, 8 and N: 2 x their RMS + 0.001 (the
forward taps' rule, and the gradients' before 2026-11-26) and 2 x their largest + 0.001 (the gradients'
rule since: parity_tests.grads.grad_baseline). With `--trainer ENGINE`, the trainer's bf16 gradient on
this machine is computed too (as the parity suite does, `parity_tests.grads.torch_training`) and set
beside the draws the same way, with each parameter's rank among them (`trainer_rank_histogram`).
Always: `null_rule`, the rules' false alarms on a trainer that computes exactly the emulation's
arithmetic (each draw judged against every set of 4, of 8 and of N-1 of the others). `--from` takes the
draws and trainer errors of an earlier run's file instead of computing them (seconds, not minutes).

What it showed (SmolLM2, anchor, T=1025): the draws are not spread around one size. Layer 10's k_proj
gradient is 0.05-0.06 off fp64 in half the orders and 0.14, 0.32, 0.35 or 0.64 in the others: a few
discrete outcomes (the rounding of the massive activation that forms at the anchor in layers 9-11), and
torch's CUDA flex kernel landed on the largest (0.68), varlen on the smallest.

On the CPU (sdpa engine against `sdpa_cpu_bf16` on AVX2, 12 orders, 2026-11-26, about 11 minutes;
experiments/grad_baseline/results/grad_draws_cpu_sdpa.json): the trainer's gradient is a draw of the emulation. Its error
exceeds k of the 12 draws for k = 0 … 12 on [12, 21, 37, 22, 21, 24, 31, 21, 16, 22, 13, 19, 13] of the
272 parameters (one more draw would give about 21 each; a missing operation would pile them at 12).
It missed the RMS rule on one parameter, layer 28's input norm, 0.080 against draws of 0.018-0.070, a
heavy tail (experiments/grad_baseline/norm_grad_parts.py: one element, the anchor's massive activation). And the RMS rule
(2 x RMS of 4 orders + 0.001) fails a draw of the emulation itself in 46% of such cases (0.73 parameters
a case); 2 x the largest of 4 in 15%, 2 x the largest of 8 in 0.7%, 2 x the largest of 11 in none. With
the CUDA record's 8 draws of fa2_bf16 (before its backward followed the kernels): 58% under the RMS of 4,
12.5% under the largest of 7; its flex/anchor case passes under the largest of 8 (worst margin 0.80),
varlen/anchor misses two norm weights at 1.30x.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository


def draws(model: str, variant: str, seq_len: int, policy: str, orders: int, trainer: str | None = None) -> dict:
    from parity_tests.cases import Case, case_inputs
    from parity_tests.grads import errors, oracle_grad_draws, oracle_training, torch_training

    def rel_l2(g, t):
        return errors(g, t)["rel_l2"]

    case = Case(model, variant, "plain", "bf16", trainer or "varlen", seq_len)
    inputs = case_inputs(case)
    t0 = time.perf_counter()
    truth = oracle_training(case, inputs, "fp64", 1)["grads"]
    t_truth = time.perf_counter() - t0
    order0 = oracle_training(case, inputs, policy, 1)["grads"]
    rest = oracle_grad_draws(case, inputs, policy, orders)
    seconds = time.perf_counter() - t0
    names = list(truth)
    out = {"errors": {n: [rel_l2(g[n], truth[n]) for g in (order0, *rest)] for n in names},
           "seconds": {"fp64": round(t_truth, 1), "draws": round(seconds, 1)}}
    if trainer:  # the trainer's bf16 gradient here, as parity_tests.grads computes it, beside the draws
        t1 = time.perf_counter()
        g = torch_training(case, inputs, "bfloat16", trainer, 1)["grads"]
        out["trainer"] = {n: rel_l2(g[n], truth[n]) for n in names}
        out["seconds"]["trainer"] = round(time.perf_counter() - t1, 1)
    out["seconds"]["all"] = round(time.perf_counter() - t0, 1)
    return out


# The two baselines compared: the RMS of the draws (the forward taps' rule, and the gradients' until
# 2026-11-26) and their largest (the gradients' rule since: parity_tests.grads.grad_baseline).
BASELINES = {"rms": lambda X: np.sqrt(np.mean(np.square(X), axis=-1)), "max": lambda X: np.max(X, axis=-1)}


def bound(stat: str, draws) -> np.ndarray:
    """The rule's bound on the trainer's error: 2 × the draws' baseline + 0.001 (parity_tests.core.Rule)."""
    from parity_tests.core import RULE

    return RULE.factor * BASELINES[stat](np.asarray(draws)) + RULE.floor


def trainer_case(errors: dict, trainer: dict, engine: str, variant: str, seq_len: int, orders: int) -> dict:
    """The trainer's errors as a parity.json gradient case for `judged`; `pass` by the suite's gradient rule
    on the first `orders` draws (2 × the largest + 0.001). Each parameter also gets its rank among all the
    draws (`above_draws`: how many draws the trainer's error exceeds): a trainer that computes what the
    emulation computes lands anywhere from 0 to N, as often at N as at 0; one that misses an operation sits
    at N on many parameters."""
    params = [{"param": n, "rel_l2": e, "pass": bool(e <= bound("max", errors[n][:orders])),
               "above_draws": int(sum(e > d for d in errors[n]))} for n, e in trainer.items()]
    return {"id": f"cpu/{variant}/bf16/{engine}/T{seq_len}", "engine": engine, "variant": variant,
            "seq_len": seq_len, "grads": {"params": params}}


def judged(errors: dict, parity: dict, variant: str, seq_len: int, sizes) -> list[dict]:
    """Each gradient case of `parity` (this variant and length) re-judged with the first k draws, k in
    `sizes` (those there are draws for) and all N, by each baseline (`{stat}_orders_0-{k-1}`)."""
    n_draws = len(next(iter(errors.values())))
    sizes = sorted({k for k in sizes if k <= n_draws} | {n_draws})
    out = []
    for g in parity.get("grad_cases", []):
        if g["variant"] != variant or g["seq_len"] != seq_len:
            continue
        row = {"id": g["id"], "engine": g["engine"], "verdicts": {}}
        for stat in BASELINES:
            for k in sizes:
                fails, worst = [], 0.0
                for r in g["grads"]["params"]:
                    margin = r["rel_l2"] / float(bound(stat, errors[r["param"]][:k]))
                    worst = max(worst, margin)
                    if margin > 1:
                        fails.append(r["param"])
                row["verdicts"][f"{stat}_orders_0-{k - 1}"] = {"fail": len(fails), "worst_margin": round(worst, 3),
                                                               "failing": fails[:12]}
        row["in_report"] = {"fail": sum(not r["pass"] for r in g["grads"]["params"]),
                            "baseline": "its own run's baseline (the machine the oracle ran on)"}
        row["largest_errors"] = sorted(
            ({"param": r["param"], "trainer": round(r["rel_l2"], 4),
              "draws": [round(e, 4) for e in errors[r["param"]]]} for r in g["grads"]["params"]),
            key=lambda x: -x["trainer"] / max(float(np.max(x["draws"])), 1e-12))[:8]
        out.append(row)
    return out


def null_rule(errors: dict, sizes) -> dict:
    """The rule's false alarms on a trainer that computes exactly what the emulation computes: each draw
    in turn taken as the trainer and judged against every set of k of the other draws (all of them, no
    sampling), k in `sizes` and N - 1, by 2 × the set's RMS + 0.001 (`2_rms_of_k`) and by 2 × its largest
    + 0.001 (`2_max_of_k`). Per rule and set size: the share of parameters failed, the mean number of
    parameters failed per case, and the share of cases failed (a case fails when one parameter does)."""
    from itertools import combinations

    E = np.asarray(list(errors.values()))  # [parameters, draws]
    P, N = E.shape
    out = {"draws": N, "parameters": P}
    for k in sorted({*sizes, N - 1}):
        if k >= N:
            continue
        for stat in BASELINES:
            fails, cases, failed_cases = 0, 0, 0
            for j in range(N):
                others = [i for i in range(N) if i != j]
                for subset in combinations(others, k):
                    f = int((E[:, j] > bound(stat, E[:, list(subset)])).sum())
                    fails, cases, failed_cases = fails + f, cases + 1, failed_cases + (f > 0)
            out[f"2_{stat}_of_{k}"] = {"share_of_parameters_failed": fails / (cases * P),
                                       "parameters_failed_per_case": fails / cases,
                                       "cases_failed": failed_cases / cases}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--variant", default="anchor")
    ap.add_argument("--seq-len", type=int, default=1025)
    ap.add_argument("--policy", default="fa2_bf16")
    ap.add_argument("--orders", type=int, default=8)
    ap.add_argument("--parity", help="a parity.json whose gradient cases to set beside the draws")
    ap.add_argument("--trainer", metavar="ENGINE",
                    help="also the trainer's bf16 gradient on ENGINE on this machine (e.g. sdpa on the CPU), "
                         "set beside the draws as a gradient case")
    ap.add_argument("--from", dest="recorded", metavar="FILE",
                    help="judge again the draws (and trainer errors) recorded in FILE, an earlier --out of this "
                         "script, instead of computing them: its model, variant, length, policy and orders")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from anchor_core.atomic import write_text_atomic
    from anchor_core.machine import machine
    from parity_tests.core import RULE

    if args.recorded:
        old = json.loads(Path(args.recorded).read_text())
        for k in ("model", "variant", "seq_len", "policy", "orders"):
            setattr(args, k, old[k])
        if args.trainer and args.trainer != old.get("trainer_engine"):
            ap.error(f"{args.recorded}: holds no trainer errors for --trainer {args.trainer} "
                     f"(it has {old.get('trainer_engine') or 'none'})")
        args.trainer = old.get("trainer_engine")
        d = {k: old[k] for k in ("errors", "seconds", "trainer", "machine") if k in old}
    else:
        d = draws(args.model, args.variant, args.seq_len, args.policy, args.orders, args.trainer)
        d["machine"] = machine()
    result = {"what": "the emulation's gradient error against fp64 in each summation order (experiments/grad_baseline/grad_draws.py)",
              "model": args.model, "variant": args.variant, "seq_len": args.seq_len, "policy": args.policy,
              "orders": args.orders, "machine": d["machine"], "seconds": d["seconds"], "errors": d["errors"]}
    result["null_rule"] = null_rule(d["errors"], (RULE.orders, RULE.grad_orders))
    print("the rule on a draw of the emulation itself:", json.dumps(result["null_rule"]))
    parity = json.loads(Path(args.parity).read_text()) if args.parity else {"grad_cases": []}
    if args.trainer:
        result["trainer_engine"], result["trainer"] = args.trainer, d["trainer"]
        case = trainer_case(d["errors"], d["trainer"], args.trainer, args.variant, args.seq_len, RULE.grad_orders)
        parity["grad_cases"] = [*parity["grad_cases"], case]
        ranks = [p["above_draws"] for p in case["grads"]["params"]]
        result["trainer_rank_histogram"] = {
            "what": "how many parameters' trainer error exceeds k of the draws, k = 0 … orders",
            "counts": np.bincount(ranks, minlength=args.orders + 1).tolist()}
        print("trainer above k draws, k = 0 …", result["trainer_rank_histogram"]["counts"])
    if parity["grad_cases"]:
        result["parity"] = args.parity or "--trainer " + args.trainer
        result["cases"] = judged(d["errors"], parity, args.variant, args.seq_len,
                                 (RULE.orders, RULE.grad_orders, args.orders))
        for c in result["cases"]:
            print(c["id"], json.dumps(c["verdicts"]))
    write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({d['seconds']['all']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
