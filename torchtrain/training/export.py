"""A checkpoint's hf/: the model as transformers' save_pretrained writes it, gathered one layer at a time.

    export_model(module, spec, folder, zero3=..., tokenizer_of=..., train_dtype=..., export_dtype=...)

config.json and generation_config.json (the spec's, checked by reading them back), the weights as safetensors
(sharded past `max_shard_size`, with their index) in the export dtype, the tokenizer. Under ZeRO-3 each layer's
parameters are gathered on every rank in turn and rank 0 writes them before the next layer is gathered.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from anchor_core.export import (DEFAULT_MAX_SHARD_SIZE, ShardWriter, TensorInfo, resolve_export_dtype,
                                shard_size_bytes, write_tokenizer)
from anchor_core.spec import from_hf_config, to_hf_config

if TYPE_CHECKING:
    from anchor_core.spec import ModelSpec

_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def gather_groups(named: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    """The model's parameters (`named_parameters()`, in order) in the groups the export gathers together:
    each decoder layer's (`...layers.<i>.`) as one group, every other parameter (embeddings, final norm,
    lm_head) alone."""
    groups: list[list[tuple[str, Any]]] = []
    last = None
    for name, p in named:
        m = _LAYER.match(name)
        key = m.group(1) if m else name
        if groups and key == last:
            groups[-1].append((name, p))
        else:
            groups.append([(name, p)])
        last = key
    return groups


def _full_shape(p: Any) -> tuple[int, ...]:
    """A parameter's whole shape, also while ZeRO-3 holds only this rank's partition of it."""
    return tuple(int(s) for s in getattr(p, "ds_shape", p.shape))


def export_model(module: Any, spec: ModelSpec, folder: Path | None, *, zero3: bool, tokenizer_of: str,
                 train_dtype: str, export_dtype: str = "auto",
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Write the transformers model `module` (DeepSpeed's engine.module) as a Hugging Face folder, as
    transformers' `save_pretrained` writes it; every rank calls it, rank 0 with the `folder` to write
    (the others with None).

    Weights: the model's parameters (what transformers saves: tied weights once, no RoPE `inv_freq`, a
    non-persistent buffer) in `export_dtype` ("auto": `train_dtype`; a float32 export of a bf16 run holds the
    bf16 weights widened), split at `max_shard_size` (transformers' notation; default transformers' own).
    Under ZeRO-3 (`zero3`) each group of `gather_groups` (a decoder layer, the embeddings, the final norm,
    lm_head) is gathered on its own (`deepspeed.zero.GatheredParameters`, modifier_rank None: nothing is
    written back) and rank 0 writes its tensors into their shard before the next is gathered (`ShardWriter`),
    so no rank holds more than one layer beyond its own partition, and rank 0 no shard.
    Config: the model's own (`config.to_dict()`), with the spec as trained (RoPE, max_position), the export
    dtype, and `use_cache` as transformers' default (training turns the cache off); its generation config;
    the tokenizer of the model `tokenizer_of`."""
    import deepspeed
    import torch

    dtype = resolve_export_dtype(export_dtype, train_dtype)
    limit = shard_size_bytes(max_shard_size)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    kind = "F32" if dtype == "float32" else "BF16"
    named = list(module.named_parameters())
    writer = None
    if folder is not None:
        writer = ShardWriter(folder, [TensorInfo(n, _full_shape(p), kind) for n, p in named], limit)
    try:
        for group in gather_groups(named):
            gathered = (deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None) if zero3
                        else contextlib.nullcontext())
            with gathered, torch.no_grad():
                if writer is not None:
                    for name, p in group:
                        writer.add(name, _as_numpy(p.detach().to(device="cpu", dtype=tdtype)))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if folder is None or writer is None:
        return
    writer.close()
    _write_configs(module, spec, folder, dtype)
    write_tokenizer(tokenizer_of, spec, folder)


def _as_numpy(t: Any) -> np.ndarray:
    """A CPU float32 or bfloat16 tensor as numpy (bfloat16: ml_dtypes', the same bytes)."""
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def _write_configs(module: Any, spec: ModelSpec, folder: Path, dtype: str) -> None:
    """config.json from the model's own config (`config.to_dict()`, the spec's values over it), written by
    transformers (`save_pretrained`), and generation_config.json where the model generates. It must read back
    as the spec (every reader of hf/ reads it through anchor_core.spec.from_hf_config)."""
    config = type(module.config).from_dict({**module.config.to_dict(), **to_hf_config(spec), "dtype": dtype,
                                            "use_cache": True})
    config.save_pretrained(folder)
    back = from_hf_config(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    if back != spec:
        raise AssertionError(f"hf/config.json reads back as {back}, not the model trained {spec}")
    if module.can_generate() and getattr(module, "generation_config", None) is not None:
        from transformers import GenerationConfig

        generation = GenerationConfig.from_dict(module.generation_config.to_dict())
        generation.use_cache = True
        generation.save_pretrained(folder)
