"""New engines and parallel layouts plug in as runners: no change to the comparison code."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.cases import Case
from parity_tests.runners import RUNNERS, Runner, get_runner, oracle_taps, registered
from parity_tests.suite import build_cases, describe, run_case, run_parity

CASE = Case("random:llama", "anchor", "plain", "fp32", "eager", 97)


class ShardedEagerRunner(Runner):
    """A stand-in for a sequence-parallel run: each of two "ranks" holds half of the slots of every
    tap (as an SP run's rank-local taps would), and the runner gathers them back along T."""

    name = "sp2_sharded_eager"
    emulation = "hf_bf16"

    def run(self, case, inputs, dtype):
        full = get_runner("eager").run(case, inputs, dtype)
        T = inputs.shape[1]
        out = {}
        for name, x in full.items():
            axis = x.ndim - 1 if name in ("scores", "probs") else 2  # [L,B,N,R,T] or [L,B,T,...]
            shards = np.array_split(x, 2, axis=axis)
            assert sum(s.shape[axis] for s in shards) == T
            out[name] = np.concatenate(shards, axis=axis)
        return out


class OracleAsTrainer(Runner):
    """The oracle's own fp32 run as a "trainer" giving only hidden states and logits."""

    name = "oracle_fp32_subset"

    def run(self, case, inputs, dtype):
        taps = oracle_taps(case, inputs, "fp32")
        return {"hidden": taps["hidden"], "logits": taps["logits"]}


class PerturbedRunner(Runner):
    """A runner whose layer-1 hidden state is off by 1e-3 (relative): must fail there."""

    name = "perturbed_hidden_layer1"

    def run(self, case, inputs, dtype):
        taps = dict(get_runner("eager").run(case, inputs, dtype))
        taps["hidden"] = taps["hidden"].copy()
        taps["hidden"][1] *= 1.001
        return taps


def test_every_torchtrain_engine_is_registered():
    import torchtrain

    print(sorted(RUNNERS))
    assert set(torchtrain.ENGINES) <= set(RUNNERS)


def test_registered_runner_runs_as_a_case():
    with registered(ShardedEagerRunner()):
        result = run_case(Case(CASE.model, CASE.variant, CASE.layout, "fp32", "sp2_sharded_eager", 97))
        print(describe(result))
        assert result["pass"] and result["engine"] == "sp2_sharded_eager"
        cases = build_cases("random:llama", variants=["anchor"], layouts=["plain"], policies=["fp32", "bf16"],
                            engines=["eager", "sp2_sharded_eager"], seq_lens=[97])
        report = run_parity(cases)
        assert report["pass"] and len(report["cases"]) == 4
    assert "sp2_sharded_eager" not in RUNNERS


def test_a_runner_may_give_a_subset_of_taps():
    with registered(OracleAsTrainer()):
        result = run_case(Case(CASE.model, CASE.variant, CASE.layout, "fp32", "oracle_fp32_subset", 97))
    print(describe(result))
    compared = {name for e in result["layers"] for name in e["taps"]}
    assert compared == {"hidden", "logits"} and result["pass"]


def test_a_perturbed_runner_fails_at_its_layer():
    with registered(PerturbedRunner()):
        result = run_case(Case(CASE.model, CASE.variant, CASE.layout, "fp32", "perturbed_hidden_layer1", 97))
    print(describe(result))
    assert not result["pass"]
    assert (result["first_divergence"]["layer"], result["first_divergence"]["tap"]) == (1, "hidden")


def test_unknown_engine_is_an_input_error():
    from anchor_core.errors import InputError

    with pytest.raises(InputError, match="unknown engine 'nope'"):
        get_runner("nope")


def test_summation_orders_are_the_same_model():
    """oracle_taps(order=k): the model with its hidden and MLP units reordered. In fp64 it is the same
    function (every tap within 1e-12 of the stored order, hidden-axis taps back in the stored order);
    in bf16 the sums round differently (the taps differ), each order as far from fp64 as the other."""
    from parity_tests.cases import case_inputs

    for model in ("random:qwen2", "random:llama", "random:qwen3"):
        case = Case(model, "anchor", "plain", "bf16", "eager", 97)
        inputs = case_inputs(case)
        stored, reordered = oracle_taps(case, inputs, "fp64"), oracle_taps(case, inputs, "fp64", order=3)
        for name in stored:
            err = np.abs(stored[name] - reordered[name]).max() / np.abs(stored[name]).max()
            print(model, name, f"{err:.1e}")
            assert err < 1e-12, name
        a, b = oracle_taps(case, inputs, "hf_bf16"), oracle_taps(case, inputs, "hf_bf16", order=3)
        assert not np.array_equal(a["hidden"], b["hidden"])
        err_a = np.linalg.norm(a["hidden"] - stored["hidden"]) / np.linalg.norm(stored["hidden"])
        err_b = np.linalg.norm(b["hidden"] - stored["hidden"]) / np.linalg.norm(stored["hidden"])
        print(model, "bf16 hidden error, stored order / order 3:", f"{err_a:.2e} / {err_b:.2e}")
        assert 0.5 < err_b / err_a < 2
