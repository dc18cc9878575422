"""The fast executor of the decoder: `jaxref.reference`'s arithmetic, planned and batched for speed.

Legend: B batch, T slots, H hidden, N query heads, K kv heads, D head dim, F MLP width, V vocab,
L layers, R tapped query rows. Params as in `jaxref.reference`.

Every stage rounds where `jaxref.reference` rounds (docs/DESIGN.md §4); what this module adds is how
the work runs, never what it computes (tests/jaxref/test_reference.py holds the two equal, policy by
policy and variant by variant):
  * the layers under one `lax.scan` over the stacked weights (one compiled body, not L copies);
  * the attention by blocks of query rows, each against the keys up to its block (`jaxref.attention`),
    and on the CPU in the fused C++ kernel where it covers the policy (`attention.kernel_args`);
  * the projections in numpy's BLAS on the CPU (`linear`, `jaxref.kernels.matmul`), q|k|v and
    gate|up of one x as one call, one weight for several policies' rows (`linear_many`, planned by
    `layer_steps` and `layers_in_step`): the audit runs the error budget's policies in step
    (parity_tests/audit/maps.py);
  * the audit's probe (`probe`), which reduces whole attention maps inside the layer.
The kernels and the BLAS sum in their own order, so their results are the reference's up to the
accumulator's rounding; with `fused=False` every product runs in XLA.

Public surface: `forward` (numpy in, jitted, the user's entry), `decoder_forward` (the same forward
un-jitted, over arrays, for callers that trace it inside their own `jit`/`grad`), `decoder_layer`
(one block, the body of the layer scan), `layer_steps` (the same block as a generator of its
projections), `layers_in_step` and `linear_many` (one block, or several policies' blocks in step, with
the projections that can share a BLAS call in one; `blas_share_key` says which may).

The fused-kernel switch is an argument, `fused`: `forward` resolves it once (default: the user's
`JAXREF_FUSED_ATTENTION`, `jaxref.kernels.enabled()`) and hands the bool down to the attention and
the projections (`linear`: numpy's BLAS on the CPU).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from anchor_core.spec import ModelSpec
from jaxref import kernels
from jaxref import rope as rope_lib
from jaxref import fp8
from jaxref.attention import attention, fp8_operands, full_probs, row_scores_probs, wide, wide_einsum
from jaxref.policy import DtypePolicy, get_policy
from jaxref.reference import Params, embed, rms_norm, silu_mul, window_inputs
from jaxref.variants import Variant, check_variant

Probe = Callable[[jax.Array, jax.Array], Any]


def linear(x_BTI, w_OI, b_O, act, param, fused: bool = False):
    """`x @ wᵀ (+ b)`: operands in `act`/`param`, fp32 accumulation for 16-bit activations, result in `act`.

    With `fused`, on the CPU, the product runs in numpy's BLAS (`jaxref.kernels.matmul`) where the
    operands widen exactly to the accumulator (fp32 or fp64): the same products, summed in BLAS's order
    instead of XLA's (an ulp of the accumulator).
    """
    x, w, acc = x_BTI.astype(act), w_OI.astype(param), wide(act)

    def xla(x, w):
        return wide_einsum("...I,OI->...O", x, w, acc)

    if _blas_ok(act, param, fused):
        y = jax.lax.platform_dependent(x, w, cpu=lambda x, w: kernels.matmul(x.astype(acc), w.astype(acc)),
                                       default=xla)
    else:
        y = xla(x, w)
    if b_O is not None:
        y = y + b_O.astype(param).astype(y.dtype)
    return y.astype(act)


def _blas_ok(act, param, fused: bool) -> bool:
    """Whether `linear` runs its product in numpy's BLAS: `fused`, the operands widening exactly to the
    accumulator (`blas_share_key`), and the BLAS loaded."""
    return fused and blas_share_key(act, param) is not None and kernels.blas_available()


def blas_share_key(act, param) -> tuple[jnp.dtype, jnp.dtype] | None:
    """(weight dtype, accumulator) of a product in `act`/`param` where the BLAS may run it: requests to
    `linear_many` share calls only with requests of the same key (and input width). None where an
    operand does not widen exactly to the accumulator (fp64 weights under fp32 activations): XLA runs
    that product, alone."""
    acc = wide(act)
    if max(jnp.dtype(act).itemsize, jnp.dtype(param).itemsize) > acc.itemsize:
        return None
    return jnp.dtype(param), acc


def _x_key(request) -> tuple:
    """A `linear_many` request's input: the traced array and the dtype it is cast to."""
    return id(request[0]), jnp.dtype(request[3])


