"""RoPE is relative in exact arithmetic: the oracle's fp64 shows it, its bf16 emulation does not."""

from __future__ import annotations

import numpy as np
import pytest

import jaxref
from tests.jaxref.layouts import random_layout
from tests.jaxref.numerics import rel

T = 515


# make test: SmolLM2's shape (the default model's); Llama and Qwen2 in make test-all
@pytest.fixture(scope="module", params=[pytest.param("random:llama", marks=pytest.mark.slow),
                                        pytest.param("random:qwen2", marks=pytest.mark.slow), "random:smollm2"])
def model(request):
    params, spec = jaxref.load_model(request.param)
    return request.param, params, spec


def test_shift_invariance_holds_in_fp64_only(model):
    name, params, spec = model
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, spec.vocab_size, (2, T))
    doc = np.ones((2, T), np.int32)
    err = {}
    for policy in ("fp64", "hf_bf16"):
        base = jaxref.forward(params, spec, tokens, positions=jaxref.positions(doc, "full"), doc_ids=doc, policy=policy)
        shifted = jaxref.forward(params, spec, tokens, positions=jaxref.positions(doc, "full", shift=1000),
                                 doc_ids=doc, policy=policy)
        err[policy] = rel(shifted, base)
    print(f"{name}: logits(Δ=1000) vs logits(Δ=0): fp64 {err['fp64']:.2e}, hf_bf16 {err['hf_bf16']:.2e}")
    assert err["fp64"] <= 1e-9
    # bf16 breaks the invariance (the paper's §2): by orders of magnitude more than fp64's rounding.
    assert err["hf_bf16"] > 1e3 * max(err["fp64"], 1e-12)


def test_reset_and_continuous_positions_agree_per_document_in_fp64_only(model):
    name, params, spec = model
    rng = np.random.default_rng(1)
    doc = random_layout(rng, T, "intra_doc", min_len=1)[None]
    tokens = rng.integers(3, spec.vocab_size, (1, T))
    worst = {}
    for policy in ("fp64", "hf_bf16"):
        cont = np.asarray(jaxref.forward(params, spec, tokens, doc_ids=doc, variant="intra_doc", policy=policy), np.float64)
        reset = np.asarray(jaxref.forward(params, spec, tokens, doc_ids=doc, variant="intra_doc_reset", policy=policy), np.float64)
        docs = [d for d in np.unique(doc) if d >= 0]
        worst[policy] = max(rel(reset[0, doc[0] == d], cont[0, doc[0] == d]) for d in docs)
    print(f"{name}: {len(docs)} documents, worst per-document rel. diff reset vs continuous: "
          f"fp64 {worst['fp64']:.2e}, hf_bf16 {worst['hf_bf16']:.2e}")
    assert worst["fp64"] <= 1e-9
    assert worst["hf_bf16"] > 1e3 * max(worst["fp64"], 1e-12)
