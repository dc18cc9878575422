"""The error budget of the precision audit: how much of D(0, 16) under a bf16 policy each stage is
responsible for (docs/DESIGN.md §5).

    plan = budget_plan(get_policy("hf_bf16"))          # the policies to evaluate, by role
    result = error_budget(params, spec, windows, get_policy("hf_bf16"), 0, 16)

Each stage is raised to fp64 alone, raised cumulatively in pipeline order (the increments add up to
D_bf16 - D_fp64 exactly), and lowered alone from fp32 to the policy's dtype. The distinct policies run in
groups that share one compiled program (`budget_groups`, `maps.MapsRunner.run_many`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from anchor_core.errors import InputError
from anchor_core.spec import ModelSpec
from jaxref.policy import PRESETS, STAGES, DtypePolicy
from jaxref.reference import Params
from parity_tests.audit import metrics
from parity_tests.audit.maps import MAP_MEMORY_BUDGET, MEM_BYTES_PER_MAP_ENTRY, MapsRunner

# Stages on the path to the attention maps; `head` (final norm, lm-head) comes after the last one.
BUDGET_STAGES: tuple[str, ...] = tuple(s for s in STAGES if s != "head")


def policy_key(p: DtypePolicy) -> tuple:
    """What makes two policies compute the same forward (their name aside: `DtypePolicy.forward_key`)."""
    return p.forward_key()


def budget_plan(base: DtypePolicy, stages: Sequence[str] = BUDGET_STAGES) -> dict[str, Any]:
    """The policies of the error budget of `base` (a low-precision policy) over `stages`.

    Returns {"base", "fp64", "fp32" (fp32 with base's attention arithmetic), "raise": {stage: policy},
    "cumulative": [(stage, policy)] (stages raised in pipeline order, then "others" = every remaining
    stage at once when `stages` is a subset; the last has all raised), "lower": {stage: policy}} (fp32
    with one stage set to base's dtype; only stages where base is not fp32).
    """
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise InputError(f"unknown policy stage {unknown[0]!r} (valid: {', '.join(STAGES)})")
    stages = [s for s in BUDGET_STAGES if s in stages]  # pipeline order
    fp32 = dataclasses.replace(PRESETS["fp32"], attention=base.attention, kv_block=base.kv_block, exp=base.exp,
                               lanes=base.lanes, name=f"fp32[{base.attention}]")
    raise_one = {s: base.with_stages(**{s: "float64"}) for s in stages}
    cumulative, p = [], base
    for s in stages:
        p = dataclasses.replace(p.with_stages(**{s: "float64"}), name=f"{base.name}[..{s}=float64]")
        cumulative.append((s, p))
    rest = [s for s in BUDGET_STAGES if s not in stages]
    if rest:
        p = dataclasses.replace(p.with_stages(**dict.fromkeys(rest, "float64")), name=f"{base.name}[all=float64]")
        cumulative.append(("others", p))
    lower = {s: fp32.with_stages(**{s: getattr(base, s)}) for s in stages if getattr(base, s) != "float32"}
    return {"base": base, "fp64": PRESETS["fp64"], "fp32": fp32, "raise": raise_one, "cumulative": cumulative,
            "lower": lower}


def budget_runs(plan: dict[str, Any]) -> list[DtypePolicy]:
    """The distinct policies a budget plan evaluates (one D each), in the order `error_budget` evaluates them."""
    ps = [plan["base"], plan["fp64"], plan["fp32"]]
    for s, p in plan["cumulative"]:
        ps.append(p)
        if s in plan["raise"]:
            ps.append(plan["raise"][s])
        if s in plan["lower"]:
            ps.append(plan["lower"][s])
    seen, out = set(), []
    for p in ps:
        if policy_key(p) not in seen:
            seen.add(policy_key(p))
            out.append(p)
    return out


BUDGET_POLICIES_PER_CALL = 11
"""Error-budget policies that share one program (`MapsRunner.run_many`), memory permitting: the 33 of
hf_bf16's budget compile as 3 programs, in about a third of the time of 33 (docs/verbs/audit.md, "What makes it fast")."""


def budget_groups(spec: ModelSpec, runs: Sequence[DtypePolicy], T: int, n: int) -> list[tuple[DtypePolicy, ...]]:
    """The budget's policies in `runs` order, cut into the groups that share a program: at most
    BUDGET_POLICIES_PER_CALL, and as many as the maps of `n` windows of T under two shifts each fit in
    the memory budget (>= 1)."""
    per_policy = MEM_BYTES_PER_MAP_ENTRY * spec.num_heads * T * T * 2 * n
    k = int(max(1, min(BUDGET_POLICIES_PER_CALL, MAP_MEMORY_BUDGET // per_policy)))
    return [tuple(runs[c:c + k]) for c in range(0, len(runs), k)]


def d_pairs(params: Params, spec: ModelSpec, windows: np.ndarray, policies: Sequence[DtypePolicy], delta1: int,
            delta2: int, *, maps: MapsRunner | None = None) -> list[float]:
    """Mean over windows of D(X, Δ1, Δ2) under each policy: every window and policy in one call of one
    program (`MapsRunner.run_many`)."""
    maps = maps or MapsRunner(params, spec, background=False)
    rs = maps.run_many(windows, [delta2, delta1], tuple(policies))
    return [float(np.mean([metrics.d_from_colsums(r["col"][:, s, 0]) for s in range(windows.shape[0])])) for r in rs]


def error_budget(params: Params, spec: ModelSpec, windows: np.ndarray, base: DtypePolicy, delta1: int, delta2: int,
                 tick: Callable[[int], None] = lambda n: None, stages: Sequence[str] = BUDGET_STAGES, *,
                 maps: MapsRunner | None = None) -> dict[str, Any]:
    """How much of D(Δ1, Δ2) under `base` each stage is responsible for (see budget_plan).

    Args: windows int [n, T] (mapped to the params' vocabulary); stages: the stages to attribute
    (a subset is attributed one by one and the rest together as "others").
    """
    plan = budget_plan(base, stages)
    maps = maps or MapsRunner(params, spec, background=False)
    cache: dict[tuple, float] = {}
    n, T = windows.shape
    for group in budget_groups(spec, budget_runs(plan), T, n):
        for p, d in zip(group, d_pairs(params, spec, windows, group, delta1, delta2, maps=maps)):
            cache[policy_key(p)] = d
        tick(2 * n * len(group))

    def D(p: DtypePolicy) -> float:
        return cache[policy_key(p)]

    d_base, d64, d32 = D(plan["base"]), D(plan["fp64"]), D(plan["fp32"])
    stages: dict[str, dict[str, Any]] = {}
    prev = d_base
    for s, p in plan["cumulative"]:
        d_cum = D(p)
        if s == "others":
            stages["others"] = {"dtype": "mixed", "cumulative_D": d_cum, "cumulative_contribution": prev - d_cum,
                                "raise_alone_contribution": None,
                                "note": "the stages not attributed one by one, raised together"}
            prev = d_cum
            continue
        d_raise = D(plan["raise"][s])
        entry = {"dtype": getattr(base, s), "raised_alone_D": d_raise, "raise_alone_contribution": d_base - d_raise,
                 "cumulative_D": d_cum, "cumulative_contribution": prev - d_cum}
        if s in plan["lower"]:
            d_low = D(plan["lower"][s])
            entry.update(lowered_alone_D=d_low, lower_alone_contribution=d_low - d32)
        stages[s] = entry
        prev = d_cum
    stages["head"] = {"dtype": base.head, "raise_alone_contribution": 0.0, "cumulative_contribution": 0.0,
                      "note": "final norm and lm-head come after the last attention map"}
    all_raised = plan["cumulative"][-1][1]
    return {
        "policy": base.name, "delta1": int(delta1), "delta2": int(delta2), "seq_len": int(windows.shape[1]),
        "num_seqs": int(windows.shape[0]), "D": d_base, "D_fp64": d64, "D_fp32": d32,
        "D_all_raised": D(all_raised), "cumulative_order": [s for s, _ in plan["cumulative"]],
        "sum_cumulative_contributions": float(sum(v["cumulative_contribution"] for v in stages.values())),
        "sum_raise_alone_contributions": float(sum(v["raise_alone_contribution"] for k, v in stages.items()
                                                   if k != "others")),
        "stages": stages,
    }
