"""jaxref: the numerical oracle.

A JAX reference of the Llama-family decoder, RoPE and every attention variant of docs/DESIGN.md §2,
with a dtype policy per numerical stage (docs/DESIGN.md §4), so it plays fp64 truth or emulates a bf16
stack. It never imports torch. With the `fp32` policy on the CPU, attention runs in a fused C++
kernel (`jaxref.kernels`, compiled on first use); `jaxref.forward(..., fused=False)` keeps the JAX
path, and the environment variable `JAXREF_FUSED_ATTENTION=0` makes that the default (read by
`forward` on each call, never set by jaxref). Gradients always trace the JAX path.

    params, config = jaxref.load_model("random:llama")
    logits = jaxref.forward(params, config, tokens, doc_ids=doc_ids, variant="anchor", policy="hf_bf16")
"""

import os

# Keep every bf16 operation rounded where the emulated stack rounds: by default XLA may skip
# the rounding between fused elementwise ops ("excess precision"), which torch never does.
if "--xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()

import jax  # noqa: E402

# fp64 is the oracle's truth; every array in jaxref is created with an explicit dtype.
jax.config.update("jax_enable_x64", True)

from jaxref.device import use_device  # noqa: E402
from jaxref.executor import forward  # noqa: E402
from jaxref.loading import load_model, restore_params, save_params  # noqa: E402
from jaxref.policy import PRESETS, STAGES, DtypePolicy, get_policy, parse_policies  # noqa: E402
from jaxref.reference import params_from_state  # noqa: E402
from jaxref.train import adamw, hf_state, optimizer_step, value_and_grad  # noqa: E402
from jaxref.variants import VARIANTS, Variant, attention_mask, positions  # noqa: E402

__all__ = [
    "PRESETS", "STAGES", "VARIANTS", "DtypePolicy", "Variant", "adamw", "attention_mask", "forward", "get_policy",
    "hf_state", "load_model", "optimizer_step", "params_from_state", "parse_policies", "positions", "restore_params",
    "save_params",
    "use_device", "value_and_grad",
]
