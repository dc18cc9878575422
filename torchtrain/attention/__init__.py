"""The attention part: how a window's masks become attention, on every engine.

Owns the mask predicate of each variant (`variants`, docs/DESIGN.md §2), the varlen segments (`varlen`) and the
kernels that run them (`varlen_sdpa`: fused SDPA calls bucketed by length; `varlen_emulation`: a pure-torch
flash_attn_varlen_func), each engine's math (`functions`), and the engine registry (`engines`: selection,
availability, per-step metadata, transformers' registration).

May import: anchor_core, torch, transformers. Nothing else of torchtrain (the lowest layer, with `config`).
"""

from torchtrain.attention.functions import (FLEX_MIN_HEAD_DIM, call_flex, compiled_flex_attention, eager_attention,
                                            expand_kv, flex_attention, sdpa_attention, varlen_attention)

__all__ = ["FLEX_MIN_HEAD_DIM", "call_flex", "compiled_flex_attention", "eager_attention", "expand_kv",
           "flex_attention", "sdpa_attention", "varlen_attention"]
