"""How often XLA's CPU division by a broadcast differs from IEEE division, and what it does to the oracle's softmax.

XLA rewrites `a / broadcast(b)` into `a * broadcast(1 / b)` (one reciprocal per row), which is not correctly rounded.
torch divides element by element. This measures, on random rows:
  quotient   a / s with s one scalar and with s one per row, against numpy's division (fp32);
  softmax    the oracle's dense softmax `e / sum(e)` in fp32 against the same with a full-shape divisor, and both
             after rounding to bf16 (what hf_bf16's probabilities are cast to before p·v).
Writes results/measure.json beside this file (machine included)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxref  # noqa: F401  (x64 on, as the oracle runs)
from anchor_core.machine import machine


def main() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(1024, 515)).astype(np.float32)
    s = np.float32(57344.0)
    rows = rng.uniform(1, 1000, size=(1024, 1)).astype(np.float32)
    by_scalar = np.asarray(jax.jit(lambda a, s: a / s)(a, s))
    by_row = np.asarray(jax.jit(lambda a, r: a / r)(a, rows))
    full = np.asarray(jax.jit(lambda a, r: a / jax.lax.optimization_barrier(jnp.broadcast_to(r, a.shape)))(a, rows))
    x = (rng.normal(size=(1024, 515)) * 3).astype(np.float32)

    def softmax(x, barrier):
        e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
        d = jnp.sum(e, axis=-1, keepdims=True)
        return e / (jax.lax.optimization_barrier(jnp.broadcast_to(d, e.shape)) if barrier else d)

    p_xla = np.asarray(jax.jit(lambda x: softmax(x, False))(x))
    p_div = np.asarray(jax.jit(lambda x: softmax(x, True))(x))
    bf = ml_dtypes.bfloat16
    out = {
        "machine": machine(jax_backend=jax.default_backend()),
        "quotient_by_scalar_mismatch": float(np.mean(by_scalar != a / s)),
        "quotient_by_row_mismatch": float(np.mean(by_row != a / rows)),
        "quotient_full_shape_mismatch": float(np.mean(full != a / rows)),
        "softmax_fp32_mismatch": float(np.mean(p_xla != p_div)),
        "softmax_fp32_max_ulps": float(np.max(np.abs(p_xla.view(np.int32).astype(np.int64)
                                                     - p_div.view(np.int32).astype(np.int64)))),
        "softmax_bf16_mismatch": float(np.mean(p_xla.astype(bf) != p_div.astype(bf))),
        "elements": int(a.size),
    }
    path = Path(__file__).parent / "results" / "measure.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
