"""The model part: a stock transformers model with torchtrain's attention, and what is computed on it.

Owns building the model from a model name or files (`build`: weights, config, engine, RoPE), the next-token
loss (`loss`, fused with the lm-head in chunks), the per-layer taps the parity tests read (`taps`) and the
tiled MLP (`tiling`).

May import: the attention part, anchor_core, torch, transformers.
"""

from torchtrain.model.build import (DType, build_model, empty_model, model_from_weights, set_engine, set_rope,
                                    torch_dtype, with_rope)

__all__ = ["DType", "build_model", "empty_model", "model_from_weights", "set_engine", "set_rope", "torch_dtype",
           "with_rope"]