def linear_many(requests, fused: bool = False) -> list:
    """`linear(x, w, b, act, param, fused)` of each request (x, w, b, act, param), each result the same array.

    Requests that run in numpy's BLAS with the same `param` and accumulator share BLAS calls: where
    they are every product of a set of inputs x with a set of weights w (the q, k and v projections
    of one x; one weight read by several policies' x in step; or both), they run as one call, the x
    stacked on the leading axis and the weights concatenated on the output axis; else one call per
    weight. Each result is bitwise what its own call gives: the batch rows are cut alike whatever the
    batch (`jaxref.kernels.matmul`), and an output column is the same dot product whatever columns
    the call holds. A weight is packed once for a call of many rows instead of once per request (the
    error budget's policies at T = 128: parity_tests/audit/maps.py), and a wider call runs faster (q, k, v
    of SmolLM2 as one [960, 576] weight: ~9% at T = 256). Other requests run alone, and every request
    where the BLAS is not position-exact (`kernels.blas_position_exact`: OpenBLAS's Haswell kernels,
    whose rows and columns change in their last bits with the call around them).
    """
    out: list = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    share = kernels.blas_position_exact()
    for i, (x, w, b, act, param) in enumerate(requests):
        if isinstance(param, fp8.Linear8):  # an FP8 policy's projection: in XLA, alone
            out[i] = param(x, w, b, act)
        elif share and _blas_ok(act, param, fused) and x.ndim >= 2:
            groups.setdefault((*blas_share_key(act, param), x.shape[1:]), []).append(i)
        else:
            out[i] = linear(x, w, b, act, param, fused)
    for (param, acc, _), idx in groups.items():
        xs = {_x_key(requests[i]) for i in idx}
        ws = {id(requests[i][1]) for i in idx}
        pairs = {(_x_key(requests[i]), id(requests[i][1])) for i in idx}
        if len(pairs) == len(idx) == len(xs) * len(ws):
            parts = [idx]
        else:  # not every x with every weight: one call per weight
            by_w: dict[int, list[int]] = {}
            for i in idx:
                by_w.setdefault(id(requests[i][1]), []).append(i)
            parts = list(by_w.values())
        for part in parts:
            for i, y in zip(part, _products([requests[i] for i in part], param, acc)):
                out[i] = y
    return out


def _products(requests, param, acc) -> list:
    """`linear_many`'s shared call: the requests are every product of their x's (in first-seen order)
    with their weights, all with `param` weights, accumulator `acc` and numpy's BLAS allowed."""
    if len(requests) == 1:
        x, w, b, act, _ = requests[0]
        return [linear(x, w, b, act, param, True)]
    xs = list({_x_key(r): r[0].astype(r[3]) for r in requests}.items())
    ws = list({id(r[1]): r[1].astype(param) for r in requests}.items())
    rows = np.cumsum([x.shape[0] for _, x in xs])[:-1].tolist()
    cols = np.cumsum([w.shape[0] for _, w in ws])[:-1].tolist()
    nx = len(xs)

    def each_alone(*xw):
        return jnp.concatenate([jnp.concatenate([wide_einsum("...I,OI->...O", x, w, acc) for w in xw[nx:]], axis=-1)
                                for x in xw[:nx]], axis=0)

    def blas(*xw):
        return kernels.matmul(jnp.concatenate([x.astype(acc) for x in xw[:nx]], axis=0),
                              jnp.concatenate([w.astype(acc) for w in xw[nx:]], axis=0))

    y = jax.lax.platform_dependent(*(x for _, x in xs), *(w for _, w in ws), cpu=blas, default=each_alone)
    blocks = {(kx, kw): yc for (kx, _), yr in zip(xs, jnp.split(y, rows, axis=0))
              for (kw, _), yc in zip(ws, jnp.split(yr, cols, axis=-1))}
    out = []
    for r in requests:
        yi, b, act = blocks[(_x_key(r), id(r[1]))], r[2], r[3]
        if b is not None:
            yi = yi + b.astype(param).astype(yi.dtype)
        out.append(yi.astype(act))
    return out


