"""Running cases: the trainer's taps (a runner) against the oracle's (fp64 truth and an emulation).

    from parity_tests import Case, run_case, run_parity
    result = run_case(Case("random:llama", "anchor", "tags", "bf16", "sdpa", 97))
    result["pass"], result["first_divergence"]      # e.g. False, {"layer": 1, "tap": "q", ...}

`run_case` runs a case's runner and `judge_case` pairs its taps with their references (the one place that
does, for torchtrain's engines, transformers' stacks and users' functions alike: parity_tests.hf_stack
judges its rows here); runners (parity_tests.runners) and the comparison (parity_tests.core) know nothing
of each other.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from anchor_core.errors import InputError
from anchor_core.machine import machine
from anchor_core.parts import Parts
from anchor_core.progress import ProgressBar
from parity_tests import grads as grad_parity
from parity_tests.cases import BF16, Case, CaseInputs, case_inputs
from parity_tests.core import RULE, Rule, hold
from parity_tests.grads import OPTIMIZER, where_grads
from parity_tests.runners import Runner, Taps, get_runner, oracle, resolve_policy

TRUTH = "fp64"


def run_case(case: Case, rule: Rule = RULE, *, runner: Runner | None = None) -> dict[str, Any]:
    """Compare one case, layer by layer. Returns the case's entry of parity.json (`judge_case`)."""
    t0 = time.perf_counter()
    runner = runner or get_runner(case.engine)
    why = runner.available()
    if why:
        raise InputError(why)
    oracle_policy, dtype = resolve_policy(case.policy, runner)
    inputs = case_inputs(case)
    test = runner.run(case, inputs, dtype)
    return judge_case(case, runner, inputs, test, dtype, rule, t0=t0)


def judge_case(case: Case, runner: Runner, inputs: CaseInputs, test: Taps, dtype: str, rule: Rule = RULE, *,
               t0: float | None = None) -> dict[str, Any]:
    """A runner's taps of a case held against the oracle (runners.oracle, of `runner.oracle_model(case)`):
    fp64 truth, and the policy's emulation over `rule.orders` summation orders in bf16 (core.hold).

    Keys: id, model, variant, layout, policy (the oracle policy held against), requested_policy,
    engine, dtype, seq_len, windows, rows, layers (parity_tests.core.compare, judged), pass,
    first_divergence, failures, worst_margin, fidelity (bf16 cases), summary, runtime_s.
    """
    t0 = time.perf_counter() if t0 is None else t0
    if "logits" not in test:
        raise ValueError(f"runner {runner.name!r} returned no logits")
    oracle_policy, _ = resolve_policy(case.policy, runner)
    model = runner.oracle_model(case)
    bf16 = dtype == "bfloat16"
    truth = oracle(model, inputs, case.variant, TRUTH, positions=inputs.positions)
    baseline = [oracle(model, inputs, case.variant, oracle_policy, k, positions=inputs.positions)
                for k in range(rule.orders if bf16 else 1)]
    verdict = hold(test, truth, inputs, bf16=bf16, baseline=baseline, rule=rule)
    if runner.name != case.engine:  # a runner passed in directly (tests): name the case after it
        case = dataclasses.replace(case, engine=runner.name)
    result: dict[str, Any] = {
        "id": case.id,
        "model": case.model,
        "variant": case.variant,
        "layout": case.layout,
        "policy": oracle_policy,
        "requested_policy": case.policy,
        "engine": case.engine,
        "dtype": dtype,
        "seq_len": case.seq_len,
        "windows": int(inputs.shape[0]),
        "seed": case.seed,
        "rows": list(inputs.rows),
        "truth": TRUTH,
        "baseline_orders": rule.orders if bf16 else 1,
        **verdict,
    }
    result["runtime_s"] = round(time.perf_counter() - t0, 3)
    return result


def build_cases(model: str, *, variants: Sequence[str], layouts: Sequence[str], policies: Sequence[str],
                engines: Sequence[str], seq_lens: Sequence[int], seed: int = 0) -> list[Case]:
    """The cross product of the CLI's options, validated (unknown engines and policies are InputErrors)."""
    for e in engines:
        why = get_runner(e).available()
        if why:
            raise InputError(f"--engines: {why}")
    for p in policies:
        if p != BF16:
            resolve_policy(p, get_runner(engines[0]))
    return [Case(model, v, lay, p, e, T, seed=seed) for T in seq_lens for v in variants for lay in layouts
            for p in policies for e in engines]


