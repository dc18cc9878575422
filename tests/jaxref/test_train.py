"""The oracle's training math against the trainer's: loss and gradients (`jaxref.value_and_grad`)
against transformers' autograd under torchtrain's loss, and one optax AdamW step (`jaxref.adamw`)
against torch.optim.AdamW over `torchtrain.training.optim.param_groups`.

Torch "in float64" is the float32-built model after `.double()`: transformers still runs its
RMSNorm statistics, eager softmax and RoPE angles in float32 and torchtrain's loss casts the logits
to float32, so it is fp64 truth only to ~1e-6; the tolerance says so.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import torch

import jaxref
import torchtrain
from anchor_core.data.batch import make_batch
from anchor_core.weights import expected_shapes
from tests.jaxref.layouts import random_layout
from torchtrain.config import TrainConfig
from torchtrain.training.optim import param_groups

B, T = 2, 97
GRAD_TOL = 1e-5       # relative L2 per parameter (measured: <= 7e-7 fp64 vs double, <= 2e-6 fp32 vs float32)
LOSS_TOL = 1e-6       # relative
ADAMW_TOL = 1e-6      # relative L2 of each parameter's update

_MODELS: dict[str, tuple] = {}


def oracle(name: str):
    if name not in _MODELS:
        _MODELS[name] = jaxref.load_model(name)
    return _MODELS[name]


def batch(spec, variant: str, seed: int = 0):
    """B windows of several documents (one-token ones included), padding and a two-slot domain tag."""
    rng = np.random.default_rng(seed)
    seg = np.stack([random_layout(rng, T, "anchor") for _ in range(B)])
    tag = np.zeros((B, T), np.int32)
    for b in range(B):
        first = int(np.argmax(seg[b] == 2))
        tag[b, first:first + 2] = seg[b, first:first + 2] == 2
    tokens = rng.integers(3, spec.vocab_size, (B, T))
    return make_batch(tokens, seg, tag, variant)


def torch_value_and_grad(name: str, dtype: str, bt, variant: str):
    """torchtrain's loss on transformers' logits and its autograd gradients {HF name: float64}."""
    model = torchtrain.build_model(name, engine="eager", dtype="float32")
    if dtype == "float64":
        model = model.double()
    out = model(input_ids=torch.as_tensor(bt.tokens, dtype=torch.long),
                position_ids=torch.as_tensor(bt.positions, dtype=torch.long),
                doc_ids=torch.as_tensor(bt.doc_ids), variant=variant)
    loss, _ = torchtrain.next_token_loss(out.logits, torch.as_tensor(bt.tokens), torch.as_tensor(bt.loss_mask))
    loss.backward()
    return loss.item(), {n: p.grad.double().numpy() for n, p in model.named_parameters()}


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-300))


# fp64 against torch's double for every variant on Llama and two on Qwen2 (tied embeddings, qkv
# biases) and Qwen3 (q/k norms); fp32 against torch's float32 where the loss must equal torchtrain's to
# its rounding.
# make test: every variant on Llama in fp64, each family once in fp64 and Llama in fp32; the rest in make test-all.
_FAST = {("random:llama", v, "fp64") for v in jaxref.VARIANTS} | {("random:qwen2", "full", "fp64"),
                                                                  ("random:qwen3", "anchor", "fp64"),
                                                                  ("random:llama", "anchor", "fp32")}
CASES = [pytest.param(*c, marks=[] if c[:3] in _FAST else [pytest.mark.slow]) for c in
         [("random:llama", v, "fp64", "float64") for v in jaxref.VARIANTS]
         + [(name, v, "fp64", "float64") for name in ("random:qwen2", "random:qwen3") for v in ("full", "anchor")]
         + [(name, "anchor", "fp32", "float32") for name in ("random:llama", "random:qwen2", "random:qwen3")]]


@pytest.mark.parametrize("name,variant,policy,torch_dtype", CASES)
def test_loss_and_grads_match_torch(name, variant, policy, torch_dtype):
    params, spec = oracle(name)
    bt = batch(spec, variant)
    loss, grads = jaxref.value_and_grad(params, spec, bt.tokens, bt.positions, bt.doc_ids, bt.loss_mask,
                                        variant=variant, policy=policy)
    ref_loss, ref = torch_value_and_grad(name, torch_dtype, bt, variant)
    assert {k: v.shape for k, v in grads.items()} == expected_shapes(spec)
    assert set(grads) == set(ref)
    assert ("lm_head.weight" in grads) == (name == "random:llama")  # the Qwen presets tie their embeddings
    assert all(g.dtype == (np.float64 if policy == "fp64" else np.float32) for g in grads.values())
    errs = {n: rel(grads[n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    print(f"{name} {variant} {policy} vs torch {torch_dtype}: loss {loss:.10f} vs {ref_loss:.10f} "
          f"(rel {loss_err:.2e}); grad rel L2 max {errs[worst]:.2e} ({worst}), "
          f"median {np.median(list(errs.values())):.2e}")
    assert loss_err <= LOSS_TOL
    assert errs[worst] <= GRAD_TOL


def test_defaults_and_empty_mask():
    """Defaults as `jaxref.forward`'s (one document, every slot but the last counts); nothing counted is 0."""
    params, spec = oracle("random:llama")
    bt = batch(spec, "full")
    loss, _ = jaxref.value_and_grad(params, spec, bt.tokens)
    full_mask = np.ones((B, T), np.int32)
    full_mask[:, -1] = 0
    logits = torch.as_tensor(np.array(jaxref.forward(params, spec, bt.tokens, variant="full")))
    ref, count = torchtrain.next_token_loss(logits, torch.as_tensor(bt.tokens), torch.as_tensor(full_mask))
    print(f"default batch: loss {loss:.8f} vs next_token_loss on the oracle's logits {ref.item():.8f}, "
          f"{int(count)} targets")
    assert int(count) == B * (T - 1)
    assert abs(loss - ref.item()) <= LOSS_TOL * abs(ref.item())
    loss, grads = jaxref.value_and_grad(params, spec, bt.tokens, loss_mask=np.zeros((B, T), np.int32))
    assert loss == 0.0 and all(not g.any() for g in grads.values())