def layer_steps(h, lp, *, spec: ModelSpec, policy: DtypePolicy, variant: Variant, cos, sin, doc_ids,
                tap: bool, tap_rows, probe, fused: bool):
    """One pre-norm block as a generator of its projections: `jaxref.reference.layer`'s arithmetic, its
    products handed out to be run together with others' (`decoder_layer` drives one).

    It yields its projections in rounds, a tuple of requests (x, w, b, act, param) at a time (q, k
    and v of one x; o; gate and up of one x; down; `param` is a `jaxref.fp8.Linear8` where the policy's
    projections are FP8, `jaxref.reference.projection`), and is sent their products,
    `linear(x, w, b, act, param, fused)` each; it returns what `decoder_layer` returns.
    `layers_in_step` runs the rounds of one layer or of several policies' layers in step, each
    round's requests through `linear_many` (shared BLAS calls: one x against several weights, one
    weight for several policies' x).

    Args:
      h: the residual stream [B,T,H] in the `act` dtype.
      lp: one layer's slice of params["layers"] (attn_norm [H], wq [N*D,H], ...).
      cos, sin: the RoPE tables of the slots' positions (`rope.rope_tables`).
      doc_ids: int [B,T]; variant: the attention variant.
      tap, tap_rows, probe: as `forward`'s taps, tap_rows (a tuple of query slots or None) and probe.
      fused: allow the fused CPU kernel where it covers the policy (`attention.kernel_args`);
        False traces the JAX path (which has a VJP).

    Returns:
      (h [B,T,H] in `act`, {tap name: array}): the next residual stream and one layer's taps
      (the scan stacks them to `forward`'s [L, ...]).
    """
    act, param, norm = policy.dtype("act"), policy.dtype("param"), policy.dtype("norm")
    lin = param if policy.linear_in is None else fp8.Linear8(param, policy.linear_in, policy.linear_grad,
                                                              policy.scaling)
    B, T, _ = h.shape
    N, K, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    scale = spec.head_dim ** -0.5
    x = rms_norm(h, lp["attn_norm"], spec.rms_norm_eps, norm, act, param)
    q, k, v = yield ((x, lp["wq"], lp.get("bq"), act, lin), (x, lp["wk"], lp.get("bk"), act, lin),
                     (x, lp["wv"], lp.get("bv"), act, lin))
    q, k, v = q.reshape(B, T, N, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)
    if spec.qk_norm:  # Qwen3: each head's q and k RMS-normed over D before RoPE (Qwen3Attention)
        q = rms_norm(q, lp["q_norm"], spec.rms_norm_eps, norm, act, param)
        k = rms_norm(k, lp["k_norm"], spec.rms_norm_eps, norm, act, param)
    rope_dt = policy.dtype("rope_apply")
    q = rope_lib.apply(q, cos, sin, spec.rope.layout, rope_dt)
    k = rope_lib.apply(k, cos, sin, spec.rope.layout, rope_dt)
    q, k, v = fp8_operands(q, k, v, policy)
    ctx = attention(q, k, v, doc_ids, variant, policy, scale, fused=fused).astype(act)
    a, = yield ((ctx.reshape(B, T, N * D), lp["wo"], None, act, lin),)
    h = (h + a).astype(act)
    x = rms_norm(h, lp["mlp_norm"], spec.rms_norm_eps, norm, act, param)
    gate, up = yield ((x, lp["w_gate"], None, act, lin), (x, lp["w_up"], None, act, lin))
    m = silu_mul(gate, up, act)
    m, = yield ((m, lp["w_down"], None, act, lin),)
    h = (h + m).astype(act)
    out: dict[str, Any] = {}
    if tap:
        out.update(q=q, k=k, attn_out=a, mlp_out=m, hidden=h)
        if tap_rows:
            s, p = row_scores_probs(q, k, doc_ids, jnp.asarray(tap_rows), variant, policy, scale)
            out.update(scores=s, probs=p)
    if probe is not None:
        if getattr(probe, "reads_qk", False):  # a probe that forms the maps itself (parity_tests.audit.maps.KernelProbe)
            out["probe"] = probe(q, k, scale)
        else:
            s, p = full_probs(q, k, doc_ids, variant, policy, scale)
            out["probe"] = probe(s, p)
    return h, out


