"""PyTorch's default initialisation of a model's architecture, in numpy (no torch): the paper's
random-init baseline (Figure 1, green line: "initialized with kaiming_uniform_ in PyTorch by default").

  nn.Linear weight  kaiming_uniform_(a=√5)  =  U(−1/√fan_in, 1/√fan_in)
  nn.Linear bias    U(−1/√fan_in, 1/√fan_in)            (Qwen2's q/k/v biases)
  nn.Embedding      N(0, 1)
  RMSNorm weight    1                                   (Qwen3's q/k norms too)

An untied lm-head is an nn.Linear (fan_in = hidden size); a tied one is the embedding.
"""

from __future__ import annotations

import numpy as np

from anchor_core.spec import ModelSpec
from anchor_core.weights import expected_shapes


def torch_default_state(spec: ModelSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 Hugging Face-named state dict with PyTorch's default init for `spec`, seeded."""
    rng = np.random.default_rng(seed)
    state: dict[str, np.ndarray] = {}
    weights = {n: s for n, s in expected_shapes(spec).items() if not n.endswith(".bias")}
    for name, shape in expected_shapes(spec).items():
        if name.endswith("norm.weight"):
            w = np.ones(shape, dtype=np.float32)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape, dtype=np.float32)
        elif name.endswith(".bias"):
            fan_in = weights[name[: -len("bias")] + "weight"][1]
            bound = 1.0 / np.sqrt(fan_in)
            w = rng.uniform(-bound, bound, shape).astype(np.float32)
        else:  # nn.Linear weight (out, in), lm_head included
            bound = 1.0 / np.sqrt(shape[1])
            w = rng.uniform(-bound, bound, shape).astype(np.float32)
        state[name] = w
    return state
