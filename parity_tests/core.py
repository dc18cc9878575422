"""The comparison: per layer and tap, the trainer's error against fp64 truth, judged by one rule.

Legend: L layers, B windows, T slots, R tapped rows, V vocabulary.

Errors are measured on real slots only (padding attends only to itself and is never trained on):
  rel_l2   ‖x − truth‖ / ‖truth‖ over the tap's real entries (float64)
  max_abs  max |x − truth|
  kl       (logits) per-token KL(truth ‖ x) of the output distributions: mean and max over tokens

The rule (flash-attention's tests: tolerances relative to a measured baseline):
  fp32  rel_l2(trainer, fp64) <= max(1e-5, 2 · rel_l2(oracle in fp32, fp64)) for every tap of every
        layer (`Rule.fp32`; the oracle's fp32 run passes 1e-5 only where fp32 rounding through the
        stack does, at an outlier activation deep in a trained model);
  bf16  rel_l2(trainer, fp64) <= 2 · rel_l2(emulation, fp64) + floor, where the emulation is the
        oracle running the same stack's arithmetic (runners.EMULATIONS: hf_bf16 for eager, torch's
        fused CPU kernel for sdpa, FlashAttention-2 for flash and flex); for the logits also mean
        KL(trainer) <= 2 · mean KL(emulation) + floor.
        The emulation's error is its RMS over `Rule.orders` summation orders (runners.oracle_taps:
        the same model with its units listed in other orders). The emulation follows each rounding
        of the stack but not the order in which MKL, oneDNN or cuBLAS add a matmul's fp32 terms, and
        no one order is the stack's: a token that amplifies its input's rounding (SmolLM2's
        massive activation at a document start, layer 11) lands a different bf16 error in each
        order, and torch's is one of them (parity_tests/test_matrix.py's note). One order's error
        is one draw; the RMS over orders is the arithmetic's error the factor 2 is meant to scale.
The first failing (layer, tap) in forward order (embed; per layer q, k, scores, probs, attn_out,
mlp_out, hidden; logits) is the first divergent one: a defect shows there first and everything
after it inherits the error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity_tests.cases import CaseInputs
from parity_tests.runners import PER_LAYER, TAP_ORDER, Taps

HEAD = "head"  # the layer label of the final logits
EMBED = "embed"  # the layer label of the embeddings


@dataclass(frozen=True)
class Rule:
    """Pass criteria. fp32: `rel_l2 <= max(fp32_tol, factor · baseline)`, the baseline the oracle's own fp32
    error against fp64 where one was measured (`fp32`). bf16: `rel_l2 <= factor · baseline + floor`."""

    fp32_tol: float = 1e-5
    factor: float = 2.0
    floor: float = 1e-3  # bf16: an eighth of bf16's epsilon (2^-7), relative
    orders: int = 4  # bf16: summation orders whose RMS error is the baseline
    kl_floor: float = 1e-5  # bf16: nats per token
    grad_orders: int = 8  # bf16 gradients: summation orders whose largest error is the baseline (grads.py)

    def fp32(self, baseline: float | None = None) -> float:
        """The fp32 tolerance of a tap or gradient: `fp32_tol`, or twice the oracle's own fp32 error where
        that is larger (fp32 rounding through a deep stack passes 1e-5 at an outlier activation: then no
        fp32 computation of the same math holds 1e-5, and the oracle's fp32 run is the measure)."""
        return self.fp32_tol if baseline is None else max(self.fp32_tol, self.factor * baseline)

    def to_dict(self) -> dict[str, float]:
        return {"fp32_tol": self.fp32_tol, "factor": self.factor, "floor": self.floor, "kl_floor": self.kl_floor,
                "orders": self.orders, "grad_orders": self.grad_orders}


RULE = Rule()


def real_selector(name: str, inputs: CaseInputs) -> np.ndarray:
    """Boolean mask broadcastable to one layer of tap `name` selecting entries of real slots.

    [B,T,...] taps: real[b, t]; scores/probs [B,N,R,T]: real query row and real key.
    """
    real = inputs.real
    if name in ("scores", "probs"):
        rows = np.asarray(inputs.rows, dtype=np.int64)
        return real[:, rows][:, None, :, None] & real[:, None, None, :]
    return real


def _flat(x: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """The entries of x selected by sel (broadcast over trailing axes), as float64."""
    sel = sel.reshape(sel.shape + (1,) * (x.ndim - sel.ndim))
    return x[np.broadcast_to(sel, x.shape)].astype(np.float64)


def tap_errors(x: np.ndarray, truth: np.ndarray, sel: np.ndarray) -> dict[str, float]:
    """max_abs and rel_l2 of one layer's tap against the truth, on selected entries."""
    a, b = _flat(x, sel), _flat(truth, sel)
    d = a - b
    norm = float(np.linalg.norm(b))
    return {
        "max_abs": float(np.abs(d).max()) if d.size else 0.0,
        "rel_l2": float(np.linalg.norm(d) / norm) if norm > 0 else float(np.linalg.norm(d)),
    }


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_kl(logits: np.ndarray, truth: np.ndarray, real: np.ndarray, chunk: int = 256) -> np.ndarray:
    """Per-token KL(softmax(truth) ‖ softmax(logits)) on real slots. logits/truth [B,T,V]; returns [n]."""
    x, t = logits[real], truth[real]
    out = []
    for i in range(0, x.shape[0], chunk):  # bounded memory at large vocabularies
        lt, lx = _log_softmax(t[i:i + chunk]), _log_softmax(x[i:i + chunk])
        out.append((np.exp(lt) * (lt - lx)).sum(axis=-1))
    return np.maximum(np.concatenate(out) if out else np.zeros(0), 0.0)


def layer_labels(num_layers: int) -> list[Any]:
    """Labels of the entries of a `layers` list: "embed", 0 … L-1, "head"."""
    return [EMBED, *range(num_layers), HEAD]


def _taps_of(label: Any) -> tuple[str, ...]:
    if label == EMBED:
        return ("embed",)
    if label == HEAD:
        return ("logits",)
    return PER_LAYER


def _layer_index(name: str, label: Any) -> int:
    return 0 if label in (EMBED, HEAD) else int(label)


def compare(test: Taps, truth: Taps, inputs: CaseInputs, *, baseline: Taps | Sequence[Taps] | None = None,
            emulation: Taps | None = None) -> list[dict[str, Any]]:
    """Per-layer, per-tap errors of `test` against `truth`.

    Args:
      test: the trainer's taps (a runner may give a subset; only those are compared).
      truth: the oracle's fp64 taps.
      baseline: the oracle run whose error against the truth scales the bf16 tolerance (and is
        reported for fp32 cases: the oracle's own fp32 error); several runs (summation orders):
        the RMS of their errors, and the mean of their logits' KL.
      emulation: the oracle run the trainer is also measured against directly (emulation
        fidelity: `vs_emulation_rel_l2`).
    Returns:
      [{"layer": label, "taps": {name: {"max_abs", "rel_l2", "baseline_rel_l2"?, "vs_emulation_rel_l2"?,
        and for logits "kl_mean", "kl_max", "baseline_kl_mean"?}}}] for labels embed, 0…L-1, head.
    """
    L = truth["q"].shape[0]
    baselines = [baseline] if isinstance(baseline, dict) else list(baseline or [])
    layers = []
    for label in layer_labels(L):
        entry: dict[str, Any] = {"layer": label, "taps": {}}
        for name in _taps_of(label):
            if name not in test:
                continue
            i = _layer_index(name, label)
            sel = real_selector(name, inputs)
            err = tap_errors(test[name][i], truth[name][i], sel)
            if baselines:
                errs = [tap_errors(b[name][i], truth[name][i], sel)["rel_l2"] for b in baselines]
                err["baseline_rel_l2"] = float(np.sqrt(np.mean(np.square(errs))))
                if len(errs) > 1:
                    err["baseline_orders_rel_l2"] = errs
            if emulation is not None:
                err["vs_emulation_rel_l2"] = tap_errors(test[name][i], emulation[name][i], sel)["rel_l2"]
            if name == "logits":
                kl = token_kl(test[name][0], truth[name][0], inputs.real)
                err["kl_mean"], err["kl_max"] = float(kl.mean()), float(kl.max())
                if baselines:
                    err["baseline_kl_mean"] = float(np.mean(
                        [token_kl(b[name][0], truth[name][0], inputs.real).mean() for b in baselines]))
            entry["taps"][name] = err
        layers.append(entry)
    return layers


def judge(layers: list[dict[str, Any]], bf16: bool, rule: Rule = RULE) -> dict[str, Any]:
    """Apply the rule to every (layer, tap) in forward order; marks each tap's `tol` and `pass`.

    Returns {"pass": bool, "first_divergence": {"layer", "tap", "rel_l2", "tol"} or None,
    "failures": number of failing taps}.
    """
    first = None
    failures = 0
    for entry in layers:
        for name in TAP_ORDER:
            err = entry["taps"].get(name)
            if err is None:
                continue
            if bf16:
                tol = rule.factor * err["baseline_rel_l2"] + rule.floor
                ok = err["rel_l2"] <= tol
                if name == "logits":
                    kl_tol = rule.factor * err["baseline_kl_mean"] + rule.kl_floor
                    err["kl_tol"] = kl_tol
                    ok = ok and err["kl_mean"] <= kl_tol
            else:
                tol = rule.fp32(err.get("baseline_rel_l2"))
                ok = err["rel_l2"] <= tol
            err["tol"], err["pass"] = tol, bool(ok)
            if not ok:
                failures += 1
                if first is None:
                    first = {"layer": entry["layer"], "tap": name, "rel_l2": err["rel_l2"], "tol": tol}
    return {"pass": first is None, "first_divergence": first, "failures": failures}


def fidelity(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Emulation fidelity per layer (bf16 cases): for each tap, the trainer's distance to the oracle's
    emulation against each one's distance to fp64, and their ratio (≪ 1: the emulation models the
    stack; ≈ 1: independent roundings of the same size; ≫ 1: it does not model it)."""
    out = []
    for entry in layers:
        row = {"layer": entry["layer"], "taps": {}}
        for name, err in entry["taps"].items():
            if "vs_emulation_rel_l2" not in err or "baseline_rel_l2" not in err:
                continue
            scale = max(err["rel_l2"], err["baseline_rel_l2"])
            row["taps"][name] = {
                "trainer_vs_emulation": err["vs_emulation_rel_l2"],
                "trainer_vs_fp64": err["rel_l2"],
                "emulation_vs_fp64": err["baseline_rel_l2"],
                "ratio": err["vs_emulation_rel_l2"] / scale if scale > 0 else 0.0,
            }
        out.append(row)
    return out


def worst_margin(layers: list[dict[str, Any]]) -> float:
    """max over judged taps of rel_l2 / tol (< 1: every tap passes)."""
    return max((e["rel_l2"] / e["tol"] for entry in layers for e in entry["taps"].values() if e.get("tol")),
               default=0.0)


def hold(test: Taps, truth: Taps, inputs: CaseInputs, *, bf16: bool, baseline: Sequence[Taps] = (),
         rule: Rule = RULE) -> dict[str, Any]:
    """The one judgement of every parity comparison (the suite's cases, transformers' stacks and users'
    functions, the black-box check): `compare` layer by layer, `judge` by the rule.

    bf16: judge by the bf16 rule (`baseline` required: the emulation's runs, one per summation order, the
      first the emulation itself, also measured against directly); else by the fp32 rule (a `baseline`
      given is reported, not used).
    Returns {"pass", "first_divergence", "failures", "layers", "worst_margin", "summary": {"logits_rel_l2",
    "logits_baseline_rel_l2", "logits_kl_mean", "worst_margin"}} and, in bf16, "fidelity".
    """
    if bf16 and not baseline:
        raise ValueError("the bf16 rule needs the emulation's runs as its baseline")
    baseline = list(baseline)
    layers = compare(test, truth, inputs, baseline=baseline or None, emulation=baseline[0] if baseline else None)
    verdict = judge(layers, bf16, rule)
    margin = worst_margin(layers)
    logits = layers[-1]["taps"].get("logits", {})
    out = {**verdict, "layers": layers, "worst_margin": margin,
           "summary": {"logits_rel_l2": logits.get("rel_l2"), "logits_baseline_rel_l2": logits.get("baseline_rel_l2"),
                       "logits_kl_mean": logits.get("kl_mean"), "worst_margin": margin}}
    if bf16:
        out["fidelity"] = fidelity(layers)
    return out
