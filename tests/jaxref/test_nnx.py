"""jaxref.nnx.Decoder is the pure functions in a Flax NNX shell: same logits as jaxref.forward,
same loss and gradients as jaxref.value_and_grad, and an optax step through nnx.Optimizer."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # half a minute of compiling on 2 cores: make test-all (the pure functions it wraps
#                                are held in make test)

import jax
import numpy as np
import optax
from flax import nnx

import jaxref
from jaxref.nnx import Decoder


def _batch(T: int = 97):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 331, size=(2, T))
    doc_ids = np.sort(rng.integers(1, 5, size=(2, T)), axis=1)
    doc_ids[:, 0] = 0
    positions = np.stack([jaxref.positions(d, "anchor") for d in doc_ids])
    loss_mask = np.ones((2, T), np.int32)
    loss_mask[:, -1] = 0
    return tokens, positions, doc_ids, loss_mask


def test_decoder_matches_the_pure_functions():
    tokens, positions, doc_ids, loss_mask = _batch()
    model = Decoder.load("random:llama", policy="fp64")
    logits = np.asarray(model(tokens, positions, doc_ids, variant="anchor"))
    params, config = jaxref.load_model("random:llama")
    want = np.asarray(jaxref.forward(params, config, tokens, positions=positions, doc_ids=doc_ids, variant="anchor",
                                     policy="fp64"))
    rel = float(np.abs(logits - want).max() / np.abs(want).max())
    print("logits max rel", rel)
    assert rel <= 1e-12  # the same fp64 math, jitted as one program or traced op by op

    grads = nnx.grad(lambda m: m.loss(tokens, positions, doc_ids, loss_mask, variant="anchor"))(model)
    loss = float(model.loss(tokens, positions, doc_ids, loss_mask, variant="anchor"))
    want_loss, want_grads = jaxref.value_and_grad(params, config, tokens, positions=positions, doc_ids=doc_ids,
                                                  loss_mask=loss_mask, variant="anchor", policy="fp64")
    got = jaxref.hf_state(grads["params"].get_value(), config)
    err = max(float(np.linalg.norm(got[k] - want_grads[k]) / np.linalg.norm(want_grads[k])) for k in want_grads)
    print(f"loss {loss} vs {want_loss}; gradients max rel L2 {err:.2e}")
    assert abs(loss - want_loss) <= 1e-12 * abs(want_loss) and err <= 1e-12


def test_optax_step_through_nnx_optimizer():
    tokens, positions, doc_ids, loss_mask = _batch(33)
    model = Decoder.load("random:qwen2", policy="fp32")
    leaves = lambda tree: [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]  # noqa: E731
    before = leaves(model.params.get_value())
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    grads = nnx.grad(lambda m: m.loss(tokens, positions, doc_ids, loss_mask, variant="anchor"))(model)
    opt.update(model, grads)
    after, g = leaves(model.params.get_value()), leaves(grads["params"].get_value())
    assert len(before) == len(after) == len(g)
    worst = max(float(np.abs((b - 0.1 * gr) - a).max()) for b, a, gr in zip(before, after, g))
    print("sgd step max abs error", worst)
    assert worst <= 1e-6 and max(float(np.abs(gr).max()) for gr in g) > 1e-3
