"""RoPE's phase reduced mod 2π (`rope_phase: mod2pi`, jaxref.rope.angles) and the shipped remedies paper_bf16_phase32
and paper_bf16_phase64, at positions past a million (2^20 + odd offsets), against the same arithmetic in float64."""

from __future__ import annotations

import numpy as np
import pytest

from anchor_core.errors import InputError
from anchor_core.spec import RopeSpec
from jaxref import rope as R
from jaxref.policy import get_policy

POS = np.arange(0, 97) + 2 ** 20  # past a million
HEAD_DIM = 46


def _inv_freq32(base: float) -> np.ndarray:
    return np.asarray(R.inv_freq(RopeSpec(base=base), HEAD_DIM, dtype=np.float32)[0], np.float64)


@pytest.mark.parametrize("base", [1e4, 5e5, 5e6, 1e8])
def test_the_reduced_phase_is_the_float32_frequencies_exact_angle_to_an_ulp_of_pi(base):
    """mod2pi: the angle of the float32 frequencies, formed exactly (float64) and reduced, then rounded once to
    float32: within an ulp of π of the exact reduced angle (plain float32: up to position · inv_freq's ulp)."""
    f = _inv_freq32(base)
    exact = np.remainder(POS[:, None].astype(np.float64) * f + np.pi, 2 * np.pi) - np.pi
    reduced = np.asarray(R.angles(POS, f.astype(np.float32), np.float32, "mod2pi"), np.float64)
    plain = np.asarray(R.angles(POS, f.astype(np.float32), np.float32), np.float64)
    wrap = lambda a: np.abs(np.remainder(a - exact + np.pi, 2 * np.pi) - np.pi)  # noqa: E731  (distance on the circle)
    ulp_pi = np.spacing(np.float32(np.pi))
    print(f"\nbase {base:g}: reduced {wrap(reduced).max():.2e} rad, plain float32 {wrap(plain).max():.2e} rad")
    assert wrap(reduced).max() <= ulp_pi
    assert wrap(plain).max() > 1000 * ulp_pi  # what the remedy removes


def test_the_shipped_remedies_against_fp64():
    """At 2^20: the float32 phase lowers the table's error, not to float32's (its frequencies stay float32); the
    float64 phase with float64 frequencies leaves only the table's float32 rounding."""
    truth = np.asarray(R.rope_tables(RopeSpec(base=1e4), HEAD_DIM, POS, get_policy("fp64"))[0])
    err = {name: np.abs(np.asarray(R.rope_tables(RopeSpec(base=1e4), HEAD_DIM, POS, get_policy(name))[0], np.float64)
                        - truth).max()
           for name in ("paper_bf16", "paper_bf16_phase32", "paper_bf16_phase64")}
    print("\n", err)
    assert err["paper_bf16_phase64"] <= 2 * np.spacing(np.float32(1))
    assert err["paper_bf16_phase32"] < err["paper_bf16"]
    assert err["paper_bf16_phase64"] < 1e-4 * err["paper_bf16"]


def test_rope_phase_is_a_policy_key():
    p = get_policy("paper_bf16_phase32")
    assert (p.rope_phase, p.rope_angle) == ("mod2pi", "float32") and p.to_dict()["rope_phase"] == "mod2pi"
    assert get_policy(p.to_dict()) == p
    assert "rope_phase" not in get_policy("paper_bf16").to_dict()  # records of other policies unchanged
    with pytest.raises(InputError, match="unknown rope_phase 'exact'"):
        get_policy({"base": "paper_bf16", "rope_phase": "exact"})


def test_the_forward_key_tells_apart_what_changes_a_forward_and_only_that():
    """Programs that run forwards (the audit's maps and error budget) are shared by `DtypePolicy.forward_key`: the
    RoPE phase and FP8 linears change the forward; the backward and linear_grad do not."""
    from parity_tests.audit.budget import policy_key
    from parity_tests.audit.maps import MapsRunner

    key = get_policy
    for a, b in (("paper_bf16", "paper_bf16_phase32"), ("fa2_bf16", "torchao_rowwise_bf16"),
                 ("torchao_rowwise_bf16", "torchao_tensorwise_bf16")):
        assert MapsRunner._policy_key(key(a)) != MapsRunner._policy_key(key(b)), (a, b)
        assert policy_key(key(a)) != policy_key(key(b)), (a, b)
    assert MapsRunner._policy_key(key("fa2_bf16")) == MapsRunner._policy_key(key("flex_bf16"))  # backward only
    same_forward = key({"base": "torchao_rowwise_bf16", "linear_grad": "e5m2"})
    assert MapsRunner._policy_key(same_forward) == MapsRunner._policy_key(key("torchao_rowwise_bf16"))
