"""Will the oracle's gradient at T=8192 fit a GPU? XLA's own memory plan of the differentiated program.

    .venv/bin/python benchmarks/bench_oracle_grad_memory.py [--lengths 1025,8192] [--policies fp64,fa2_bf16,flex_bf16]

Parity's gradient cases at T=8192 need the oracle on JAX's CUDA backend (on a CPU one fp64 gradient takes
longer than a device call; tools/gpu_parity.sh). No GPU is needed to know what it asks for: this
lowers and compiles `jaxref.value_and_grad`'s program (`jaxref.train._value_and_grad`, each layer
recomputed in the backward, as parity runs it) for SmolLM2 with its real weights, one window, the anchor
variant with two documents, and records XLA's memory analysis of it: temporaries, arguments, outputs.
Nothing runs. The plan is the CPU backend's: the CUDA backend schedules and fuses otherwise, so its
figure is an estimate of the same order, not the GPU's number. Writes
results/memory/oracle_grad_memory_cpu.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def plan(params, spec, seq_len: int, policy: str) -> dict:
    """XLA's memory analysis (GiB) and the compile's seconds of the gradient program at `seq_len`."""
    import jax.numpy as jnp
    import numpy as np

    from jaxref.policy import get_policy
    from jaxref.train import _value_and_grad
    from jaxref.variants import positions

    doc = np.zeros((1, seq_len), np.int32)
    doc[:, seq_len // 2:] = 1  # the anchor at slot 0, then two documents
    pos = positions(doc, "anchor")
    t0 = time.perf_counter()
    compiled = _value_and_grad.lower(
        params, jnp.zeros((1, seq_len), jnp.int32), jnp.asarray(pos, jnp.int64), jnp.asarray(doc),
        jnp.ones((1, seq_len), jnp.int32), spec=spec, policy=get_policy(policy), variant="anchor", seq_len=None,
        remat=True).compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    size = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output")}
    return {"seq_len": seq_len, "policy": policy, **{f"{k}_gib": round(v / 2**30, 2) for k, v in size.items()},
            "total_gib": round(sum(size.values()) / 2**30, 2), "bytes": size, "compile_s": round(seconds, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1025,8192")
    ap.add_argument("--policies", default="fp64,fa2_bf16,flex_bf16")
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "results" / "memory" / "oracle_grad_memory_cpu.json")
    args = ap.parse_args()
    import jaxref
    from anchor_core.atomic import write_text_atomic
    from anchor_core.machine import machine

    params, spec = jaxref.load_model(args.model)
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        for p in args.policies.split(","):
            rows.append(plan(params, spec, T, p))
            print(json.dumps(rows[-1]), flush=True)
    record = {"benchmark": "XLA's memory plan of the oracle's gradient program (jaxref.value_and_grad, remat), "
                           "one window, anchor variant; compiled on the CPU backend, not run",
              "model": args.model,
              "note": "An estimate for the GPU: the CUDA backend plans its own buffers. Per gradient case, "
                      "parity runs the fp64 program and the emulation's, one at a time.",
              "rows": rows, "machine": machine(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_text_atomic(args.out, json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
