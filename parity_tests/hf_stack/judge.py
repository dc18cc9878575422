"""Judging (the suite's: parity_tests.core.hold, suite.judge_case, runners.oracle): `identify` (which
variant float32 taps compute), `bf16_verdict` (bfloat16 taps by the suite's bf16 rule) and `hold` (one row
of the report: a stack asked for a variant, run and judged).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jaxref
from anchor_core.variants import VARIANTS
from parity_tests.cases import BF16, CaseInputs
from parity_tests.core import RULE, Rule
from parity_tests.core import hold as judged
from parity_tests.hf_stack.inputs import feed_description
from parity_tests.hf_stack.runner import Execute, StackRunner
from parity_tests.hf_stack.stacks import FUNCTION_INPUTS, Stack
from parity_tests.hf_stack.subjects import Subject, subject_inputs
from parity_tests.runners import Taps, oracle
from parity_tests.suite import judge_case


TRUTH = "fp64"
# Taps that say what a stack computed: q/k (its positions), the attention, MLP and hidden outputs (its
# mask) and the logits. The attention rows (scores, probs) are the harness's own reading of q and k
# under the mask asked for, so they are judged in the rule but do not identify a variant.
IDENTIFYING: tuple[str, ...] = ("embed", "q", "k", "attn_out", "mlp_out", "hidden", "logits")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def only(taps: Taps, names: Sequence[str]) -> Taps:
    """The taps named."""
    return {k: v for k, v in taps.items() if k in names}


def identify(test: Taps, subject: Subject, inputs: CaseInputs, asked: str, rule: Rule = RULE) -> dict[str, Any]:
    """Which variant float32 taps compute: each variant's fp64 truth on the same inputs (at that variant's
    positions), judged by the fp32 rule (against the oracle's own fp32 error) on the IDENTIFYING taps. Returns {"computes", "closest",
    "candidates": {variant: {"pass", "worst_margin", "first_divergence"}}}."""
    candidates = {}
    for variant in VARIANTS:
        v = judged(only(test, IDENTIFYING), oracle(subject, inputs, variant, TRUTH), inputs, bf16=False,
                   baseline=[oracle(subject, inputs, variant, "fp32")], rule=rule)
        candidates[variant] = {"pass": v["pass"], "worst_margin": v["worst_margin"],
                               "first_divergence": v["first_divergence"]}
    within = sorted((c["worst_margin"], v) for v, c in candidates.items() if c["pass"])
    closest = min(candidates, key=lambda v: candidates[v]["worst_margin"])
    computes = asked if candidates[asked]["pass"] else (within[0][1] if within else None)
    return {"computes": computes, "closest": closest, "candidates": candidates}


def bf16_verdict(test: Taps, subject: Subject, inputs: CaseInputs, variant: str, emulation: str,
                 rule: Rule = RULE) -> dict[str, Any]:
    """bfloat16 taps of `subject` against fp64 truth of the variant by the suite's bf16 rule (`judge_case`,
    at the variant's positions, scaled from `emulation`): the black-box check's bf16 verdict."""
    runner = StackRunner(Stack(subject.name, subject.name, emulation=emulation), subject)
    inputs = dataclasses.replace(inputs, positions=jaxref.positions(inputs.doc_ids, variant))
    case = runner.case(subject, variant, inputs.shape[1], policy=BF16)
    return judge_case(case, runner, inputs, test, "bfloat16", rule)


def hold(subject: Subject, stack: Stack, variant: str, *, seq_len: int = 97, seed: int = 0,
         dtypes: Sequence[str] = DTYPES, rule: Rule = RULE, execute: Execute | None = None) -> dict[str, Any]:
    """One row of the report: the stack asked for `variant` (see the package docstring), run as a
    `StackRunner` on the suite's case and judged by the suite's `judge_case`.

    execute: what runs the stack's forwards: `run_here` (default) or an `Isolated` child process (so that a
    stack that crashes its process is a row too).
    Returns {implementation, inputs, variant, status, computes, closest, candidates, fp32 (the suite's case
    entry against the variant asked: pass, first_divergence, worst_margin, layers, ...), bf16 (where it
    computes the variant and bfloat16 is in dtypes: the suite's bf16 case entry, policy the emulation),
    error, reason, runtime_s}; status is "computes", "instead" (computes another variant), "none" (none of
    them within the fp32 rule), "error" (error: the exception's first line), "crash" (error: "crashes
    (signal N)") or "not_run".
    """
    t0 = time.perf_counter()
    runner = StackRunner(stack, subject, execute)
    row: dict[str, Any] = {"implementation": stack.name, "inputs": FUNCTION_INPUTS if stack.user else stack.inputs,
                           "variant": variant, "feed": feed_description(stack, variant), "status": None,
                           "computes": None, "closest": None, "candidates": None, "fp32": None, "bf16": None,
                           "error": None, "reason": None}
    if stack.user:
        row.update(rope_in=stack.rope_in, emulation=stack.emulation)
    reason = runner.available()
    if reason:
        row.update(status="not_run", reason=reason)
        return row
    case = runner.case(subject, variant, seq_len, seed)
    inputs = subject_inputs(subject, variant, seq_len, seed)  # the case's inputs (case_inputs, by its data model)
    row["rows"] = list(inputs.rows)
    kind, test = runner.outcome(subject, inputs, variant, "float32")
    if kind != "ok":  # whatever the stack raises, or its process dying, is the finding
        row.update(status=kind, error=test, runtime_s=round(time.perf_counter() - t0, 2))
        return row
    found = identify(test, subject, inputs, variant, rule)
    row.update(computes=found["computes"], closest=found["closest"], candidates=found["candidates"],
               fp32=judge_case(case, runner, inputs, test, "float32", rule),
               status="computes" if found["computes"] == variant else "instead" if found["computes"] else "none")
    if found["computes"] == variant and "bfloat16" in dtypes:
        kind, test16 = runner.outcome(subject, inputs, variant, "bfloat16")
        if kind != "ok":  # a stack that runs in float32 may still fail in bfloat16
            row.update(status=kind, error=f"bfloat16: {test16}")
        else:
            row["bf16"] = judge_case(dataclasses.replace(case, policy=BF16), runner, inputs, test16, "bfloat16", rule)
    row["runtime_s"] = round(time.perf_counter() - t0, 2)
    return row