def test_hf_state_inverts_params_from_state():
    for name in ("random:llama", "random:qwen2", "random:qwen3"):
        params, spec = oracle(name)
        state = jaxref.hf_state(params, spec)
        assert {k: v.shape for k, v in state.items()} == expected_shapes(spec)
        assert ("lm_head.weight" in state) == (not spec.tie_embeddings)
        back = jaxref.params_from_state(spec, state)
        assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
        leaves = zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back))
        assert all(np.array_equal(a, b) for a, b in leaves)


@pytest.mark.parametrize("name", ["random:llama", "random:qwen2"])
def test_adamw_matches_torch(name):
    """Two steps of `jaxref.adamw` (optax) against torch.optim.AdamW over the trainer's param
    groups, in float64, fed the same gradients; then a zero-gradient step decays only weights."""
    lr, betas, eps, wd = 1e-3, (0.9, 0.95), 1e-8, 0.1
    cfg = TrainConfig(model={"name": name}, data={"path": "unused"}, schedule={"steps": 2},
                      optim={"lr": lr, "betas": betas, "eps": eps, "weight_decay": wd})
    model = torchtrain.build_model(name, engine="eager", dtype="float32").double()
    torch_opt = torch.optim.AdamW(param_groups(model, cfg.optim), lr=lr, betas=betas, eps=eps)
    named = dict(model.named_parameters())
    hf = {n: p.detach().numpy().copy() for n, p in named.items()}
    opt = jaxref.adamw(lr, betas=betas, eps=eps, weight_decay=wd, no_decay=cfg.optim.no_decay)
    state = opt.init(hf)
    rng = np.random.default_rng(1)
    for step in range(2):
        grads = {n: rng.standard_normal(p.shape) * 1e-2 for n, p in hf.items()}
        before = {n: p.detach().numpy().copy() for n, p in named.items()}
        for n, p in named.items():
            p.grad = torch.as_tensor(grads[n])
        torch_opt.step()
        updates, state = opt.update(grads, state, hf)
        hf = {n: np.asarray(p) for n, p in optax.apply_updates(hf, updates).items()}
        errs = {n: rel(hf[n] - before[n], p.detach().numpy() - before[n]) for n, p in named.items()}
        worst = max(errs, key=errs.get)
        print(f"{name} AdamW step {step}: update rel L2 max {errs[worst]:.2e} ({worst}), "
              f"median {np.median(list(errs.values())):.2e}")
        assert errs[worst] <= ADAMW_TOL
    # From fresh moments a zero gradient moves nothing but the decay: p -= lr * wd * p, not for norms and biases.
    updates, _ = opt.update({n: np.zeros_like(p) for n, p in hf.items()}, opt.init(hf), hf)
    for n, u in updates.items():
        if any(s in n for s in cfg.optim.no_decay):
            assert not np.asarray(u).any(), n
        else:
            np.testing.assert_allclose(u, -lr * wd * hf[n], rtol=1e-12, err_msg=n)
    assert not np.asarray(updates["model.layers.0.input_layernorm.weight"]).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_optimizer_step_is_the_op_by_op_step_to_the_last_bits(dtype):
    """`jaxref.optimizer_step` (one compiled program) against optax run op by op: three steps with a
    schedule, odd sizes, decayed and undecayed names, gradients over ten decades. Each element gets
    the same operations, up to XLA fusing a multiply and an add into one FMA (one rounding fewer).
    Measured on this test's draws: a step moves a parameter at most 2, 3.25, 4 units in the last place
    of its larger term (|p| or |update|) away from the op-by-op step at steps 1, 2, 3; held to 2 per
    step taken. A wrong schedule step, decay mask or moment would miss by ~|update|, 1e3-1e7 units."""
    rng = np.random.default_rng(7)
    params = {"model.layers.0.mlp.up_proj.weight": rng.standard_normal((515, 97)).astype(dtype),
              "model.layers.0.input_layernorm.weight": rng.standard_normal(1025).astype(dtype),
              "model.layers.0.self_attn.q_proj.bias": rng.standard_normal(97).astype(dtype)}
    tx = jaxref.adamw(lambda s: 1e-3 * (1 + s), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    step = jaxref.optimizer_step(tx)
    eager, eager_state = dict(params), tx.init(params)
    fused, fused_state = dict(params), tx.init(params)
    for k in range(1, 4):
        grads = {n: (rng.standard_normal(p.shape) * 10.0 ** rng.uniform(-8, 2, p.shape)).astype(dtype)
                 for n, p in params.items()}
        before = eager
        updates, eager_state = tx.update(grads, eager_state, eager)
        eager = {n: np.asarray(v) for n, v in optax.apply_updates(eager, updates).items()}
        fused, fused_state = step(grads, fused_state, fused)
        fused = {n: np.asarray(v) for n, v in fused.items()}
        for n in params:
            assert fused[n].dtype == dtype
            ulp = np.spacing(np.maximum(np.abs(before[n]), np.abs(np.asarray(updates[n]))))
            assert np.all(np.abs(fused[n] - eager[n]) <= 2 * k * ulp), (k, n)
            assert not np.array_equal(eager[n], before[n]), (k, n)  # every parameter moved


def ce_loss_np(logits, tokens, loss_mask) -> float:
    """The mean counted cross-entropy in float64 numpy (the definition, for finite differences)."""
    z = np.asarray(logits, np.float64)[:, :-1]
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, tokens[:, 1:, None].astype(np.int64), -1)[..., 0]
    counted = loss_mask[:, :-1].astype(bool)
    return float(nll[counted].sum() / counted.sum())


