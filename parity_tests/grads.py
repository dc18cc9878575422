"""Gradient and optimizer-step parity: the trainer's backward pass and AdamW step against the oracle's.

On a case's packed batch (`parity_tests.cases.case_inputs`), both sides take the mean next-token
loss over the counted targets (docs/DESIGN.md §8), its gradient w.r.t. every parameter, and `steps`
AdamW steps on that batch with the trainer's optimizer (`torchtrain.training.optim.param_groups`: no decay
on biases and norms). Per parameter (Hugging Face names), rel_l2, max_abs and cosine of:

  grads     the gradient against fp64 truth (`jaxref.value_and_grad`)           judged: the gradient rule (below)
  step@k    the trainer's parameters after k steps against the oracle's AdamW (`jaxref.adamw`)
            applied to the trainer's own gradients, k = 1 and 3                  judged: fp32 rule
  params@k  the parameters after k steps against truth's trajectory               reported
  update@k  p_k − p_0 against truth's                                             reported

The gradient rule: fp32 within 1e-5 (below); bf16 within 2 × the emulation's own error against fp64 +
floor, that error the largest over `Rule.grad_orders` (8) summation orders: the emulation's gradients
under `permute_units`' orders (`oracle_grad_draws`; `grad_baseline`). One order is one draw, and on
SmolLM2 a draw can be ten times another: anchor at T=1025, layer 10's k_proj gradient is 0.06 off fp64 in
one order and 0.64 in another (the massive activation that forms at the anchor in layers 9-11 lands
its bf16 rounding one way or the other), and torch's CUDA kernels land on either (an H200's gradients
against the draws: experiments/grad_baseline/results/grad_draws_cpu.json). A norm weight's gradient can
carry its error in one element (the anchor's cotangent at its massive dimension:
experiments/grad_baseline/norm_grad_parts.py), so its draws have a heavy tail that the RMS of 4 orders
(the forward taps' baseline) under-estimates: held against every 4 of 11 other orders, a draw of the
emulation itself fails at least one parameter in 46% of cases (SmolLM2, anchor, T=1025, the CPU's sdpa
emulation, 12 orders; experiments/grad_baseline/results/grad_draws_cpu_sdpa.json),
against the largest of 8 in 0.7%. The CPU trainer on that case ranks among the 12 draws as one more draw
would, and misses the RMS rule on one parameter (0.080; draws 0.018-0.070); the largest of 8 passes it.
fp32 gradients: within 1e-5 or within 2 × the oracle's own fp32 error against fp64, whichever is
larger. A deep model's fp32 backward carries more than 1e-5 of rounding, whoever computes it.
Measured on SmolLM2 (30 layers, anchor, T = 515): the oracle's fp32 gradients are up to 6.7e-5 off
fp64 (model.layers.10.input_layernorm.weight). The trainer's are up to 3.7e-5 off, at most 1.41 × the
oracle's own error on any parameter. On the 2-layer random presets the 1e-5
governs. The optimizer is judged on the same gradients because AdamW's first step is
about lr · sign(g): every element whose gradient is within rounding of 0 flips its whole step, so
trajectories from two roundings of the gradient differ by a count of coin flips (reported beside
the oracle's own, never judged); on the same gradients both optimizers compute the same fp32 update,
and a defect (decay on the norms, wrong betas, eps or bias correction) moves the parameters by far
more than 1e-5: with lr 1e-3 a step is 1e-3 of a norm weight of 1 and 5% of a weight of 0.02. The trainer in bf16 keeps fp32 master weights (as DeepSpeed's bf16 optimizer does); so does
the emulation.

A failing case names the first diverging parameter going backwards from the loss (lm_head, final
norm, the last layer's MLP, …, the first layer's attention, the embeddings): a backward defect
shows there first and every parameter behind it inherits the error.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import jaxref
import torchtrain
from jaxref.reference import params_from_state
from parity_tests.cases import Case, CaseInputs, case_inputs
from parity_tests.core import RULE, Rule
from parity_tests.runners import (
    Runner,
    device,
    get_runner,
    oracle_model,
    permute_units,
    resolve_policy,
    unit_permutations,
    unpermute_state,
)
from torchtrain.training import optim as train_optim

TRUTH = "fp64"
STEPS: tuple[int, ...] = (1, 3)


@dataclass(frozen=True)
class Optimizer:
    """The AdamW settings both sides use (the trainer's, with a learning rate large enough that a
    step moves every parameter well beyond rounding)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: tuple[str, ...] = ("bias", "norm")

    def to_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
                "no_decay": list(self.no_decay)}


