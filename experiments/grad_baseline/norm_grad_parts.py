"""Which factor of a norm weight's gradient carries the bf16 trainer's error: the cotangent or the activations?

    .venv/bin/python experiments/grad_baseline/norm_grad_parts.py [--model default] [--engine sdpa] [--variant anchor] \
        [--seq-len 1025] [--layers 26,27,28,29] --out experiments/grad_baseline/results/norm_grad_parts_cpu.json

An RMSNorm weight's gradient is a sum over tokens, dw = Σ_t dy_t ⊙ x̂_t: dy the cotangent reaching the
norm's output (from layer i's q, k and v projections for `input_layernorm`) and x̂ the normalised
activations in bf16 (Hugging Face's LlamaRMSNorm casts before the weight multiply). The parity suite's
SmolLM2 anchor case at T = 1025 on the CPU's sdpa engine failed on one such weight, layer 28's
input_layernorm, under the gradient rule of the time (2 × RMS of 4 orders: experiments/grad_baseline/grad_case_backward.py).
This takes the two factors apart, for the trainer (torch bf16: forward hooks for the norm's input, a
tensor hook for dy), for the oracle's emulation of the trainer's kernel (the case's bf16 policy) and for
fp64 truth (the oracle: dy as the gradient of a zero added to the norm's output, x̂ from the layer's
input tap), and records per layer and side:

  dy, xhat                rel. L2 of the factor against truth
  dw                      rel. L2 of Σ_t dy ⊙ x̂ (in fp64 from the side's factors) against truth's
  dw_grad                 rel. L2 of the side's own parameter gradient against truth's (torch: .grad;
                          the oracle: `jaxref.value_and_grad`), the number the parity rule judges
  dw_dy_only, dw_x_only   rel. L2 of dw with one factor the side's and the other truth's
  amplification           ‖Σ_t |dy ⊙ x̂|‖ / ‖dw‖ of truth: how much the sum over tokens cancels
  truth_parts_vs_grad     the capture checked: truth's Σ_t dy ⊙ x̂ against its own gradient (fp64: ~1e-15)
  by_token                the share of the side's dw error (‖dw − dw_truth‖²) from slot 0 (the anchor) and
                          from the 8 slots contributing most, and which slots those are
  d_q, d_k, d_v, d_o      rel. L2 of the cotangent at each attention projection's output (d_o: the residual
                          stream's after the attention), and of the anchor's row of each (`*_anchor`)
  anchor_dims             the anchor's largest normalised activations: truth's x̂ and dy there, the side's
                          dy, and the anchor slot's error there over truth's dw in that dimension
  dw_worst_dims           the dimensions of dw carrying most of its squared error, and the anchor's part

The side whose dw_dy_only is near its dw carries its error in the cotangent; the slots say where.

What it showed (SmolLM2, anchor, T = 1025, sdpa on 2 AMD EPYC cores with AVX2, 2026-11-26, 7 minutes;
experiments/grad_baseline/results/norm_grad_parts_cpu.json): at layer 28 the trainer's cotangent is no worse than the
emulation's (dy 3.6% off fp64 on both sides, 3.2% against 3.3% at the anchor; x̂ 1.4% on both), yet its
weight gradient is 8.2% off against 2.2%. The anchor's normalised activation has one massive dimension
(x̂ = 23.8 at dim 507, every other below 2): the anchor slot's term there is weighted 10x any other, and
83% of the trainer's squared dw error is in dim 507, three quarters of it from the anchor slot. The
anchor's dy in that one element is 5.1% off truth in torch and 0.8% in the emulation's order 0. So the
weight gradient's error is one element's draw, and its size depends on which way that element rounds:
experiments/grad_baseline/grad_draws.py's 12 orders of the emulation give 0.018-0.070 for this parameter (the trainer
0.080), and over all 272 parameters the trainer ranks among the draws as one more draw would. Layers 14
and 17 show the same (their anchor slot holds 87% and 76% of the trainer's error; 70% and 36% of the
emulation's). Not a missing operation: the factor with the error is the same size on both sides.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository


PROJ = ("q", "k", "v", "o")  # the attention's projections whose output cotangents are recorded too
OURS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo"}


def rel(a, b) -> float:
    """rel. L2 of a against b, as the parity suite computes it."""
    from parity_tests.grads import errors

    return errors(a, b)["rel_l2"]


def torch_parts(case, inputs, layers: list[int]) -> dict[int, dict[str, np.ndarray]]:
    """{layer: {"dy", "xhat", "grad", "d_q", "d_k", "d_v", "d_o"}} of the trainer in bf16 on `case.engine`
    (one backward): x̂ recomputed from the norm's input as LlamaRMSNorm computes it, the cotangents from
    tensor hooks on the outputs of the norm and of the projections."""
    import torch

    import torchtrain

    model = torchtrain.build_model(case.model, engine=case.engine, dtype="bfloat16").train()
    got: dict[int, dict[str, np.ndarray]] = {i: {} for i in layers}

    def hook(i):
        norm = model.model.layers[i].input_layernorm

        def fwd(mod, args, out):
            h = args[0].float()
            xh = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)).to(args[0].dtype)
            got[i]["xhat"] = xh.detach().double().numpy()[0]
            out.register_hook(lambda g: got[i].__setitem__("dy", g.detach().double().numpy()[0]))
        return norm.register_forward_hook(fwd)

    def proj_hook(i, name):
        def fwd(mod, args, out):
            out.register_hook(lambda g: got[i].__setitem__(f"d_{name}", g.detach().double().numpy()[0]))
        return getattr(model.model.layers[i].self_attn, f"{name}_proj").register_forward_hook(fwd)

    handles = [hook(i) for i in layers] + [proj_hook(i, n) for i in layers for n in PROJ]
    feed = {"input_ids": torch.from_numpy(inputs.tokens), "position_ids": torch.from_numpy(inputs.positions),
            "doc_ids": torch.from_numpy(inputs.doc_ids), "variant": case.variant}
    loss, _ = torchtrain.next_token_loss(model(**feed, use_cache=False).logits, torch.from_numpy(inputs.tokens),
                                         torch.from_numpy(inputs.loss_mask))
    loss.backward()
    for h in handles:
        h.remove()
    for i in layers:
        got[i]["grad"] = model.model.layers[i].input_layernorm.weight.grad.double().numpy()
    return got


def oracle_parts(case, inputs, policy: str, layers: list[int]) -> dict[int, dict[str, np.ndarray]]:
    """`torch_parts`' arrays from the oracle under `policy` (fp64 truth or the emulation): each cotangent is
    the gradient of a zero added to that output (`rms_norm` and `linear` wrapped for the run; the zeros
    travel as the weights' companions through the decoder's scan), x̂ from the layer's input tap."""
    import jax
    import jax.numpy as jnp

    import jaxref
    import jaxref.executor as M  # the executor's own names: patching them changes what decoder_forward runs
    from jaxref.executor import decoder_forward
    from jaxref.reference import params_from_state
    from jaxref.train import next_token_loss
    from parity_tests.grads import _starting_state
    from parity_tests.runners import oracle_model

    jax.config.update("jax_enable_x64", True)
    params, spec = oracle_model(case.model)
    pol = jaxref.get_policy(policy)
    state, master = _starting_state(params, spec, pol)
    p = params_from_state(spec, state, master)
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.promote_types(a.dtype, pol.dtype("param"))), p)
    T = inputs.tokens.shape[1]
    z = jnp.zeros((spec.num_layers, T, spec.hidden_size), jnp.float64 if pol.act == "float64" else jnp.float32)
    tok, pos = jnp.asarray(inputs.tokens, jnp.int32), jnp.asarray(inputs.positions, jnp.int64)
    doc, mask = jnp.asarray(inputs.doc_ids, jnp.int32), jnp.asarray(inputs.loss_mask, jnp.int32)
    ce = jnp.promote_types(jnp.float32, pol.dtype("head"))
    plain, plain_linear = M.rms_norm, M.linear
    zp = {n: jnp.zeros((spec.num_layers, T, p["layers"][OURS[n]].shape[1]), z.dtype) for n in PROJ}

    def norm_with_zero(x, w, eps, norm, out, param):
        """`rms_norm`, plus a zero at the output where the weight comes with one (the attention norm)."""
        if isinstance(w, dict):
            return plain(x, w["w"], eps, norm, out, param) + w["z"].astype(out)
        return plain(x, w, eps, norm, out, param)

    def linear_with_zero(x, w, b, act, param, fused=False):
        """`linear`, plus a zero at the output where the weight comes with one (the attention's projections)."""
        if isinstance(w, dict):
            return plain_linear(x, w["w"], b, act, param, fused) + w["z"].astype(act)
        return plain_linear(x, w, b, act, param, fused)

    def loss_fn(prm, z):
        layers_p = dict(prm["layers"], attn_norm={"w": prm["layers"]["attn_norm"], "z": z["norm"]},
                        **{OURS[n]: {"w": prm["layers"][OURS[n]], "z": z[n]} for n in PROJ})
        logits, taps = decoder_forward(dict(prm, layers=layers_p), tok, pos, doc, spec=spec, policy=pol,
                                       variant=case.variant, tap=True, tap_rows=None, probe=None, seq_len=None,
                                       fused=False)
        return next_token_loss(logits, tok, mask, ce), (taps["embed"], taps["hidden"])

    M.rms_norm, M.linear = norm_with_zero, linear_with_zero
    try:
        (_, (embed, hidden)), (g, dz) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))(
            p, {"norm": z, **zp})
    finally:
        M.rms_norm, M.linear = plain, plain_linear
    act = pol.dtype("act")
    unit = jnp.ones((spec.hidden_size,), pol.dtype("param"))  # x̂ is the norm's output at weight 1 (exact: 1·x)
    out = {}
    for i in layers:
        h = embed if i == 0 else hidden[i - 1]
        xh = plain(h, unit, spec.rms_norm_eps, pol.dtype("norm"), act, pol.dtype("param"))
        out[i] = {"xhat": np.asarray(xh, np.float64)[0],
                  "dy": np.asarray(dz["norm"][i], np.float64),
                  "grad": np.asarray(g["layers"]["attn_norm"][i], np.float64),
                  **{f"d_{n}": np.asarray(dz[n][i], np.float64) for n in PROJ}}
    return out