@pytest.mark.parametrize("name,variant", [("random:llama", "anchor"),  # the other two in make test-all
                                          pytest.param("random:qwen2", "intra_doc_reset", marks=pytest.mark.slow),
                                          pytest.param("random:qwen3", "intra_doc", marks=pytest.mark.slow)])
def test_fp64_grads_match_finite_differences(name, variant):
    """fp64 truth without torch's float32 internals: the gradient's derivative along a random
    direction against a central difference of `jaxref.forward`'s fp64 loss (step 1e-6: truncation
    ~5e-9 relative, rounding ~1e-10)."""
    params, spec = oracle(name)
    bt = batch(spec, variant, seed=3)
    loss, grads = jaxref.value_and_grad(params, spec, bt.tokens, bt.positions, bt.doc_ids, bt.loss_mask,
                                        variant=variant, policy="fp64")
    rng = np.random.default_rng(4)
    direction = {n: rng.standard_normal(g.shape) for n, g in grads.items()}
    d_tree = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), jaxref.params_from_state(spec, direction))
    h = 1e-6

    def loss_at(step: float) -> float:
        moved = jax.tree_util.tree_map(lambda p, d: np.asarray(p, np.float64) + step * d, params, d_tree)
        logits = jaxref.forward(moved, spec, bt.tokens, bt.positions, bt.doc_ids, variant=variant, policy="fp64")
        return ce_loss_np(logits, bt.tokens, bt.loss_mask)

    # params_from_state rounds the direction to float32: use the rounded one on both sides.
    d_hf = {n: np.asarray(v, np.float64) for n, v in jaxref.hf_state(d_tree, spec).items()}
    analytic = sum(float(np.vdot(grads[n], d_hf[n])) for n in grads)
    numeric = (loss_at(h) - loss_at(-h)) / (2 * h)
    err = abs(analytic - numeric) / abs(numeric)
    print(f"{name} {variant} fp64: loss {loss:.12f} (forward: {loss_at(0.0):.12f}); directional derivative "
          f"{analytic:.10e} vs central difference {numeric:.10e}: rel {err:.2e}")
    assert abs(loss - loss_at(0.0)) <= 1e-12 * abs(loss)
    assert err <= 1e-7