OPTIMIZER = Optimizer()

State = dict[str, np.ndarray]


# ---------------------------------------------------------------------------------------------
# Order: from the loss backwards


_LAYER_ORDER = ("mlp.down_proj", "mlp.up_proj", "mlp.gate_proj", "post_attention_layernorm", "self_attn.o_proj",
                "self_attn.v_proj", "self_attn.k_norm", "self_attn.q_norm", "self_attn.k_proj", "self_attn.q_proj",
                "input_layernorm")


def backward_order(names) -> list[str]:
    """Parameter names in the order the backward pass reaches them: lm_head, the final norm, layers
    L-1 … 0 (MLP down/up/gate, its norm, o and v, Qwen3's k/q norms, k and q, each with its bias, the
    attention norm), embeddings."""
    def key(name: str) -> tuple:
        if name.startswith("lm_head"):
            return (0,)
        if name.startswith("model.norm"):
            return (1,)
        m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m:
            sub = next((i for i, s in enumerate(_LAYER_ORDER) if m.group(2) == s), len(_LAYER_ORDER))
            return (2, -int(m.group(1)), sub, m.group(3))
        if name.startswith("model.embed_tokens"):
            return (4,)
        return (3, name)
    return sorted(names, key=key)


# ---------------------------------------------------------------------------------------------
# The trainer


def torch_training(case: Case, inputs: CaseInputs, dtype: str, engine: str, steps: int,
                   opt: Optimizer = OPTIMIZER, build: Callable[[str, str], Any] | None = None) -> dict[str, Any]:
    """The trainer's loss, gradients (step 0) and parameters after each of `steps` AdamW steps.

    build: `f(model name, dtype)` -> the model on the parity device (a runner's own, e.g. with FP8 linears);
      default `torchtrain.build_model` with `engine`.

    Returns {"loss": [float per step], "grads": {name: float32 array}, "step_grads": [per step],
    "params": {k: {name: float32 array}}} with params[0] the starting point (in bf16 the fp32 masters).
    """
    import torch


    on = device()
    if build is None:
        model = torchtrain.build_model(case.model, engine=engine, dtype=dtype).to(on)
    else:
        model = build(case.model, dtype)
    model.train()  # fresh: the steps change it
    params = dict(model.named_parameters())
    bf16 = dtype == "bfloat16"
    # bf16: the optimizer steps fp32 master copies, which are rounded into the model after each step
    by_hf = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in params.items()} if bf16 else params

    class _Cfg:  # the two fields param_groups reads
        no_decay = opt.no_decay
        weight_decay = opt.weight_decay

    groups = train_optim.param_groups(_NamedView(by_hf), _Cfg)
    optim = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    feed = {"input_ids": torch.from_numpy(inputs.tokens).to(on), "position_ids": torch.from_numpy(inputs.positions).to(on),
            "doc_ids": torch.from_numpy(inputs.doc_ids).to(on), "variant": case.variant}
    tokens, mask = torch.from_numpy(inputs.tokens).to(on), torch.from_numpy(inputs.loss_mask).to(on)
    snap = lambda: {n: p.detach().float().cpu().numpy().copy() for n, p in by_hf.items()}  # noqa: E731  (fp32 masters)
    out: dict[str, Any] = {"loss": [], "params": {0: snap()}}
    for step in range(1, steps + 1):
        model.zero_grad(set_to_none=True)
        loss, _ = torchtrain.next_token_loss(model(**feed, use_cache=False).logits, tokens, mask)
        loss.backward()
        out["loss"].append(float(loss.detach()))
        out.setdefault("step_grads", []).append({n: p.grad.detach().float().cpu().numpy().copy() for n, p in params.items()})
        if step == 1:
            out["grads"] = out["step_grads"][0]
        if bf16:
            for n, p in params.items():
                by_hf[n].grad = p.grad.detach().float()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if bf16:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(by_hf[n].detach().to(p.dtype))
        out["params"][step] = snap()
    return out


class _NamedView:
    """`named_parameters()` over a {name: parameter} mapping (what `param_groups` iterates)."""

    def __init__(self, params):
        self._params = params

    def named_parameters(self):
        return iter(self._params.items())


# ---------------------------------------------------------------------------------------------
# The oracle


