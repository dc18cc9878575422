"""benchmarks/merge_parity.py: several `anchor parity` reports (one process a variant on the GPU machine)
as one, in the order `anchor parity` runs its cases, refusing reports of other settings; and its slim form."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from anchor.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("merge_parity", ROOT / "benchmarks" / "merge_parity.py")
mp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mp)


def report(variant: str, passed: bool = True, **over) -> dict:
    def case(engine):
        return {"id": f"default/{variant}/bf16/{engine}/T1025", "variant": variant, "layout": "plain",
                "seq_len": 1025, "policy": "fa2_bf16", "requested_policy": "bf16", "engine": engine, "pass": passed,
                "layers": [{"layer": 0, "taps": {"q": {"rel_l2": 1.23456789e-3, "baseline_rel_l2": 1e-3,
                                                        "tol": 3e-3, "pass": True, "max_abs": 0.5}}}],
                "fidelity": {"big": [1.0] * 10}}

    def grad(engine):
        rows = [{"param": "model.norm.weight", "rel_l2": 0.02, "baseline_rel_l2": 0.01, "tol": 0.021, "pass": True,
                 "max_abs": 0.1, "cosine": 0.99}]
        return {**case(engine), "grads": {"params": rows, "pass": True, "first_divergence": None},
                "step@1": {"params": rows, "pass": True, "first_divergence": None},
                "params@1": {"params": rows, "pass": True, "first_divergence": None}}

    r = {"model": "default", "device": "cuda", "oracle_device": "cpu (cpu)", "rule": {"factor": 2.0},
         "optimizer": {"lr": 1e-3}, "machine": {"gpu": "NVIDIA H200"}, "runtime_s": 100.0, "pass": passed,
         "cases": [case("varlen"), case("flex")], "grad_cases": [grad("varlen"), grad("flex")]}
    r.update(over)
    return r


def test_merged_in_variant_order_and_passing_only_if_all_pass():
    out = mp.merge([("a", report("anchor", runtime_s=120.0)), ("f", report("full")),
                    ("i", report("intra_doc", passed=False))])
    assert [c["variant"] for c in out["cases"]] == ["full", "full", "intra_doc", "intra_doc", "anchor", "anchor"]
    assert [c["engine"] for c in out["cases"][:2]] == ["flex", "varlen"]
    assert len(out["grad_cases"]) == 6 and out["pass"] is False and out["runtime_s"] == 120.0
    assert [m["folder"] for m in out["merged_from"]] == ["a", "f", "i"]
    assert mp.merge([("a", report("anchor")), ("f", report("full"))])["pass"] is True


@pytest.mark.parametrize("over, what", [
    ({"device": "cpu"}, "device differs"),
    ({"rule": {"factor": 3.0}}, "rule differs"),
    ({"oracle_device": "cuda (H200)"}, "oracle_device differs"),
    ({"machine": {"gpu": "NVIDIA H100"}}, "another machine"),
])
def test_a_report_of_other_settings_is_refused(over, what):
    with pytest.raises(InputError, match=what):
        mp.merge([("a", report("anchor")), ("b", report("full", **over))])


def test_a_case_in_two_reports_is_refused():
    with pytest.raises(InputError, match="in more than one report"):
        mp.merge([("a", report("anchor")), ("b", report("anchor"))])


def test_non_finite_numbers_read_back():
    assert mp.numbers({"tol": "inf", "x": ["nan", "-inf", "info"]})["tol"] == float("inf")
    assert mp.numbers(["info"]) == ["info"]  # only the exact words


def test_slim_keeps_the_verdicts_and_drops_the_trajectories():
    s = mp.slim(mp.merge([("a", report("anchor"))]))
    json.dumps(s)
    c, g = s["cases"][0], s["grad_cases"][0]
    assert "fidelity" not in c and c["layers"][0]["taps"]["q"] == {"rel_l2": 0.001235, "baseline_rel_l2": 0.001,
                                                                     "tol": 0.003, "pass": True}
    assert g["grads"]["params"][0] == {"param": "model.norm.weight", "rel_l2": 0.02, "baseline_rel_l2": 0.01,
                                       "tol": 0.021, "pass": True}
    assert g["step@1"] == {"pass": True, "first_divergence": None, "max_rel_l2": 0.02} and "params@1" not in g
