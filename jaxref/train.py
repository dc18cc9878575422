"""The oracle's training math: the next-token loss with its gradients, and the trainer's AdamW step.

Legend: B batch, T slots, V vocab.

    loss, grads = jaxref.value_and_grad(params, config, tokens, doc_ids=doc_ids, loss_mask=loss_mask,
                                        variant="anchor", policy="fp64")    # grads: {HF name: array}
    opt = jaxref.adamw(1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    hf_params = jaxref.hf_state(params, config)
    state = opt.init(hf_params)
    updates, state = opt.update(grads, state, hf_params)
    hf_params = optax.apply_updates(hf_params, updates)
    # or the same step as one compiled program: step = jaxref.optimizer_step(opt); hf_params, state = step(grads, state, hf_params)

The loss is torchtrain's (`torchtrain.next_token_loss`, docs/DESIGN.md §8): the mean cross-entropy
over the counted targets. The gradient is `jax.grad` through the same forward as `jaxref.forward`
(`jaxref.executor.decoder_forward`), so a policy's rounding casts are differentiated too (each cast's
transpose casts the cotangent back). It traces the JAX attention path (`fused=False`): the fused
CPU kernel (`jaxref.kernels`) has no VJP, and the JAX path is the same arithmetic up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from anchor_core.spec import ModelSpec
from jaxref.executor import decoder_forward
from jaxref.reference import LAYER_NAMES, Params, default_doc_ids
from jaxref.policy import DtypePolicy, get_policy
from jaxref.variants import check_variant
from jaxref.variants import positions as variant_positions


def hf_state(params: Params, config: ModelSpec) -> dict[str, np.ndarray]:
    """The inverse of `params_from_state`: {Hugging Face name: numpy array in HF layout}.

    Names and shapes are `anchor_core.weights.expected_shapes(config)`'s; a tied model has no
    "lm_head.weight" (its one matrix is "model.embed_tokens.weight"). Dtypes are kept.
    """
    state = {"model.embed_tokens.weight": np.asarray(params["embed"]),
             "model.norm.weight": np.asarray(params["final_norm"])}
    if not config.tie_embeddings:
        state["lm_head.weight"] = np.asarray(params["lm_head"])
    layers = {ours: np.asarray(params["layers"][ours]) for ours in LAYER_NAMES.values() if ours in params["layers"]}
    for i in range(config.num_layers):
        for hf, ours in LAYER_NAMES.items():
            if ours in layers:
                state[f"model.layers.{i}.{hf}"] = layers[ours][i]
    return state


def next_token_loss(logits_BTV, tokens_BT, loss_mask_BT, dtype):
    """Mean cross-entropy in `dtype` of the predictions at slots t < T-1 (of tokens[t+1]) where
    loss_mask[t] == 1; 0 when nothing counts (as `torchtrain.next_token_loss`)."""
    counted = loss_mask_BT[:, :-1].astype(bool)                                    # [B, T-1]
    logp = jax.nn.log_softmax(logits_BTV[:, :-1].astype(dtype), axis=-1)          # [B, T-1, V]
    nll = -jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1)[..., 0]     # [B, T-1]
    count = jnp.maximum(jnp.sum(counted), 1).astype(dtype)
    return jnp.sum(jnp.where(counted, nll, jnp.zeros((), dtype))) / count


@partial(jax.jit, static_argnames=("spec", "policy", "variant", "seq_len", "remat"))
def _value_and_grad(params, tokens, pos, doc_ids, loss_mask, *, spec, policy, variant, seq_len, remat):
    # Differentiate at the wider of the stored and the policy's param dtype: fp64 truth gets fp64
    # gradients, a bf16 policy gets its gradients in the stored fp32.
    wide = jax.tree_util.tree_map(lambda p: p.astype(jnp.promote_types(p.dtype, policy.dtype("param"))), params)
    ce = jnp.promote_types(jnp.float32, policy.dtype("head"))

    def loss_fn(p):
        # the JAX attention path: the fused kernel has no VJP
        logits, _ = decoder_forward(p, tokens, pos, doc_ids, spec=spec, policy=policy, variant=variant,
                                    tap=False, tap_rows=None, probe=None, seq_len=seq_len, fused=False,
                                    remat=remat)
        return next_token_loss(logits, tokens, loss_mask, ce)

    return jax.value_and_grad(loss_fn)(wide)


def value_and_grad(params: Params, config: ModelSpec, tokens, positions=None, doc_ids=None, loss_mask=None,
                   variant: str = "full", policy: DtypePolicy | str = "fp32",
                   remat: bool = True) -> tuple[float, dict[str, np.ndarray]]:
    """The mean next-token cross-entropy of a batch and its gradient w.r.t. every parameter.

    Args:
      params: from `load_model` / `params_from_state`.
      config: the ModelSpec.
      tokens: int [B, T] (or [T]).
      positions: int [B, T]; default `jaxref.positions(doc_ids, variant)`.
      doc_ids: int [B, T] (docs/DESIGN.md §1); default one document (anchor at slot 0 for `anchor`).
      loss_mask: int [B, T]; 1 where the prediction at slot t (of tokens[t+1]) counts; the last
        slot never counts. Default: every slot but the last.
      variant: `full`, `intra_doc`, `intra_doc_reset` or `anchor`.
      policy: a DtypePolicy, preset name, YAML path or mapping; the cross-entropy runs in float32
        (float64 when the policy's `head` is float64, as under `fp64`).
      remat: recompute each layer in the backward instead of keeping its activations
        (`decoder_forward`'s `remat`): one layer's memory, the same gradients; False keeps them all.

    Returns:
      (loss, grads): loss a float (0.0 when nothing counts); grads {Hugging Face name: numpy array}
      in HF layout (`hf_state`), float64 under an fp64 `param` stage, else float32; with tied
      embeddings "model.embed_tokens.weight" holds the sum of both uses.
    """
    variant = check_variant(variant)
    policy = get_policy(policy)
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    B, T = tokens.shape
    doc_ids = default_doc_ids(B, T, variant) if doc_ids is None else np.asarray(doc_ids).reshape(B, T)
    pos = variant_positions(doc_ids, variant) if positions is None else np.asarray(positions).reshape(B, T)
    if loss_mask is None:
        loss_mask = np.ones((B, T), np.int32)
    loss_mask = np.asarray(loss_mask).reshape(B, T).astype(np.int32)
    seq_len = int(pos.max()) + 1 if config.rope.kind == "dynamic" else None
    loss, grads = _value_and_grad(
        params, jnp.asarray(tokens, jnp.int32), jnp.asarray(pos, jnp.int64), jnp.asarray(doc_ids, jnp.int32),
        jnp.asarray(loss_mask, jnp.int32), spec=config, policy=policy, variant=variant, seq_len=seq_len,
        remat=remat)
    return float(loss), hf_state(grads, config)


def adamw(lr: float | Callable[[int], float], betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
          weight_decay: float = 0.1, no_decay: Sequence[str] = ("bias", "norm")) -> optax.GradientTransformation:
    """The trainer's AdamW (`torch.optim.AdamW` over `torchtrain.training.optim.param_groups`) in optax.

    Over a dict {Hugging Face name: array} (`hf_state`): bias-corrected moments, `eps` added after
    the square root, decoupled weight decay `p -= lr * weight_decay * p` from the parameter before
    the step, and no decay for names containing any `no_decay` entry. `lr` may be a schedule of
    the 0-based step, e.g. `lambda s: cfg.lr * torchtrain.training.optim.lr_factor(cfg, s)`.
    """
    def decayed(params: dict[str, object]) -> dict[str, bool]:
        return {name: not any(s in name for s in no_decay) for name in params}

    return optax.adamw(lr, b1=betas[0], b2=betas[1], eps=eps, weight_decay=weight_decay, mask=decayed)


def optimizer_step(tx: optax.GradientTransformation) -> Callable:
    """`tx`'s whole step as one compiled program: `step(grads, opt_state, params) -> (params,
    opt_state)`, `tx.update` then `optax.apply_updates`. Run op by op instead, optax dispatches about a
    dozen small programs per parameter and compiles one per operation, shape and dtype (a two-variant
    gradient parity run on random:llama compiled 102 programs that way, 33 with this). No product or
    sum spans elements, so each element gets the same operations; XLA may fuse a multiply and the add
    after it into one FMA (one rounding instead of two), so an element can differ from the op-by-op
    step in the last bits of its larger term
    (`tests/jaxref/test_train.py::test_optimizer_step_is_the_op_by_op_step_to_the_last_bits`)."""
    def step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step)