_ORACLE_CACHE: dict[tuple, dict[str, Any]] = {}


def _starting_state(params: dict, spec, pol) -> tuple[dict[str, np.ndarray], Any]:
    """(HF state, master dtype) the oracle trains from under `pol`: fp64 for fp64 truth, else fp32 masters.
    A model built in bf16 holds bf16-rounded weights, and its optimizer's fp32 masters start from them
    (DeepSpeed's bf16 optimizer; torch_training): so do the emulation's."""
    import jax.numpy as jnp


    master = jnp.float64 if pol.param == "float64" else jnp.float32
    start = pol.dtype("param")
    return {n: np.asarray(jnp.asarray(v).astype(start).astype(master))
            for n, v in jaxref.hf_state(params, spec).items()}, master


def _loss_and_grads(case: Case, inputs: CaseInputs, spec, state: dict, master, pol) -> tuple[float, dict]:
    """The oracle's loss and {HF name: gradient in the master dtype} at `state` on the case's batch."""
    loss, grads = jaxref.value_and_grad(
        params_from_state(spec, state, master), spec, inputs.tokens, positions=inputs.positions,
        doc_ids=inputs.doc_ids, loss_mask=inputs.loss_mask, variant=case.variant, policy=pol)
    return loss, {n: np.asarray(g, dtype=master) for n, g in grads.items()}


def oracle_training(case: Case, inputs: CaseInputs, policy: str, steps: int,
                    opt: Optimizer = OPTIMIZER) -> dict[str, Any]:
    """The oracle's loss, gradients and parameters after each AdamW step under `policy` (cached for
    the last two (inputs, policy, steps): a case's truth and baseline). Truth (fp64) keeps fp64 parameters; a bf16 policy keeps
    fp32 master parameters and rounds them where the policy's `param` stage says."""
    key = (case.data_key, policy, steps, opt)
    if key in _ORACLE_CACHE:
        return _ORACLE_CACHE[key]

    params, spec = oracle_model(case.model)
    pol = jaxref.get_policy(policy)
    state, master = _starting_state(params, spec, pol)
    init, update = _adamw(opt)
    opt_state = init(state)
    # kept in their own dtype (fp64 truth, fp32 masters): a SmolLM2 case holds several copies of 135M parameters
    out: dict[str, Any] = {"loss": [], "params": {0: state}}
    for step in range(1, steps + 1):
        loss, grads = _loss_and_grads(case, inputs, spec, state, master, pol)
        out["loss"].append(loss)
        if step == 1:
            out["grads"] = grads
        state, opt_state = update(grads, opt_state, state)
        state = {n: np.asarray(v) for n, v in state.items()}
        out["params"][step] = state
    while len(_ORACLE_CACHE) >= 2:  # a SmolLM2 entry holds several copies of its parameters
        _ORACLE_CACHE.pop(next(iter(_ORACLE_CACHE)))
    _ORACLE_CACHE[key] = out
    return out


_DRAWS_CACHE: dict[tuple, list[dict[str, np.ndarray]]] = {}


def oracle_grad_draws(case: Case, inputs: CaseInputs, policy: str, orders: int) -> list[dict[str, np.ndarray]]:
    """The oracle's gradients at the starting parameters under `policy` in summation orders 1 … orders-1
    (`parity_tests.runners.permute_units`: the same model, its units listed in another order), each
    back in the stored order (`unpermute_state`); order 0 is `oracle_training`'s. Cached for the last
    (inputs, policy, orders): a case's engines share them."""
    key = (case.data_key, policy, orders)
    if key in _DRAWS_CACHE:
        return _DRAWS_CACHE[key]

    params, spec = oracle_model(case.model)
    pol = jaxref.get_policy(policy)
    draws = []
    for order in range(1, orders):
        state, master = _starting_state(permute_units(params, order)[0], spec, pol)
        _, grads = _loss_and_grads(case, inputs, spec, state, master, pol)
        draws.append(unpermute_state(grads, unit_permutations(params, order)))
    _DRAWS_CACHE.clear()  # a SmolLM2 entry holds orders-1 copies of its 135M gradients
    _DRAWS_CACHE[key] = draws
    return draws