def compare(side: dict, truth: dict) -> dict:
    dy, xh, dy0, xh0 = side["dy"], side["xhat"], truth["dy"], truth["xhat"]
    dw0 = (dy0 * xh0).sum(0)
    err_t = dy * xh - dy0 * xh0                      # per-slot contribution to the dw error
    per_slot = (err_t ** 2).sum(1)
    dw_err2 = float((err_t.sum(0) ** 2).sum())
    # a slot's share of ‖dw − dw0‖²: its error's projection on the total error
    share = err_t @ err_t.sum(0) / dw_err2
    top = np.argsort(-share)[:8]
    dims = np.argsort(-np.abs(xh0[0]))[:3]          # the anchor's largest normalised activations
    anchor_dims = [{"dim": int(d), "xhat_truth": float(xh0[0, d]), "dy_truth": float(dy0[0, d]),
                    "dy": float(dy[0, d]), "dw_truth": float(dw0[d]),
                    "slot0_error_over_dw": float((err_t[0, d]) / abs(dw0[d]))} for d in dims]
    e_dw = err_t.sum(0)
    worst = np.argsort(-np.abs(e_dw))[:3]
    worst_dims = [{"dim": int(d), "share": float(e_dw[d] ** 2 / (e_dw ** 2).sum()),
                   "slot0_share": float(err_t[0, d] / e_dw[d])} for d in worst]
    return {"dy": rel(dy, dy0), "xhat": rel(xh, xh0), "dw": rel((dy * xh).sum(0), dw0),
            "dw_grad": rel(side["grad"], truth["grad"]),
            "dw_dy_only": rel((dy * xh0).sum(0), dw0), "dw_x_only": rel((dy0 * xh).sum(0), dw0),
            "amplification": float(np.linalg.norm(np.abs(dy0 * xh0).sum(0)) / np.linalg.norm(dw0)),
            "dy_anchor": rel(dy[0], dy0[0]),
            **{f"d_{n}": rel(side[f"d_{n}"], truth[f"d_{n}"]) for n in PROJ},
            **{f"d_{n}_anchor": rel(side[f"d_{n}"][0], truth[f"d_{n}"][0]) for n in PROJ if n != "q"},
            "anchor_dims": anchor_dims, "dw_worst_dims": worst_dims,
            "by_token": {"anchor_share": float(share[0]), "top_slots": top.tolist(),
                         "top_shares": [round(float(s), 4) for s in share[top]],
                         "top8_share": float(share[top].sum()),
                         "largest_slot_error_norms": [round(float(np.sqrt(per_slot[t])), 6) for t in top]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="default: SmolLM2; random:llama for a dry run")
    ap.add_argument("--engine", default="sdpa")
    ap.add_argument("--variant", default="anchor")
    ap.add_argument("--seq-len", type=int, default=1025)
    ap.add_argument("--layers", default="26,27,28,29")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from anchor_core.atomic import write_text_atomic
    from anchor_core.machine import machine
    from parity_tests.cases import BF16, Case, case_inputs
    from parity_tests.runners import get_runner, resolve_policy

    layers = [int(s) for s in args.layers.split(",")]
    case = Case(args.model, args.variant, "plain", BF16, args.engine, args.seq_len, windows=1)
    inputs = case_inputs(case)
    emulation, _ = resolve_policy(BF16, get_runner(args.engine))
    t0 = time.perf_counter()
    sides = {"truth": oracle_parts(case, inputs, "fp64", layers),
             "emulation": oracle_parts(case, inputs, emulation, layers),
             "torch": torch_parts(case, inputs, layers)}
    truth = sides["truth"].values()
    result = {"what": __doc__.split("\n")[0], "emulation": emulation,
              "case": f"{args.model}/{args.variant}/bf16/{args.engine}/T{args.seq_len}",
              "layers": {str(i): {s: compare(sides[s][i], sides["truth"][i]) for s in ("emulation", "torch")}
                         for i in layers},
              # the capture checked: truth's own weight gradient against the sum of its captured factors
              "truth_parts_vs_grad": max(rel((t["dy"] * t["xhat"]).sum(0), t["grad"]) for t in truth),
              "seconds": round(time.perf_counter() - t0, 1), "machine": machine()}
    write_text_atomic(Path(args.out), json.dumps(result, indent=1) + "\n")
    for i in layers:
        r = result["layers"][str(i)]
        print(i, {s: {k: round(v, 4) for k, v in r[s].items() if isinstance(v, float)} for s in r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