def run_parity(cases: Iterable[Case], rule: Rule = RULE, *, progress: bool = False, grads: bool = False,
               parts: Parts | None = None, key: Any = None) -> dict[str, Any]:
    """Run every case (grouped by inputs, so the oracle runs once per inputs and policy); with
    `grads`, also each case's gradients and AdamW steps (parity_tests.grads).

    parts: where each finished case is kept (anchor_core.parts, `parts_dir(out)` from the CLI) and taken from
      when an earlier run (killed, or kept by `anchor parity --keep-parts`) with the same `key` (the run's
      settings, code, versions and device; each part's key adds its case) finished
      it: nothing finished is lost. Results are then in the form they read back in (`anchor_core.parts.normal`).

    Returns {"cases": [...], "grad_cases": [...] (with grads), "pass": bool, "rule": ..., "runtime_s": ...,
    and "reused": {"cases", "grad_cases", "seconds"} when parts of an earlier run were taken}.
    """
    t0 = time.perf_counter()
    cases = sorted(cases, key=lambda c: (c.data_key, c.policy, c.engine))
    bar = ProgressBar("parity", len(cases) * (2 if grads else 1), progress)
    results, grad_results = [], []
    reused = {"cases": 0, "grad_cases": 0, "seconds": 0.0}

    parts = parts or Parts(None, "parity")

    def kept(kind: str, i: int, case: Case, run: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], str]:
        """The case's result: an earlier run's part, or run now (and kept); with a note for the bar."""
        r, taken = parts.kept(f"{kind}-{i}", {"run": key, "case": dataclasses.asdict(case), "kind": kind}, run)
        if not taken:
            return r, ""
        reused[f"{kind}s"] += 1
        reused["seconds"] += r["runtime_s"]
        return r, ", finished by an earlier run"

    try:
        for i, case in enumerate(cases):
            bar.describe(case.id, log=False)
            r, note = kept("case", i, case, lambda case=case: run_case(case, rule))
            results.append(r)
            verdict = "pass" if r["pass"] else f"FAIL at {_where(r['first_divergence'])}"
            bar.advance(1, f"{case.id}: {verdict} ({r['runtime_s']:.1f} s{note})")
            if grads:
                bar.describe(f"{case.id} gradients", log=False)
                g, note = kept("grad_case", i, case, lambda case=case: grad_parity.run_grad_case(case, rule))
                grad_results.append(g)
                verdict = "pass" if g["pass"] else f"FAIL at {where_grads(g['first_divergence'])}"
                bar.advance(1, f"{case.id} gradients and steps: {verdict} ({g['runtime_s']:.1f} s{note})")
    finally:
        bar.close()
    out: dict[str, Any] = {"cases": results}
    if grads:
        out["grad_cases"] = grad_results
        out["optimizer"] = OPTIMIZER.to_dict()

    out.update({
        "pass": all(r["pass"] for r in results + grad_results),
        "rule": rule.to_dict(),
        "machine": machine(),
        "runtime_s": round(time.perf_counter() - t0, 2),
    })
    if reused["cases"] or reused["grad_cases"]:
        out["reused"] = {**reused, "seconds": round(reused["seconds"], 2)}
    return out


def _where(first: dict[str, Any] | None) -> str:
    if first is None:
        return "-"
    layer = first["layer"]
    return f"{'layer ' + str(layer) if isinstance(layer, int) else layer} / {first['tap']}"


where = _where


def describe(result: dict[str, Any]) -> str:
    """A printable table of a case: rel. L2 / tolerance per layer and tap (what a test prints before asserting)."""
    names = [n for n in ("embed", "q", "k", "scores", "probs", "attn_out", "mlp_out", "hidden", "logits")
             if any(n in e["taps"] for e in result["layers"])]
    lines = [f"{result['id']}: {'pass' if result['pass'] else 'FAIL at ' + where(result['first_divergence'])}"
             f"  (trainer {result['dtype']} vs fp64; tol from {result['policy']})",
             "layer   " + " ".join(f"{n:>17}" for n in names)]
    for e in result["layers"]:
        cells = []
        for n in names:
            err = e["taps"].get(n)
            cells.append(" " * 17 if err is None else
                         f"{err['rel_l2']:.1e}/{err['tol']:.1e}{'!' if not err['pass'] else ' '}".rjust(17))
        lines.append(f"{str(e['layer']):<8}" + " ".join(cells))
    return "\n".join(lines)
