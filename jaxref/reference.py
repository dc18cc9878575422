"""The reference decoder: what every dtype policy means, stage by stage, as plain pure functions.

This file is the specification the fast executor (`jaxref.executor`, behind `jaxref.forward`) is held
to (tests/jaxref/test_reference.py). It reads top to bottom: params, the stages in the order a token
meets them (embed, norm, projection, RoPE, scores, mask, softmax, p·v, MLP, head), then one layer and
the forward. Each stage rounds where the policy's stage dtype says (docs/DESIGN.md §4); nothing here
is planned, batched, shared between policies or run in a native kernel, and nothing is cut for speed:
every attention row sees every key, every layer runs in a Python loop.

Legend: B batch, T query slots, S key slots (S = T), H hidden, N query heads, K kv heads,
G = N // K query heads per kv head, D head dim, F MLP width, V vocab, L layers, R tapped query rows.

Params (Hugging Face (out, in) layout, each layer weight stacked on a leading L axis):
  embed [V,H], final_norm [H], lm_head [V,H] (absent when tied),
  layers: attn_norm [L,H], mlp_norm [L,H], wq [L,N*D,H], wk/wv [L,K*D,H], wo [L,H,N*D],
          bq [L,N*D], bk/bv [L,K*D] (Qwen2 only), q_norm/k_norm [L,D] (Qwen3 only),
          w_gate/w_up [L,F,H], w_down [L,H,F].

What the presets do at each stage, read from the functions below (`jaxref.policy.PRESETS`):
  fp64, fp32   every stage in that dtype; dense attention.
  hf_bf16      weights, residual stream, RoPE table and rotation, q/k/v, logits, probabilities and the
               head in bf16; norm statistics, RoPE angles, softmax and every accumulator in fp32;
               dense attention (`dense_attention`).
  fa2_bf16     hf_bf16 with fp32 logits and FlashAttention-2's online softmax over key blocks of 128
               (`online_attention`); flex_bf16 has the same forward (its backward differs, and this
               file is the forward only).
  paper_bf16   fa2_bf16 with the RoPE table and rotation in fp32 (q and k rounded to bf16 after RoPE).
  fa2_bf16_1pass  fa2_bf16 with every key of a row in one block.
  sdpa_cpu_bf16_*  fa2_bf16 over key blocks of 512 whose exponential is torch's fast `fexp_u20` on whole
               vectors of 8 (avx2) or 16 (avx512) lanes, exp on the rest (`softmax_exp`).
  torchao_*_bf16  fa2_bf16 with the decoder layers' linear products in FP8 (`projection`, `jaxref.fp8`).
  te_fp8       FP8 linear products and FP8 q, k, v and probabilities (`fp8_operands`, `pv`) around an online
               softmax in fp32.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from anchor_core.spec import ModelSpec
from jaxref import fp8
from jaxref import rope as rope_lib
from jaxref.attention import fexp_u20, fp8_operands, round_probs, wide, wide_einsum
from jaxref.policy import DtypePolicy, get_policy
from jaxref.variants import Variant, allowed, check_variant
from jaxref.variants import positions as variant_positions

Params = dict[str, Any]

LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
"""{Hugging Face name inside `model.layers.<i>.`: the key of the stacked [L, ...] array in params["layers"]}."""


def params_from_state(spec: ModelSpec, state: dict[str, np.ndarray], dtype=jnp.float32) -> Params:
    """Hugging Face-named numpy state dict → the params pytree above, in `dtype` (float32: exact for
    the stored float32 weights; float64 for parameters updated in fp64, as the oracle's optimizer
    steps are)."""
    layers: dict[str, list[np.ndarray]] = {}
    for i in range(spec.num_layers):
        for hf, ours in LAYER_NAMES.items():
            name = f"model.layers.{i}.{hf}"
            if name in state:
                layers.setdefault(ours, []).append(state[name])
    params: Params = {
        "embed": jnp.asarray(state["model.embed_tokens.weight"], dtype),
        "final_norm": jnp.asarray(state["model.norm.weight"], dtype),
        "layers": {k: jnp.asarray(np.stack(v), dtype) for k, v in layers.items()},
    }
    if not spec.tie_embeddings:
        params["lm_head"] = jnp.asarray(state["lm_head.weight"], dtype)
    return params


def default_doc_ids(B: int, T: int, variant: str) -> np.ndarray:
    """One document over the whole window (slot 0 is the anchor, doc 0, in the anchor variant)."""
    doc = np.ones((B, T), dtype=np.int32)
    if variant == "anchor":
        doc[:, 0] = 0
    return doc


def window_inputs(spec: ModelSpec, tokens, positions, doc_ids, variant: Variant):
    """A forward's inputs as numpy arrays: (tokens [B,T], positions [B,T], doc_ids [B,T], seq_len, squeeze).

    tokens [T] gains B = 1 (`squeeze`: drop it from the logits); doc_ids default to one document over the
    window, positions to the variant's (`jaxref.positions`); seq_len is the length dynamic RoPE scales by
    (max position + 1), None for other RoPE kinds."""
    tokens = np.asarray(tokens)
    squeeze = tokens.ndim == 1
    tokens = tokens.reshape(-1, tokens.shape[-1])
    B, T = tokens.shape
    doc_ids = default_doc_ids(B, T, variant) if doc_ids is None else np.asarray(doc_ids).reshape(B, T)
    pos = variant_positions(doc_ids, variant) if positions is None else np.asarray(positions).reshape(B, T)
    seq_len = int(pos.max()) + 1 if spec.rope.kind == "dynamic" else None
    return tokens, pos, doc_ids, seq_len, squeeze


# ---------------------------------------------------------------------------------------------
# The stages, in the order a token meets them


def embed(params: Params, tokens_BT, policy: DtypePolicy):
    """Embedding lookup: the table in `param`, the rows cast to `act`. Returns h [B,T,H]."""
    return params["embed"].astype(policy.dtype("param"))[tokens_BT].astype(policy.dtype("act"))


def rms_norm(x_BTH, w_H, eps: float, norm, out, param):
    """Hugging Face RMSNorm over the last axis (H, or D for Qwen3's per-head q/k norms): statistics in
    `norm`, cast to `out` *before* the weight multiply (LlamaRMSNorm: `weight * x.to(input_dtype)`)."""
    x = x_BTH.astype(norm)
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    x = (x * jax.lax.rsqrt(var + jnp.asarray(eps, norm))).astype(out)
    return (w_H.astype(param) * x).astype(out)


def linear(x_BTI, w_OI, b_O, act, param):
    """`x @ wᵀ (+ b)`: x in `act`, w and b in `param`, accumulated in fp32 when an operand is 16-bit (as
    torch's matmuls do: `wide_einsum`), the bias added to the accumulator, the result rounded to `act`."""
    y = wide_einsum("BTI,OI->BTO", x_BTI.astype(act), w_OI.astype(param), wide(act))
    if b_O is not None:
        y = y + b_O.astype(param).astype(y.dtype)
    return y.astype(act)


def projection(x_BTI, w_OI, b_O, policy: DtypePolicy):
    """A decoder layer's linear product: `linear` in `act`/`param`, or, where the policy sets `linear_in`, its
    FP8 form (`jaxref.fp8.linear`: both operands through FP8 with the policy's scaling, the product of the
    dequantized values in fp32, rounded to `act`; `linear_grad` gives it the recipe's backward)."""
    act, param = policy.dtype("act"), policy.dtype("param")
    if policy.linear_in is None:
        return linear(x_BTI, w_OI, b_O, act, param)
    return fp8.linear(x_BTI, w_OI, b_O, act, param, policy.linear_in, policy.linear_grad, policy.scaling)


def rope(x_BTND, cos_BTD, sin_BTD, spec: ModelSpec, policy: DtypePolicy):
    """RoPE's rotation `x·cos + rotate(x)·sin` in `rope_apply` (docs/DESIGN.md §3); the tables come from
    `rope_tables` (angles in `rope_angle`, cos/sin in `rope_table`)."""
    return rope_lib.apply(x_BTND, cos_BTD, sin_BTD, spec.rope.layout, policy.dtype("rope_apply"))


def scores(q_BTND, k_BSKD, policy: DtypePolicy, scale: float):
    """Scaled logits [B,K,G,T,S]: q·kᵀ of operands rounded to `qk_in`, accumulated in `qk_acc`, rounded to
    `logits`, then times the unrounded scale in the logits' wide dtype and rounded again (torch's
    `bf16_tensor * python_float`). Query head n reads kv head n // G (transformers' GQA)."""
    B, T, N, D = q_BTND.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    # the G query heads of a kv head as G·T rows (M) of one product per (B, K): the shape the executor's
    # products have, so that XLA sums each dot in the same order (tests/jaxref/test_reference.py)
    q_BKMD = jnp.transpose(q_BTND.astype(policy.dtype("qk_in")).reshape(B, T, K, N // K, D),
                           (0, 2, 3, 1, 4)).reshape(B, K, N // K * T, D)
    k_BKSD = jnp.transpose(k_BSKD.astype(policy.dtype("qk_in")), (0, 2, 1, 3))
    s = wide_einsum("BKMD,BKSD->BKMS", q_BKMD, k_BKSD, policy.dtype("qk_acc")).reshape(B, K, N // K, T, S)
    logits = policy.dtype("logits")
    s = s.astype(logits)
    return (s.astype(wide(logits)) * jnp.asarray(scale, wide(logits))).astype(logits)


def visible(doc_ids_BT, q_slots_R, k_slots_S, variant: Variant):
    """The mask (docs/DESIGN.md §2: `jaxref.variants.allowed`) of query slots R against key slots S.
    Returns bool [B,1,1,R,S], broadcasting over the kv heads and the query heads of a group."""
    doc_q = doc_ids_BT[:, q_slots_R][:, :, None]
    doc_k = doc_ids_BT[:, k_slots_S][:, None, :]
    return allowed(doc_q, doc_k, q_slots_R[:, None], k_slots_S[None, :], variant)[:, None, None]


def softmax(s_BKGRS, mask, policy: DtypePolicy):
    """Softmax over a whole row in `softmax`, masked keys −inf (exp gives 0). Returns probabilities in
    `softmax`. Every row sees at least its own slot, so no row is all −inf."""
    x = jnp.where(mask, s_BKGRS.astype(policy.dtype("softmax")), -jnp.inf)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def pv(p_BKGTS, v_BSKD, policy: DtypePolicy):
    """p·v: probabilities and values rounded to `pv_in`, accumulated in `pv_acc` (as `scores`, the G query
    heads of a kv head as G·T rows of one product). Where the probabilities are FP8 (`probs`, or unset,
    `pv_in`), they go through FP8 scaled by their bound 1 (`jaxref.fp8.probs`). Returns [B,T,K,G,D]."""
    pv_in = policy.dtype("pv_in")
    B, K, G, T, S = p_BKGTS.shape
    v_BKSD = jnp.transpose(v_BSKD.astype(pv_in), (0, 2, 1, 3))
    p = round_probs(p_BKGTS, policy)
    ctx_BKMD = wide_einsum("BKMS,BKSD->BKMD", p.reshape(B, K, G * T, S), v_BKSD, policy.dtype("pv_acc"))
    return jnp.transpose(ctx_BKMD.reshape(B, K, G, T, -1), (0, 3, 1, 2, 4))


def dense_attention(q_BTND, k_BSKD, v_BSKD, doc_ids_BT, variant: Variant, policy: DtypePolicy, scale: float):
    """Hugging Face eager/sdpa attention: all logits of a row, one softmax, p rounded to `pv_in`, p·v.
    Returns ctx [B,T,N,D] in `pv_acc`."""
    B, T, N, D = q_BTND.shape
    slots = jnp.arange(T)
    p = softmax(scores(q_BTND, k_BSKD, policy, scale), visible(doc_ids_BT, slots, slots, variant), policy)
    return pv(p, v_BSKD, policy).reshape(B, T, N, D)


def softmax_exp(x, policy: DtypePolicy):
    """The online softmax's exp of shifted scores x [..., keys of one block] under `policy.exp`: `exact` is
    the softmax dtype's exp; `fexp_u20` (float32 only) is torch's fast exponential on the block's whole
    vectors of `policy.lanes` keys and exp on the keys after the last whole vector (the kernel's scalar
    loop)."""
    if policy.exp == "fexp_u20" and x.dtype == jnp.float32:
        n = x.shape[-1]
        in_vector = jnp.arange(n) < (n // policy.lanes) * policy.lanes
        return jnp.where(in_vector, fexp_u20(x), jnp.exp(x)).astype(x.dtype)
    return jnp.exp(x)


def online_attention(q_BTND, k_BSKD, v_BSKD, doc_ids_BT, variant: Variant, policy: DtypePolicy, scale: float):
    """FlashAttention-2's forward: the keys in blocks of `policy.kv_block`; per block the scaled logits in
    `softmax`, the running max m and sum l in `softmax`, p = exp(s − m) rounded to `pv_in` *before* p·v
    (l sums the unrounded p), the accumulator in `pv_acc` rescaled by exp(m_old − m_new), and one
    division by l at the end. Returns ctx [B,T,N,D] in `pv_acc`."""
    B, T, N, D = q_BTND.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    sm, acc_dtype = policy.dtype("softmax"), policy.dtype("pv_acc")
    m = jnp.full((B, K, N // K, T), -jnp.inf, sm)
    l = jnp.zeros((B, K, N // K, T), sm)
    acc = jnp.zeros((B, T, K, N // K, D), acc_dtype)
    blk = min(policy.kv_block, S)
    for s0 in range(0, S, blk):
        keys = jnp.arange(s0, min(s0 + blk, S))
        s = scores(q_BTND, k_BSKD[:, keys], policy, scale).astype(sm)
        s = jnp.where(visible(doc_ids_BT, jnp.arange(T), keys, variant), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)  # a row that sees nothing yet: exp(−inf − 0) = 0
        p = softmax_exp(s - m_safe[..., None], policy)
        correction = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)  # [B,K,G,T]
        l = l * correction + jnp.sum(p, axis=-1)
        acc = acc * _per_slot(correction).astype(acc_dtype) + pv(p, v_BSKD[:, keys], policy)
        m = m_new
    return (acc / _per_slot(l).astype(acc_dtype)).reshape(B, T, N, D)


def _per_slot(x_BKGT):
    """[B,K,G,T] → [B,T,K,G,1], to scale the accumulator [B,T,K,G,D] row by row."""
    return jnp.transpose(x_BKGT, (0, 3, 1, 2))[..., None]


def attention(q_BTND, k_BSKD, v_BSKD, doc_ids_BT, variant: Variant, policy: DtypePolicy, scale: float):
    """`policy.attention`'s arithmetic: `dense` or `online` (the forward; `policy.backward` names only
    how gradients are formed). Returns ctx [B,T,N,D] in `pv_acc`."""
    if policy.attention == "online":
        return online_attention(q_BTND, k_BSKD, v_BSKD, doc_ids_BT, variant, policy, scale)
    return dense_attention(q_BTND, k_BSKD, v_BSKD, doc_ids_BT, variant, policy, scale)


def silu_mul(g, u, act):
    """`silu(g) * u`; elementwise math in fp32 for 16-bit activations (as torch's kernels do), rounded per op."""
    hi = wide(act)
    s = jax.nn.silu(g.astype(hi)).astype(act)
    return (s.astype(hi) * u.astype(hi)).astype(act)


def mlp(x_BTH, lp: Params, policy: DtypePolicy):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, every product and result in `act`. Returns [B,T,H]."""
    gate = projection(x_BTH, lp["w_gate"], None, policy)
    up = projection(x_BTH, lp["w_up"], None, policy)
    return projection(silu_mul(gate, up, policy.dtype("act")), lp["w_down"], None, policy)


def head(h_BTH, params: Params, spec: ModelSpec, policy: DtypePolicy):
    """The final norm (statistics in `norm`, result in `head`) and the lm-head (tied to the embedding
    where the spec says so) in `head`. Returns (normed [B,T,H], logits [B,T,V])."""
    head_dt, param = policy.dtype("head"), policy.dtype("param")
    x = rms_norm(h_BTH, params["final_norm"], spec.rms_norm_eps, policy.dtype("norm"), head_dt, param)
    w = params["embed"] if spec.tie_embeddings else params["lm_head"]
    return x, linear(x, w, None, head_dt, param)


# ---------------------------------------------------------------------------------------------
# One layer, then the forward


def layer(h_BTH, lp: Params, spec: ModelSpec, policy: DtypePolicy, variant: Variant, cos, sin, doc_ids_BT,
          tap_rows=None):
    """One pre-norm block: `h + attn(norm(h))`, then `h + mlp(norm(h))`, each sum rounded to `act`.

    Args:
      h_BTH: the residual stream in `act`; lp: one layer's slice of params["layers"] (wq [N*D,H], ...).
      cos, sin: RoPE tables [B,T,D]; doc_ids_BT: int; tap_rows: query slots R to tap, or None.

    Returns:
      (h [B,T,H], taps): q [B,T,N,D], k [B,T,K,D] after RoPE (and FP8, as attention reads them); attn_out, mlp_out, hidden [B,T,H]; with
      tap_rows, scores [B,N,R,S] (unmasked) and probs [B,N,R,S] (the dense softmax, 0 where masked).
    """
    act, param, norm, eps = policy.dtype("act"), policy.dtype("param"), policy.dtype("norm"), spec.rms_norm_eps
    B, T, _ = h_BTH.shape
    N, K, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    scale = D ** -0.5
    x = rms_norm(h_BTH, lp["attn_norm"], eps, norm, act, param)
    q = projection(x, lp["wq"], lp.get("bq"), policy).reshape(B, T, N, D)
    k = projection(x, lp["wk"], lp.get("bk"), policy).reshape(B, T, K, D)
    v = projection(x, lp["wv"], lp.get("bv"), policy).reshape(B, T, K, D)
    if spec.qk_norm:  # Qwen3: each head's q and k RMS-normed over D before RoPE (Qwen3Attention)
        q = rms_norm(q, lp["q_norm"], eps, norm, act, param)
        k = rms_norm(k, lp["k_norm"], eps, norm, act, param)
    q, k = rope(q, cos, sin, spec, policy), rope(k, cos, sin, spec, policy)
    q, k, v = fp8_operands(q, k, v, policy)
    ctx = attention(q, k, v, doc_ids_BT, variant, policy, scale).astype(act)
    attn_out = projection(ctx.reshape(B, T, N * D), lp["wo"], None, policy)
    h = (h_BTH + attn_out).astype(act)
    mlp_out = mlp(rms_norm(h, lp["mlp_norm"], eps, norm, act, param), lp, policy)
    h = (h + mlp_out).astype(act)
    taps = dict(q=q, k=k, attn_out=attn_out, mlp_out=mlp_out, hidden=h)
    if tap_rows is not None:
        rows = jnp.asarray(tap_rows)
        s = scores(q[:, rows], k, policy, scale)  # [B,K,G,R,S]
        p = softmax(s, visible(doc_ids_BT, rows, jnp.arange(T), variant), policy)
        taps.update(scores=s.reshape(B, N, len(tap_rows), T), probs=p.reshape(B, N, len(tap_rows), T))
    return h, taps


def decoder(params: Params, tokens_BT, pos_BT, doc_ids_BT, *, spec: ModelSpec, policy: DtypePolicy,
            variant: Variant, tap_rows: tuple[int, ...] | None = None, seq_len: int | None = None):
    """The decoder over arrays: embed, the layers in order, the head.

    Args: tokens_BT int; pos_BT int64 positions; doc_ids_BT int; spec, a DtypePolicy and a checked
    variant; tap_rows: query slots to tap; seq_len: the length dynamic RoPE scales by (None otherwise).

    Returns:
      (logits [B,T,V] in `head`, taps): every tap of `forward`, the per-layer ones stacked on [L, ...].
    """
    cos, sin = rope_lib.rope_tables(spec.rope, spec.head_dim, pos_BT, policy, seq_len=seq_len)
    h = h_embed = embed(params, tokens_BT, policy)
    per_layer: list[dict] = []
    for i in range(spec.num_layers):
        lp = {name: w[i] for name, w in params["layers"].items()}
        h, taps = layer(h, lp, spec, policy, variant, cos, sin, doc_ids_BT, tap_rows)
        per_layer.append(taps)
    x, logits = head(h, params, spec, policy)
    taps = {name: jnp.stack([t[name] for t in per_layer]) for name in per_layer[0]}
    taps.update(embed=h_embed, final_norm=x, logits=logits)
    return logits, taps


_decoder_jit = jax.jit(decoder, static_argnames=("spec", "policy", "variant", "tap_rows", "seq_len"))


def forward(params: Params, spec: ModelSpec, tokens, positions=None, doc_ids=None, variant: str = "full",
            policy: DtypePolicy | str = "fp32", *, taps: bool = False, tap_rows=None):
    """The reference forward, with `jaxref.forward`'s inputs and outputs (no probe, no fused kernel).

    Args:
      params, spec: from `jaxref.load_model`; tokens: int [B,T] (or [T]).
      positions: int [B,T]; default `jaxref.positions(doc_ids, variant)`.
      doc_ids: int [B,T] (docs/DESIGN.md §1); default one document (anchor at slot 0 for `anchor`).
      variant: `full`, `intra_doc`, `intra_doc_reset` or `anchor`; policy: a DtypePolicy or its name.
      taps: also return the taps: q, k [L,B,T,N|K,D]; attn_out, mlp_out, hidden [L,B,T,H]; embed,
        final_norm [B,T,H]; logits [B,T,V]; with `tap_rows` (R query slots) scores, probs [L,B,N,R,T].

    Returns:
      logits [B,T,V] in the policy's `head` dtype, or (logits, taps) with `taps`.
    """
    variant, policy = check_variant(variant), get_policy(policy)
    tokens, pos, doc_ids, seq_len, squeeze = window_inputs(spec, tokens, positions, doc_ids, variant)
    rows = None if tap_rows is None else tuple(int(r) for r in tap_rows)
    run = partial(_decoder_jit, spec=spec, policy=policy, variant=variant, tap_rows=rows, seq_len=seq_len)
    logits, tapped = run(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(pos, jnp.int64),
                         jnp.asarray(doc_ids, jnp.int32))
    if squeeze:
        logits = logits[0]
    return (logits, tapped) if taps else logits