def layers_in_step(layers, fused: bool) -> list:
    """Run `layer_steps` generators (one per policy, the same spec) in step, round by round, every
    request of a round through one `linear_many`; their results ((h, taps) each) in order."""
    rounds = [next(layer) for layer in layers]
    while True:
        products = iter(linear_many([r for rnd in rounds for r in rnd], fused))
        sent = [tuple(next(products) for _ in rnd) for rnd in rounds]
        rounds, outs = [], []
        for layer, ys in zip(layers, sent):
            try:
                rounds.append(layer.send(ys))
            except StopIteration as done:
                outs.append(done.value)
        if outs:  # the same layer code for every policy: all end at the same projection
            assert len(outs) == len(layers), "the layers went out of step"
            return outs


def decoder_layer(h, lp, *, spec: ModelSpec, policy: DtypePolicy, variant: Variant, cos, sin, doc_ids,
                  tap: bool, tap_rows, probe, fused: bool):
    """One pre-norm block, the body of the decoder's `lax.scan` over layers (`layer_steps` driven by
    `layers_in_step`: q, k, v in one product, gate and up in one, where numpy's BLAS runs them);
    arguments and result as `layer_steps`'."""
    return layers_in_step([layer_steps(h, lp, spec=spec, policy=policy, variant=variant, cos=cos, sin=sin,
                                       doc_ids=doc_ids, tap=tap, tap_rows=tap_rows, probe=probe, fused=fused)],
                          fused)[0]


def decoder_forward(params: Params, tokens, pos, doc_ids, *, spec: ModelSpec, policy: DtypePolicy,
                    variant: Variant, tap: bool, tap_rows: tuple[int, ...] | None, probe: Probe | None,
                    seq_len: int | None, fused: bool, remat: bool = False):
    """The decoder forward, un-jitted: what `forward` runs under `jax.jit`, for callers that trace it
    inside their own transformation (`jaxref.train`'s gradient, `jaxref.nnx.Decoder`).

    Args:
      params: from `load_model` / `params_from_state`.
      tokens: int32 [B,T]; pos: int64 [B,T] positions; doc_ids: int32 [B,T].
      spec, policy, variant: a ModelSpec, a DtypePolicy (not a name) and a checked variant.
      tap, tap_rows, probe: as `forward`'s taps (a bool), tap_rows (a tuple or None) and probe.
      seq_len: the length dynamic RoPE scales by (max position + 1); None for other RoPE kinds.
      fused: allow the fused CPU attention kernel (no VJP: pass False under `jax.grad`).
      remat: under `jax.grad`, keep only each layer's input and recompute the layer in the backward
        (`jax.checkpoint`): memory of one layer's activations instead of all of them (SmolLM2's fp64
        gradient at T = 8192 holds 30 layers of [heads, T, T] probabilities without it). The recompute
        runs the same operations on the same inputs: the gradients are the same numbers.

    Returns:
      (logits [B,T,V] in the `head` dtype, {tap name: array}); the dict always holds "final_norm"
      [B,T,H] and, with `tap`, every tap `forward` documents.
    """
    param = policy.dtype("param")
    cos, sin = rope_lib.rope_tables(spec.rope, spec.head_dim, pos, policy, seq_len=seq_len)
    h = embed(params, tokens, policy)
    layer = partial(decoder_layer, spec=spec, policy=policy, variant=variant, cos=cos, sin=sin,
                    doc_ids=doc_ids, tap=tap, tap_rows=tap_rows, probe=probe, fused=fused)
    if remat:
        layer = jax.checkpoint(layer, prevent_cse=False)  # inside scan, CSE cannot merge the recompute away
    h_out, per_layer = jax.lax.scan(layer, h, params["layers"])
    head = policy.dtype("head")
    x = rms_norm(h_out, params["final_norm"], spec.rms_norm_eps, policy.dtype("norm"), head, param)
    w_out = params["embed"] if spec.tie_embeddings else params["lm_head"]
    logits = linear(x, w_out, None, head, param, fused)
    per_layer = dict(per_layer)
    if tap:
        per_layer["embed"] = h
        per_layer["logits"] = logits
    # The normed hidden state is always an output, for speed only: with the norm's result used
    # nowhere but the lm_head, XLA's CPU backend (jaxlib 0.10) fuses the norm into the matmul's
    # YNNPACK kernel and recomputes it per output tile (2.6 s instead of 1.9 s at T=4096 on SmolLM2).
    per_layer["final_norm"] = x
    return logits, per_layer


