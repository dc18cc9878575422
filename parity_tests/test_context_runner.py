"""The parity suite under context parallelism: `cp<C>:<engine>` (parity_tests.context_runner) runs a torchtrain
engine with each window's slots split over C gloo processes, and its taps of every layer are held against the
fp64 oracle by the same rule as the engine in one process (fp32: the fixed tolerance; bf16: the emulation's
baseline). T = 98 splits into the balanced shares of degree 2 (49 slots: 24 + 25) and T = 100 into those of
degree 4 (25: 12 + 13); both leave odd shares, the documents crossing the rank boundaries. A runner that leaves
the ranks' taps in rank order fails. The spawned cases are slow (`make test-all`)."""

from __future__ import annotations

import re

import pytest

from anchor_core.errors import InputError
from parity_tests.cases import Case
from parity_tests.context_runner import ContextParallelRunner
from parity_tests.runners import get_runner
from parity_tests.suite import describe, run_case

CASES = [(C, T, engine, variant, policy)
         for C, T in ((2, 98), (4, 100)) for engine in ("sdpa", "varlen") for variant in ("intra_doc_reset", "anchor")
         for policy in ("fp32", "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize("C,T,engine,variant,policy", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_context_parallel_runner_holds_against_the_oracle(C, T, engine, variant, policy):
    result = run_case(Case("random:llama", variant, "plain", policy, f"cp{C}:{engine}", T))
    print(describe(result))
    compared = {name for e in result["layers"] for name in e["taps"]}
    assert compared == {"embed", "q", "k", "attn_out", "mlp_out", "hidden", "logits"}
    assert result["pass"], describe(result)


@pytest.mark.slow
@pytest.mark.model
def test_the_default_model_at_context_parallel_2_holds():
    """SmolLM2-135M with its real weights (9 query heads: Ulysses cannot split it over 2), anchor, fp32."""
    result = run_case(Case("default", "anchor", "plain", "fp32", "cp2:varlen", 98))
    print(describe(result))
    assert result["pass"], describe(result)


class RankOrderLeft(ContextParallelRunner):
    """A planted defect: the ranks' taps concatenated in rank order, the balancing's order not undone."""

    def in_slot_order(self, ranks):
        import numpy as np

        return {name: np.concatenate([r["taps"][name].numpy() for r in ranks], axis=2) for name in ranks[0]["taps"]}


@pytest.mark.slow
def test_a_runner_that_leaves_the_rank_order_fails():
    result = run_case(Case("random:llama", "anchor", "plain", "fp32", "cp2:sdpa", 98),
                      runner=RankOrderLeft(2, "sdpa"))
    print(describe(result))
    assert not result["pass"] and result["first_divergence"]["layer"] == "embed"


@pytest.mark.parametrize("name,message", [
    ("cp1:varlen", "cp<C>:<engine>, C >= 2"),
    ("cp2:nope", "cp<C>:<engine>, C >= 2, engine one of"),
    ("cpx:sdpa", "a context-parallel runner is cp<C>:<engine>"),
])
def test_a_malformed_context_parallel_name_is_one_error(name, message):
    with pytest.raises(InputError, match=re.escape(message)):
        get_runner(name)


def test_a_window_the_degree_does_not_split_is_refused_before_any_process_starts():
    with pytest.raises(InputError, match="context_parallel 2 does not split seq_len 97"):
        run_case(Case("random:llama", "anchor", "plain", "fp32", "cp2:sdpa", 97))
