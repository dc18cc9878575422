"""The error budget accounts for the bf16 D: cumulative raises telescope to D − D_fp64, all raised is fp64."""

from __future__ import annotations

import numpy as np
import pytest

import jaxref
from parity_tests.audit import budget_plan, error_budget
from parity_tests.audit.budget import BUDGET_STAGES


def test_budget_plan_shapes():
    base = jaxref.get_policy("hf_bf16")
    plan = budget_plan(base)
    assert [s for s, _ in plan["cumulative"]] == list(BUDGET_STAGES)  # all stages: no "others" step
    assert list(plan["raise"]) == list(BUDGET_STAGES)
    last = plan["cumulative"][-1][1]
    assert all(getattr(last, s) == "float64" for s in BUDGET_STAGES)
    # lowered alone: only stages hf_bf16 keeps below fp32; each differs from fp32 in exactly one stage
    assert set(plan["lower"]) == {s for s in BUDGET_STAGES if getattr(base, s) != "float32"}
    for s, p in plan["lower"].items():
        assert [t for t in BUDGET_STAGES if getattr(p, t) != "float32"] == [s]
    sub = budget_plan(base, ["qk_in", "act"])
    assert [s for s, _ in sub["cumulative"]] == ["act", "qk_in", "others"]  # pipeline order, then the rest
    assert all(getattr(sub["cumulative"][-1][1], s) == "float64" for s in BUDGET_STAGES)


# Every stage one by one is ~33 compiled policies (the CLI default); the test attributes the stages
# where hf_bf16 rounds on the attention path one by one and the rest together ("others").
STAGES = ("act", "rope_table", "rope_apply", "qk_in", "logits")


@pytest.mark.parametrize("policy", ["hf_bf16"])
def test_budget_accounts_for_D(policy):
    params, spec = jaxref.load_model("random:smollm2")
    rng = np.random.default_rng(0)
    toks = rng.integers(3, 259, size=(1, 41)).astype(np.int32)
    toks[:, 0] = spec.first_token_id
    eb = error_budget(params, spec, toks, jaxref.get_policy(policy), 0, 16, stages=STAGES)
    st = eb["stages"]
    assert eb["cumulative_order"] == [*STAGES, "others"]
    print({k: (v["raise_alone_contribution"], v["cumulative_contribution"]) for k, v in st.items()})
    print(f"D {eb['D']}, fp32 {eb['D_fp32']}, fp64 {eb['D_fp64']}, all raised {eb['D_all_raised']}")
    assert eb["D"] > 1e3 * max(eb["D_fp32"], 1e-12)
    assert eb["D_all_raised"] <= 1e-9 and eb["D_fp64"] <= 1e-9
    assert abs(eb["D_all_raised"] - eb["D_fp64"]) <= 1e-9
    # the cumulative contributions telescope: they sum to D − D_all_raised (≈ D − D_fp64)
    assert eb["sum_cumulative_contributions"] == pytest.approx(eb["D"] - eb["D_all_raised"], rel=1e-9)
    assert set(st) == set(STAGES) | {"others", "head"}
    assert st["head"]["cumulative_contribution"] == 0.0
    for v in st.values():
        if "raised_alone_D" in v:
            assert v["raise_alone_contribution"] == pytest.approx(eb["D"] - v["raised_alone_D"])
        if "lowered_alone_D" in v:
            assert v["lower_alone_contribution"] == pytest.approx(v["lowered_alone_D"] - eb["D_fp32"])
    # some stage is responsible: lowering it alone from fp32 brings back a bf16-sized D
    assert max(v.get("lower_alone_contribution", 0.0) for v in st.values()) > 0.1 * eb["D"]
