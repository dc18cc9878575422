"""The audit's metrics against plain-loop numpy implementations of docs/DESIGN.md §5, and the probe plumbing.

Brute force: `D = Σ_{l,h} Σ_j n_j Σ_i |P_ij(Δ1) − P_ij(Δ2)|` with 1-based `n_j = 1/(L−j+1)`, per-token
the same per j, `D_logit = (1/T) Σ_{l,h} Σ_i |A_i1(Δ1) − A_i1(Δ2)|`, written as loops over every index.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxref
from parity_tests.audit import metrics
from parity_tests.audit.runner import run_pairs, shift_curve


def causal_maps(rng, L, N, T):
    """Random causal softmax maps and logits: ([L,N,T,T] probs, [L,N,T,T] logits)."""
    a = rng.standard_normal((L, N, T, T)) * 3
    mask = np.tril(np.ones((T, T), bool))
    e = np.where(mask, np.exp(a - a.max(axis=-1, keepdims=True)), 0.0)
    return e / e.sum(axis=-1, keepdims=True), a


def brute_D(p1, p2):
    L, N, T, _ = p1.shape
    total = 0.0
    for l in range(L):
        for h in range(N):
            for j1 in range(1, T + 1):  # 1-based as in the paper
                n = 1.0 / (T - j1 + 1)
                s = 0.0
                for i in range(T):
                    s += abs(p1[l, h, i, j1 - 1] - p2[l, h, i, j1 - 1])
                total += n * s
    return total


def brute_per_token(p1, p2):
    L, N, T, _ = p1.shape
    out = np.zeros(T)
    for j1 in range(1, T + 1):
        for l in range(L):
            for h in range(N):
                for i in range(T):
                    out[j1 - 1] += abs(p1[l, h, i, j1 - 1] - p2[l, h, i, j1 - 1]) / (T - j1 + 1)
    return out


def brute_D_logit(a1, a2):
    L, N, T, _ = a1.shape
    s = 0.0
    for l in range(L):
        for h in range(N):
            for i in range(T):
                s += abs(a1[l, h, i, 0] - a2[l, h, i, 0])
    return s / T


@pytest.mark.parametrize("T", [1, 2, 13, 31])
def test_metrics_match_brute_force(T):
    rng = np.random.default_rng(T)
    p1, a1 = causal_maps(rng, 2, 3, T)
    p2, a2 = causal_maps(rng, 2, 3, T)
    d, bd = metrics.attention_difference(p1, p2), brute_D(p1, p2)
    pt, bpt = metrics.per_token_difference(p1, p2), brute_per_token(p1, p2)
    dl, bdl = metrics.logit_difference(a1, a2), brute_D_logit(a1, a2)
    print(f"T={T}: D {d} vs {bd}; max per-token err {np.abs(pt - bpt).max()}; D_logit {dl} vs {bdl}")
    assert d == pytest.approx(bd, rel=1e-12)
    np.testing.assert_allclose(pt, bpt, rtol=1e-12, atol=0)
    assert pt.sum() == pytest.approx(d, rel=1e-12)
    assert dl == pytest.approx(bdl, rel=1e-12)


def test_same_shift_is_exactly_zero():
    rng = np.random.default_rng(0)
    p, a = causal_maps(rng, 2, 2, 9)
    assert metrics.attention_difference(p, p) == 0.0
    assert metrics.logit_difference(a, a) == 0.0
    assert not metrics.per_token_difference(p, p).any()


def test_prefix_rows_give_each_length():
    """D_logit of the first L rows equals D_logit of the maps cut to L (causal: rows never see later slots)."""
    rng = np.random.default_rng(1)
    _, a1 = causal_maps(rng, 2, 3, 40)
    _, a2 = causal_maps(rng, 2, 3, 40)
    rows = metrics.first_key_rows(a1, a2)
    for L in (1, 7, 40):
        assert metrics.d_logit_from_rows(rows, L) == pytest.approx(brute_D_logit(a1[..., :L, :L], a2[..., :L, :L]))


@pytest.fixture(scope="module")
def tiny():
    params, spec = jaxref.load_model("random:llama")
    rng = np.random.default_rng(3)
    toks = rng.integers(3, 259, size=(1, 23)).astype(np.int32)
    toks[:, 0] = spec.first_token_id
    return params, spec, toks


@pytest.mark.parametrize("policy", ["hf_bf16", "fa2_bf16"])
def test_probe_equals_metrics_on_tapped_maps(tiny, policy):
    """The in-forward probe (column sums) gives the same D and D_logit as the map functions on tapped maps."""
    params, spec, toks = tiny
    T = toks.shape[1]
    maps = {}
    for delta in (16, 3):
        _, taps = jaxref.forward(params, spec, toks, positions=np.arange(T)[None] + delta, variant="full",
                                 policy=policy, taps=True, tap_rows=tuple(range(T)))
        maps[delta] = (np.asarray(taps["probs"], np.float64)[:, 0], np.asarray(taps["scores"], np.float64)[:, 0])
    want_D = metrics.attention_difference(maps[3][0], maps[16][0])
    want_logit = metrics.logit_difference(maps[3][1], maps[16][1])
    r = run_pairs(params, spec, toks, [3, 16], 16, jaxref.get_policy(policy))
    got_D = metrics.d_from_colsums(r["col"][:, 0, 0])
    got_logit = metrics.d_logit_from_rows(r["first"][:, 0, 0].sum(axis=0))
    print(f"{policy}: D probe {got_D} vs taps {want_D}; D_logit {got_logit} vs {want_logit}")
    assert want_D > 0
    assert got_D == pytest.approx(want_D, rel=1e-5)
    assert got_logit == pytest.approx(want_logit, rel=1e-5)
    # Δ1 == Δ2 inside one batch: identical inputs, exactly zero.
    assert metrics.d_from_colsums(r["col"][:, 0, 1]) == 0.0
    assert r["first"][:, 0, 1].sum() == 0.0


@pytest.mark.parametrize("preset", ["random:llama", "random:qwen2"])
def test_fp64_audit_is_shift_invariant(preset):
    """Under fp64 the audit's D is ≤ 1e-9 for every shift of the paper's list (odd T = 97)."""
    params, spec = jaxref.load_model(preset)
    rng = np.random.default_rng(5)
    toks = rng.integers(3, 259, size=(1, 97)).astype(np.int32)
    toks[:, 0] = spec.first_token_id
    from parity_tests.audit import PAPER_SHIFTS

    sc = shift_curve(params, spec, toks, jaxref.get_policy("fp64"), PAPER_SHIFTS, 16)
    print(f"{preset} fp64: max D {max(sc['D']):.3g}, max D_logit {max(sc['D_logit']):.3g}")
    assert max(sc["D"]) <= 1e-9
    assert max(sc["D_logit"]) <= 1e-9


def test_windows_start_with_bos_and_differ():
    from parity_tests.audit.sequences import make_windows

    w = make_windows([[5, 6, 7], [8, 9]], first_token=1, eos=2, n=5, T=6)
    print(w)
    assert (w[:, 0] == 1).all()
    assert w[0, 1:].tolist() == [5, 6, 7, 2, 8] and w[1, 1:].tolist() == [8, 9, 2, 5, 6]
    assert len({tuple(r) for r in w}) == 5


def test_walls_are_the_first_shifts_past_twice_the_baselines():
    """Hand curves, shifts out of order: the floor is D at the smallest shift, the walls are the first shifts (in
    increasing order) strictly past twice a baseline, None when never, and the reference reading is absent without
    the reference policy."""
    sc = {
        "fp32": {"shifts": [0, 4096, 8, 65536], "D": [1.0, 2.5, 1.0, 8.0]},
        "bf16": {"shifts": [0, 4096, 8, 65536], "D": [5.0, 5.0, 6.0, 10.0]},
        "flat": {"shifts": [0, 4096, 8, 65536], "D": [2.0, 4.0, 2.0, 2.0]},  # exactly twice: not past
    }
    w = metrics.walls(sc)
    assert w["fp32"]["shifts"] == [0, 8, 4096, 65536] and w["fp32"]["floor"] == 1.0
    assert w["fp32"]["over_floor"] == 4096 and w["fp32"]["over_reference"] is None
    assert w["fp32"]["ratio_to_reference"] == [1.0] * 4
    assert w["bf16"]["over_floor"] is None and w["bf16"]["over_reference"] == 0
    assert w["bf16"]["ratio_to_reference"] == [5.0, 6.0, 2.0, 1.25]
    assert w["flat"]["over_floor"] is None and w["flat"]["over_reference"] is None
    alone = metrics.walls({"bf16": sc["bf16"]})
    assert alone["bf16"]["over_reference"] is None and alone["bf16"]["reference"] is None
    zero = metrics.walls({"fp32": {"shifts": [0, 8], "D": [0.0, 0.0]}, "x": {"shifts": [0, 8], "D": [0.0, 1.0]}})
    assert zero["x"]["ratio_to_reference"] == [1.0, None] and zero["x"]["over_reference"] == 8
    assert zero["x"]["over_floor"] == 8