@functools.lru_cache(maxsize=4)
def _adamw(opt: Optimizer) -> tuple[Callable, Callable]:
    """(init, step) of `opt` as `jaxref.adamw`, each one compiled program (`jaxref.optimizer_step`),
    kept for the run: one compile per model and dtype instead of one per operation and shape."""
    import jax


    tx = jaxref.adamw(opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, no_decay=opt.no_decay)
    return jax.jit(tx.init), jaxref.optimizer_step(tx)


def replay_steps(test: dict[str, Any], opt: Optimizer = OPTIMIZER) -> dict[int, State]:
    """The oracle's AdamW (`jaxref.adamw`, in float32) fed the trainer's own gradients of each step,
    from the trainer's starting parameters: what the trainer's optimizer should have produced.
    Returns {k: {name: float32 array}} for k = 1 … steps."""
    init, update = _adamw(opt)
    state = {n: v.astype(np.float32) for n, v in test["params"][0].items()}
    opt_state = init(state)
    out = {}
    for k, grads in enumerate(test["step_grads"], start=1):
        state, opt_state = update(grads, opt_state, state)
        state = {n: np.asarray(v) for n, v in state.items()}
        out[k] = state
    return out


# ---------------------------------------------------------------------------------------------
# Comparison


def errors(x: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """rel_l2, max_abs and cosine of x against truth (float64)."""
    x, t = np.asarray(x, np.float64).ravel(), np.asarray(truth, np.float64).ravel()
    d = x - t
    nt, nx = float(np.linalg.norm(t)), float(np.linalg.norm(x))
    return {
        "rel_l2": float(np.linalg.norm(d) / nt) if nt > 0 else float(np.linalg.norm(d)),
        "max_abs": float(np.abs(d).max()) if d.size else 0.0,
        "cosine": float(x @ t / (nx * nt)) if nx > 0 and nt > 0 else float(nx == nt),
    }


def grad_baseline(draws: list[float]) -> float:
    """The bf16 gradient rule's baseline from the emulation's errors in several summation orders: the
    largest (the module's docstring says why not their RMS)."""
    return float(max(draws))


def _compare(test: State, truth: State, baseline: State | list[State], names: list[str], *, rule_tol,
             kind: str) -> dict[str, Any]:
    """Per parameter: the test's errors against truth, the baseline's rel_l2 (with several baselines, the
    summation orders, `grad_baseline` of theirs; each order's in baseline_orders_rel_l2), the tolerance
    and the verdict."""
    baselines = baseline if isinstance(baseline, list) else [baseline]
    rows, first = [], None
    for n in names:
        err = errors(test[n], truth[n])
        draws = [errors(b[n], truth[n])["rel_l2"] for b in baselines]
        err["baseline_rel_l2"] = grad_baseline(draws)
        if len(draws) > 1:
            err["baseline_orders_rel_l2"] = draws
        err["tol"] = rule_tol(err["baseline_rel_l2"])
        err["pass"] = bool(err["rel_l2"] <= err["tol"])
        rows.append({"param": n, **err})
        if not err["pass"] and first is None:
            first = {"param": n, "kind": kind, "rel_l2": err["rel_l2"], "tol": err["tol"]}
    return {"params": rows, "pass": first is None, "first_divergence": first}


def run_grad_case(case: Case, rule: Rule = RULE, *, runner: Runner | None = None, steps: int = max(STEPS),
                  opt: Optimizer = OPTIMIZER) -> dict[str, Any]:
    """Gradients and parameters after 1 and `steps` AdamW steps of the trainer against the oracle.

    Returns the case's entry of parity.json's `grad_cases`: id, model, variant, layout, policy
    (the oracle policy whose own error scales the tolerance), engine, dtype, seq_len, windows,
    loss (trainer, truth, baseline), grads / step@k / params@k / update@k ({"params": per-parameter
    rows in backward order, "pass", "first_divergence"}), pass, first_divergence (the first failing
    parameter going backwards from the loss: gradients first, then the steps), runtime_s.
    """
    t0 = time.perf_counter()
    runner = runner or get_runner(case.engine)
    if not hasattr(runner, "engine"):
        raise ValueError(f"runner {runner.name!r} has no torchtrain engine to train with")

    oracle_policy, dtype = resolve_policy(case.policy, runner)
    bf16 = dtype == "bfloat16"
    baseline_policy = oracle_policy if bf16 else "fp32"
    inputs = case_inputs(case)
    truth = oracle_training(case, inputs, TRUTH, steps, opt)
    base = oracle_training(case, inputs, baseline_policy, steps, opt)
    test = torch_training(case, inputs, dtype, runner.engine, steps, opt, build=getattr(runner, "build", None))
    names = backward_order(truth["grads"])
    if sorted(names) != sorted(test["grads"]):
        raise AssertionError(f"parameter names differ: trainer {sorted(set(test['grads']) ^ set(names))[:4]}")
    if bf16:
        tol = lambda b: rule.factor * b + rule.floor  # noqa: E731
    else:  # fp32 rounding through a deep backward exceeds 1e-5 (see the module docstring): the oracle's own fp32 bounds it
        tol = rule.fp32
    report_only = lambda b: float("inf")  # noqa: E731  (reported, not judged)
    # bf16: the emulation's error over the rule's summation orders (one order is one draw; the module's docstring)
    base_grads = [base["grads"], *oracle_grad_draws(case, inputs, baseline_policy, rule.grad_orders)] if bf16 \
        else base["grads"]
    sections: dict[str, Any] = {"grads": _compare(test["grads"], truth["grads"], base_grads, names, rule_tol=tol,
                                                  kind="grads")}
    # The optimizer: the trainer's step against the oracle's AdamW on the same gradients (deterministic,
    # so held to the fp32 rule in every dtype: both keep fp32 parameters)
    # (parameters, not updates: an update is small against its parameter and the fp32 roundings of
    # p_k would dominate the difference p_k − p_0)
    replay = replay_steps(test, opt)
    for k in sorted({1, steps}):
        sections[f"step@{k}"] = _compare(test["params"][k], replay[k], replay[k], names,
                                         rule_tol=lambda b: rule.fp32_tol, kind=f"step@{k}")
    # The trajectory against fp64 truth's (reported): parameters and updates after k steps
    for k in sorted({1, steps}):
        sections[f"params@{k}"] = _compare(test["params"][k], truth["params"][k], base["params"][k], names,
                                           rule_tol=report_only, kind=f"params@{k}")
        delta = lambda s: {n: s["params"][k][n].astype(np.float64) - s["params"][0][n] for n in names}  # noqa: E731
        sections[f"update@{k}"] = _compare(delta(test), delta(truth), delta(base), names, rule_tol=report_only,
                                           kind=f"update@{k}")
    first = next((s["first_divergence"] for s in sections.values() if s["first_divergence"]), None)
    return {
        "id": case.id.replace(f"/{case.engine}/", f"/{runner.name}/"),
        "model": case.model, "variant": case.variant, "layout": case.layout, "policy": oracle_policy,
        "baseline_policy": baseline_policy, "requested_policy": case.policy, "engine": runner.name, "dtype": dtype,
        "seq_len": case.seq_len, "windows": int(inputs.shape[0]), "seed": case.seed,
        "optimizer": opt.to_dict(), "steps": steps, "truth": TRUTH, "baseline_orders": rule.grad_orders if bf16 else 1,
        "loss": {"trainer": test["loss"], "truth": truth["loss"], "baseline": base["loss"]},
        **sections,
        "pass": first is None, "first_divergence": first,
        "runtime_s": round(time.perf_counter() - t0, 3),
    }


def describe_grads(result: dict[str, Any], limit: int = 12) -> str:
    """A printable table: per parameter (backward order) the gradient's and the last step's
    rel. L2 / tolerance."""
    last = f"step@{result['steps']}"
    lines = [f"{result['id']} (gradients and {result['steps']} AdamW steps): "
             f"{'pass' if result['pass'] else 'FAIL at ' + _where(result['first_divergence'])}",
             f"{'parameter':<48} {'grad rel L2/tol':>22} {'cosine':>10} {last + ' rel L2/tol':>24}"]
    ups = {r["param"]: r for r in result[last]["params"]}
    rows = result["grads"]["params"]
    shown = rows if len(rows) <= limit else rows[: limit // 2] + rows[-limit // 2:]
    for r in shown:
        u = ups[r["param"]]
        lines.append(f"{r['param']:<48} {r['rel_l2']:.1e}/{r['tol']:.1e}{'!' if not r['pass'] else ' '}"
                     f"{r['cosine']:>12.8f} {u['rel_l2']:>11.1e}/{u['tol']:.1e}{'!' if not u['pass'] else ' '}")
    return "\n".join(lines)


def _where(first: dict[str, Any] | None) -> str:
    return "-" if first is None else f"{first['kind']} of {first['param']}"


where_grads = _where
