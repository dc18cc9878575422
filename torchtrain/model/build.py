"""Stock Hugging Face transformers models with torchtrain attention engines (docs/DESIGN.md §7).

Weights come from `anchor_core.weights.load_weights` (the oracle reads the same float32 arrays), the
config from `anchor_core.spec.to_hf_config` (the one translation point), the model from
`AutoModelForCausalLM.from_config` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM: `anchor_core.spec`'s families); no transformers file is patched. The engines see q and k
as the model's attention module hands them over, after RoPE (and, in Qwen3, after its q/k norms).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from anchor_core.errors import InputError
from anchor_core.spec import ModelSpec, RopeSpec, to_hf_config
from anchor_core.weights import load_weights
from torchtrain.attention.engines import Engine, attn_implementation, check_engine, install

DType = Literal["float32", "bfloat16"]
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(dtype: object) -> torch.dtype:
    """"float32"/"bfloat16" (or the torch dtype itself) as a torch dtype; anything else is an InputError."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if dtype not in _DTYPES:
        raise InputError(f"unsupported model dtype {dtype!r} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[dtype]  # type: ignore[index]


def model_from_weights(spec: ModelSpec, state: Mapping[str, np.ndarray], engine: Engine = "sdpa", dtype: DType = "float32") -> nn.Module:
    """A transformers causal LM of `spec` holding `state` (float32 numpy, Hugging Face names).

    Parameters are rounded to `dtype` on load; the RoPE `inv_freq` buffers stay float32 (built by
    `from_config(..., dtype=)`, never by `model.to(dtype)`, which would round them to bf16).
    """
    model = empty_model(spec, engine, dtype)
    tensors = {k: torch.tensor(v) for k, v in state.items()}  # a copy: GGUF arrays are read-only views
    if spec.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed_missing = ["lm_head.weight"] if spec.tie_embeddings else []
    if sorted(missing) != allowed_missing or unexpected:
        raise InputError(f"weights do not fit the {spec.family} model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if spec.tie_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("transformers did not tie lm_head to embed_tokens")
    for name, buf in model.named_buffers():
        if name.endswith("inv_freq") and buf.dtype != torch.float32:
            raise AssertionError(f"{name} is {buf.dtype}; RoPE frequencies must stay float32")
    return model


def empty_model(spec: ModelSpec, engine: Engine = "sdpa", dtype: DType = "float32") -> nn.Module:
    """A transformers causal LM of `spec` with the engine installed and its weights as transformers initialises
    them (`model_from_weights` loads the real ones; under DeepSpeed's `zero.Init`, torchtrain.parallel.sharded_build
    fills each rank's partitions)."""
    tdtype = torch_dtype(dtype)
    engine = check_engine(engine, tdtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**to_hf_config(spec))
    config.use_cache = False  # a cache would make transformers skip its own packed-sequence handling
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation(engine), dtype=tdtype)
    model.anchor_spec = spec
    return install(model, engine)


def with_rope(spec: ModelSpec, rope: RopeSpec | Mapping[str, Any] | None) -> ModelSpec:
    """`spec` with its RoPE overridden (`build_model`'s `rope`); a bad override is an InputError."""
    if isinstance(rope, RopeSpec):
        return spec.replace(rope=rope)
    if rope is None:
        return spec
    try:
        return spec.with_rope(**rope)
    except TypeError as e:
        raise InputError(f"bad RoPE override {dict(rope)}: {e}") from None


def build_model(
    name: str,
    engine: Engine = "sdpa",
    dtype: DType = "float32",
    rope: RopeSpec | Mapping[str, Any] | None = None,
    *,
    seed: int = 0,
) -> nn.Module:
    """A stock transformers causal LM with a torchtrain attention engine (docs/DESIGN.md §7).

    Args:
      name: a local Hugging Face folder, a `.gguf` file, "default"/"smollm2", or `random:<preset>`.
      engine: one of torchtrain.ENGINES; unavailable ones raise UnavailableError.
      dtype: "float32" or "bfloat16" (parameters and activations; RoPE frequencies stay float32).
      rope: override the model's RoPE, a `RopeSpec` or a mapping of its fields (e.g. {"base": 1e6}).
      seed: seed of `random:` presets (the oracle uses the same weights for the same seed).
    Returns:
      the model; `model(input_ids=..., position_ids=..., doc_ids=..., variant=...)` -> `.logits`
      [B, T, V]; `model.anchor_spec` is its ModelSpec.
    """
    spec, state = load_weights(name, seed=seed)
    return model_from_weights(with_rope(spec, rope), state, engine, dtype)


def set_engine(model: nn.Module, engine: Engine) -> nn.Module:
    """Switch a built model to another engine in place (same weights). Returns the model."""
    return install(model, engine)


def set_rope(model: nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Make `model`'s rotary embeddings those of `spec` (a phase of a length schedule changes its RoPE base and
    length: torchtrain.training.phases): every module holding an `inv_freq` buffer takes the scaling, type, lengths and
    config a fresh one built for `spec` has, and `model.anchor_spec` becomes `spec`. Returns the fresh modules'
    float32 buffers by name (inv_freq, original_inv_freq), which the caller writes into the model's own (the
    trainer's `_restore_rope_buffers`: DeepSpeed's bf16 mode casts buffers, and a checkpoint's load is followed by
    the same restore), so the buffers stay the tensors DeepSpeed's engine knows."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**to_hf_config(spec))
    buffers: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if "inv_freq" not in module._buffers:
            continue
        fresh = type(module)(config=config)
        for attr in ("attention_scaling", "rope_type", "max_seq_len_cached", "original_max_seq_len", "config"):
            if hasattr(fresh, attr):
                setattr(module, attr, getattr(fresh, attr))
        for b, value in fresh.named_buffers():
            buffers[f"{name}.{b}" if name else b] = value.detach().to(torch.float32)
    model.anchor_spec = spec
    return buffers