_forward_jit = jax.jit(decoder_forward, static_argnames=("spec", "policy", "variant", "tap", "tap_rows", "probe",
                                                         "seq_len", "fused"))


def forward(params: Params, config: ModelSpec, tokens, positions=None, doc_ids=None, variant: str = "full",
            policy: DtypePolicy | str = "fp32", *, taps: bool = False, tap_rows=None, probe: Probe | None = None,
            fused: bool | None = None):
    """Run the decoder.

    Args:
      params: from `load_model` / `params_from_state`.
      config: the ModelSpec.
      tokens: int [B, T] (or [T]).
      positions: int [B, T]; default `jaxref.positions(doc_ids, variant)`.
      doc_ids: int [B, T] (docs/DESIGN.md §1); default one document (anchor at slot 0 for `anchor`).
      variant: `full`, `intra_doc`, `intra_doc_reset` or `anchor`.
      policy: a DtypePolicy, preset name, YAML path or mapping.
      taps: also return per-layer taps: q, k [L,B,T,N|K,D] after RoPE; attn_out, mlp_out, hidden
        [L,B,T,H]; embed [B,T,H]; final_norm [B,T,H] (the lm_head's input); logits [B,T,V]; with
        `tap_rows` (query slots R) also scores and probs [L,B,N,R,T] (scores unmasked,
        probabilities 0 where masked).
      probe: f(scores [B,N,T,T], probs [B,N,T,T]) -> pytree, evaluated per layer and stacked
        ([L, ...] under taps["probe"]); for reductions over whole attention maps at bounded memory.
        A probe with `reads_qk = True` is called f(q, k, scale) instead and forms the maps itself
        (`parity_tests.audit.maps.KernelProbe`).
      fused: run the attention in the fused C++ CPU kernel (`jaxref.kernels`) where it covers the
        policy (`jaxref.attention.kernel_args`); None (default): the user's switch, on unless
        `JAXREF_FUSED_ATTENTION=0`, read here once per call.

    Returns:
      logits [B, T, V] in the policy's `head` dtype, or (logits, taps) when taps or probe is given.
    """
    variant = check_variant(variant)
    policy = get_policy(policy)
    tokens, pos, doc_ids, seq_len, squeeze = window_inputs(config, tokens, positions, doc_ids, variant)
    logits, per_layer = _forward_jit(
        params, jnp.asarray(tokens, jnp.int32), jnp.asarray(pos, jnp.int64), jnp.asarray(doc_ids, jnp.int32),
        spec=config, policy=policy, variant=variant, tap=bool(taps),
        tap_rows=None if tap_rows is None else tuple(int(r) for r in tap_rows), probe=probe, seq_len=seq_len,
        fused=kernels.enabled() if fused is None else bool(fused),
    )
    if squeeze:
        logits = logits[0]
    if taps or probe is not None:
        if not taps:
            per_layer.pop("final_norm")
        return logits, per_layer
    return logits
