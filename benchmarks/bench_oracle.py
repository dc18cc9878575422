"""Oracle fp32 forward vs transformers' fp32 SDPA forward on SmolLM2, in one run.

    .venv/bin/python benchmarks/bench_oracle.py [--lengths 1024,4096] [--repeats 3]

Writes results/speed/oracle_forward_<machine>.json. Both sides get the same weights (the
embedded SmolLM2 GGUF), batch 1, the `full` variant. The oracle's attention runs in its fused fp32
kernel where it is built (recorded as `oracle_attention`; `JAXREF_FUSED_ATTENTION=0`, read once at
the start and passed as `jaxref.forward(..., fused=...)`, measures the JAX path). After one warm-up
each (JAX compiles there; reported separately) the two sides run in alternation for `--repeats`
rounds; the ratio is that of the medians, and each round's own ratio is recorded too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def paired(fns: dict, repeats: int) -> tuple[dict, dict]:
    """One untimed first call each (JAX compiles there), then `repeats` rounds that run every
    function once, in turn, so slow drift of the machine hits both sides alike."""
    first, runs = {}, {name: [] for name in fns}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    return first, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "speed"))
    args = ap.parse_args()

    import jax
    import torch

    import jaxref
    from jaxref import kernels
    from anchor_core.machine import machine
    from transformers import AutoConfig, AutoModelForCausalLM

    from anchor_core.spec import to_hf_config
    from anchor_core.weights import load_weights

    fused = kernels.enabled()  # the user's switch, read once
    spec, state = load_weights(args.model)
    params = jaxref.params_from_state(spec, state)
    # Stock transformers with its own SDPA attention (causal), not one of torchtrain's engines.
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(spec)), attn_implementation="sdpa",
                                          dtype=torch.float32).eval()
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        tokens = np.random.default_rng(T).integers(3, spec.vocab_size, (1, T))
        ids = torch.from_numpy(tokens)

        def oracle():
            jax.block_until_ready(jaxref.forward(params, spec, tokens, policy="fp32", fused=fused))

        def transformers_sdpa():
            with torch.inference_mode():
                hf(input_ids=ids, use_cache=False)

        first, runs = paired({"oracle": oracle, "transformers": transformers_sdpa}, args.repeats)
        o, t = statistics.median(runs["oracle"]), statistics.median(runs["transformers"])
        pair = [a / b for a, b in zip(runs["oracle"], runs["transformers"])]
        row = {"T": T, "oracle_fp32_s": o, "oracle_first_call_s": first["oracle"], "transformers_sdpa_fp32_s": t,
               "transformers_first_call_s": first["transformers"], "ratio_oracle_over_transformers": o / t,
               "ratio_per_round": pair, "oracle_runs_s": runs["oracle"], "transformers_runs_s": runs["transformers"]}
        print(json.dumps(row))
        rows.append(row)
    fused = fused and kernels.available()
    result = {"benchmark": "oracle_forward", "model": args.model, "batch": 1, "variant": "full",
              "oracle_attention": "fused fp32 C++ kernel (jaxref.kernels)" if fused else "JAX (blocked dense)",
              "target": "ratio_oracle_over_transformers <= 1", "machine": machine(torch_threads=torch.get_num_threads()),
              "results": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu" if result["machine"].get("gpu") else "cpu"
    path = out / f"oracle_forward_{name}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