def test_bf16_policy_grads_carry_the_rounding():
    """Under hf_bf16 the gradient goes through the policy's casts: finite, near fp64 truth, farther than fp32's."""
    params, spec = oracle("random:llama")
    bt = batch(spec, "anchor")
    args = (params, spec, bt.tokens, bt.positions, bt.doc_ids, bt.loss_mask)
    errs = {}
    _, truth = jaxref.value_and_grad(*args, variant="anchor", policy="fp64")
    for policy in ("fp32", "hf_bf16"):
        _, grads = jaxref.value_and_grad(*args, variant="anchor", policy=policy)
        assert all(np.isfinite(g).all() and g.dtype == np.float32 for g in grads.values())
        errs[policy] = max(rel(grads[n], truth[n]) for n in truth)
    print(f"max grad rel L2 vs fp64: fp32 {errs['fp32']:.2e}, hf_bf16 {errs['hf_bf16']:.2e}")
    assert errs["fp32"] < 1e-5 < errs["hf_bf16"] < 0.5


@pytest.mark.parametrize("policy", ["fp64", pytest.param("fa2_bf16", marks=pytest.mark.slow)])
def test_remat_recomputes_layers_and_gives_the_same_gradients(policy):
    """`remat` (the default) recomputes each layer in the backward: the differentiated program runs
    the layer's products again (more dot_generals than when every layer's activations are kept),
    and gives the same loss and gradients, bit for bit."""
    params, spec = oracle("random:llama")
    bt = batch(spec, "anchor", seed=5)
    args = (params, spec, bt.tokens, bt.positions, bt.doc_ids, bt.loss_mask)
    kept = jaxref.value_and_grad(*args, variant="anchor", policy=policy, remat=False)
    again = jaxref.value_and_grad(*args, variant="anchor", policy=policy)
    assert kept[0] == again[0]
    assert set(kept[1]) == set(again[1])
    assert all(np.array_equal(kept[1][n], again[1][n]) for n in kept[1])

    from jaxref.train import _value_and_grad

    def program(remat: bool) -> str:
        return str(jax.make_jaxpr(lambda p: _value_and_grad(
            p, bt.tokens.astype(np.int32), bt.positions.astype(np.int64), bt.doc_ids.astype(np.int32),
            bt.loss_mask.astype(np.int32), spec=spec, policy=jaxref.get_policy(policy), variant="anchor",
            seq_len=None, remat=remat))(params))

    dots = {r: program(r).count("dot_general[") for r in (True, False)}
    assert dots[True] > dots[False], dots
