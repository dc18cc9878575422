"""make parity-all's driver: which cases it runs again after the xdist pass."""

from __future__ import annotations

from parity_tests.run_all import outcome, remaining


def test_verbose_lines_are_read_in_both_formats():
    a = "parity_tests/test_matrix.py::test_full_matrix[default-anchor-bf16-sdpa-T515]"
    b = "parity_tests/test_grads.py::test_full_grad_case[random:llama-anchor+tags-bf16-eager-T97]"
    assert outcome(f"[gw1] [ 40%] PASSED {a} ") == (a, "PASSED")
    assert outcome(f"[gw0] [ 99%] FAILED {b}") == (b, "FAILED")
    assert outcome(f"{a} SKIPPED (the embedded SmolLM2 GGUF is not cached) [ 20%]") == (a, "SKIPPED")
    assert outcome(f"{b} PASSED [ 60%]") == (b, "PASSED")
    assert outcome(f"[gw1] node down: Not properly terminated") is None
    assert outcome(f"{a} ") is None  # a case starting: no outcome yet


def test_failed_and_never_reported_cases_run_again_in_order():
    cases = ["t::a", "t::b", "t::c", "t::d", "t::e"]
    seen = {"t::a": "PASSED", "t::c": "FAILED", "t::d": "SKIPPED", "t::e": "ERROR"}
    assert remaining(cases, seen) == ["t::b", "t::c", "t::e"]
    assert remaining(cases, dict.fromkeys(cases, "PASSED")) == []
