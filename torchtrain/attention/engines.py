"""Attention engines: selection, availability, per-step mask metadata, and transformers registration.

Every engine is registered in transformers' `AttentionInterface` (`attn_implementation(engine)`), so stock
Llama/Mistral/Qwen2/Qwen3 models call it in every decoder layer. The variant and the documents come in
as forward keywords (`doc_ids` [B, T], `variant`); a forward pre-hook on the decoder stack
(`install`) turns them into an `AttnMeta` once per forward step (dense mask, block mask or varlen
segments) and passes it to every layer as the keyword `attn_meta`.

  eager                  dense bool mask, Hugging Face eager arithmetic: the reference
  sdpa                   F.scaled_dot_product_attention with the dense bool mask; trains on CPU
  flex                   compiled FlexAttention with a BlockMask; CPU forward only, trains on CUDA
  flash_varlen           flash_attn_varlen_func on gathered segments (CUDA, bf16/fp16)
  flash_varlen_emulated  the same segments through torchtrain.attention.varlen_emulation (pure torch, any device)
  varlen                 the same segments through fused SDPA calls bucketed by length (torchtrain.attention.varlen_sdpa);
                         trains on CPU, and on CUDA through torch's varlen kernel or FlexAttention

`anchor train` also takes `auto` (its default), which `resolve_engine` turns into flash_varlen or
varlen: memory linear in T. eager and sdpa hold T x T tensors (`dense_attention_bytes`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from anchor_core.engines import AUTO, ENGINES, Engine  # the names; AUTO is not an engine (resolve_engine)
from anchor_core.errors import InputError, UnavailableError
from torchtrain.attention import functions as attn
from torchtrain.attention.variants import Variant, check_doc_ids, check_variant, dense_mask, mask_predicate
from torchtrain.attention.varlen import VarlenSegments, varlen_segments
from torchtrain.attention.varlen_emulation import flash_attn_varlen_func as emulated
from torchtrain.attention.varlen_plan import VarlenPlan, plan
from torchtrain.attention.varlen_sdpa import varlen_sdpa_attention

# Registered names: transformers treats any name containing "flash" as a FlashAttention kernel
# request (and tries to import it), so the varlen engines register without that word.
_ATTN_NAMES: dict[str, str] = {
    "eager": "torchtrain_eager",
    "sdpa": "torchtrain_sdpa",
    "flex": "torchtrain_flex",
    "flash_varlen": "torchtrain_varlen",
    "flash_varlen_emulated": "torchtrain_varlen_emulated",
    "varlen": "torchtrain_varlen_bucketed",
}
TAP_ATTR = "_torchtrain_tap"  # set on attention modules by torchtrain.model.taps while capturing
SP_ATTR = "_torchtrain_sequence_parallel"  # set on the decoder stack by torchtrain.parallel.ulysses
CP_ATTR = "_torchtrain_context_parallel"  # set on the decoder stack by torchtrain.parallel.context
_HOOK_ATTR = "_torchtrain_prepare_hook"


@dataclass(frozen=True)
class AttnMeta:
    """Mask metadata of one forward step, shared by all layers.

    doc_ids int64 [B, T]; exactly one of: dense bool [B,1,R,T] (eager, sdpa), block_mask
    (flex), segments (flash_varlen*, varlen; with varlen also `plan`, its buckets). `rows`: int64 [R]
    the query slots the masks are built for (None: all T, R = T); under context parallelism a rank's
    slots, its queries attending to the whole window's keys. `sp`: under sequence parallelism the
    `torchtrain.parallel.ulysses.Ulysses` that runs each layer's attention (T is then the whole
    window, the layers see T / degree slots); None otherwise. `cp`: under context parallelism the
    `torchtrain.parallel.context.ContextParallel` that gathers each layer's keys and values.
    """

    engine: Engine
    variant: Variant
    doc_ids: torch.Tensor
    dense: torch.Tensor | None = None
    block_mask: Any = None
    segments: VarlenSegments | None = None
    plan: VarlenPlan | None = None
    rows: torch.Tensor | None = None
    sp: Any = None
    cp: Any = None


@functools.cache
def flash_attn_kernel():
    """The real kernel, or None where the flash-attn package does not import."""
    try:
        from flash_attn import flash_attn_varlen_func as fn
    except ImportError:
        return None
    return fn


def available_engines() -> tuple[str, ...]:
    """Engines that can run a forward here."""
    return tuple(e for e in ENGINES if e != "flash_varlen" or flash_attn_kernel() is not None)


def check_engine(engine: object, dtype: torch.dtype | None = None) -> Engine:
    """Return `engine` if it can run here with this parameter dtype; else a one-line UnavailableError."""
    if engine not in ENGINES:
        raise UnavailableError(f"unknown attention engine {engine!r} (available here: {', '.join(available_engines())})")
    if engine == "flash_varlen":
        if flash_attn_kernel() is None:
            raise UnavailableError(
                "engine 'flash_varlen' needs the flash-attn package (CUDA), which does not import here; "
                "use the engine flash_varlen_emulated (its pure-torch emulation) or sdpa"
            )
        if dtype == torch.float32:
            raise UnavailableError(
                "engine 'flash_varlen' runs in bfloat16/float16 only (FlashAttention has no float32 kernel); "
                "use dtype='bfloat16', or engine 'sdpa' / 'flash_varlen_emulated' in float32"
            )
    return engine  # type: ignore[return-value]


def resolve_engine(name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> str:
    """The engine `name` runs as on `device` with this parameter dtype: `auto` is flash_varlen where
    flash-attn imports, the device is CUDA and the dtype is not float32 (FlashAttention has no fp32
    kernel), else varlen; both cost memory linear in T (under context parallelism too: a rank's share of the
    queries against the whole window's keys). Any other name is returned unchanged (check_engine judges it).
    The one place `auto` is decided: the trainer records its result."""
    if name != AUTO:
        return name
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    return "flash_varlen" if cuda and dtype != torch.float32 and flash_attn_kernel() is not None else "varlen"


def dense_attention_bytes(engine: str, *, seq_len: int, batch: int, layers: int, heads: int,
                          dtype: torch.dtype = torch.float32) -> int:
    """Bytes the T x T tensors of one training step (forward + backward) take on the dense engines;
    0 for the others (their memory is linear in T).

    Per window and per T² slot pairs, measured as peak RSS = a T² + b T fitted over T = 2K-12K on
    CPU (random:llama, 1, 2 and 4 layers, fp32; a = 4.3 / 8.9 / 16.4 for sdpa, 72 / 95 / 147 for
    eager; under activation checkpointing as with one layer):
      sdpa   1 + e·L: the bool mask [B,1,T,T] (`prepare_meta`), and per layer the additive mask of the
             activation dtype (e bytes) that F.scaled_dot_product_attention makes of it and keeps for
             the backward
      eager  1 + 4·N·(L + 2): per layer the fp32 probabilities [B,N,T,T] kept for the backward, and at
             the peak two more (the layer's scores and their gradient)
    On the trainer (results/memory/memory_cpu.json) this plus the default engine's peak is within
    5% of the measured peak of sdpa and eager at T = 4K-32K. On CUDA the same model is assumed (not
    measured there).
    Args:
      layers: L, the layers whose attention is kept for the backward (1 under activation checkpointing).
      heads: N, the query heads one process attends over (num_heads / sequence-parallel degree).
    """
    per_pair = {"sdpa": 1 + torch.empty((), dtype=dtype).element_size() * layers,
                "eager": 1 + 4 * heads * (layers + 2)}.get(engine, 0)
    return per_pair * batch * seq_len * seq_len


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes a process can still allocate on `device`: MemAvailable of /proc/meminfo on the CPU, the
    device's free memory on CUDA; None where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]) if torch.cuda.is_available() else None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def attn_implementation(engine: Engine) -> str:
    """The name the engine is registered under in transformers' AttentionInterface."""
    return _ATTN_NAMES[engine]


def engine_of(model_or_config: Any) -> Engine | None:
    """The torchtrain engine a model (or its config) runs, or None for a stock transformers one."""
    config = getattr(model_or_config, "config", model_or_config)
    name = getattr(config, "_attn_implementation", None)
    return next((e for e, n in _ATTN_NAMES.items() if n == name), None)  # type: ignore[return-value]


def prepare_meta(engine: Engine, doc_ids: torch.Tensor, variant: Variant, rows: Any = None) -> AttnMeta:
    """Build the engine's mask metadata for a batch (once per forward step).

    Args:
      doc_ids: int [B, T].
      rows: int [R] ascending query slots (context parallelism: a rank's slots; their queries attend to
        all T keys), or None for every slot.
    """
    variant = check_variant(variant)
    check_doc_ids(doc_ids, variant)
    B, T = doc_ids.shape
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=torch.long, device=doc_ids.device)
    if engine in ("eager", "sdpa"):
        return AttnMeta(engine, variant, doc_ids, dense=dense_mask(doc_ids, variant, rows)[:, None], rows=rows)
    if engine == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        allowed = mask_predicate(doc_ids, variant)
        if rows is not None:
            slot_of = rows

            def allowed_rows(b, h, q_idx, kv_idx, _allowed=allowed):
                return _allowed(b, h, slot_of[q_idx], kv_idx)

            allowed = allowed_rows
        R = T if rows is None else int(rows.shape[0])
        block_mask = create_block_mask(allowed, B, None, R, T, device=doc_ids.device, _compile=doc_ids.is_cuda)
        return AttnMeta(engine, variant, doc_ids, block_mask=block_mask, rows=rows)
    segments = varlen_segments(doc_ids, variant, rows)
    buckets = None
    if engine == "varlen":
        q_slots = None if rows is None else (np.arange(B)[:, None] * T + rows.cpu().numpy()[None, :]).reshape(-1)
        buckets = plan(segments, q_slots=q_slots, keys=B * T)
    return AttnMeta(engine, variant, doc_ids, segments=segments, plan=buckets, rows=rows)


def compute_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The one dtype a layer's attention computes in: under autocast on q's device the autocast dtype, else
    the widest of the three.

    Under autocast (Trainer's and TRL's bf16=True) q, k and v arrive in different dtypes: the projections
    are bf16, but transformers' rotary tables follow the fp32 residual stream, so the rotated q and k are
    fp32 while v stays bf16. torch's own SDPA casts all three to the autocast dtype there (its autocast
    policy lists it among the lower-precision ops); every engine does the same, so a layer computes
    exactly what it computes on q, k, v rounded to bf16 by the caller. The fused kernels behind the
    engines take one dtype and are not on autocast's lists themselves."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def in_compute_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v cast to `compute_dtype` (each left as it is where it has that dtype already)."""
    dt = compute_dtype(q, k, v)
    return q.to(dt), k.to(dt), v.to(dt)  # type: ignore[return-value]


def attend(engine: Engine, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    """One layer's attention. q [B,N,T,D], k/v [B,K,T,D] (RoPE applied) -> out [B,T,N,D], computed in
    `compute_dtype(q, k, v)` (under autocast its dtype, as torch's SDPA) with autocast off inside: each
    engine's arithmetic is stated per dtype (the emulations upcast where the kernel does), and autocast
    would send their float32 matmuls back to bf16."""
    q, k, v = in_compute_dtype(q, k, v)
    with torch.autocast(q.device.type, enabled=False):
        return _attend(engine, q, k, v, meta, scale)


def _attend(engine: Engine, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    if engine == "eager":
        return attn.eager_attention(q, k, v, meta.dense, scale)
    if engine == "sdpa":
        return attn.sdpa_attention(q, k, v, meta.dense, scale)
    if engine == "flex":
        return attn.flex_attention(q, k, v, meta.block_mask, scale)
    if engine == "varlen":
        return varlen_sdpa_attention(q, k, v, meta.plan, scale)
    if engine == "flash_varlen":
        if q.device.type != "cuda":
            raise UnavailableError(
                f"engine 'flash_varlen' runs on CUDA only (tensors are on {q.device.type}); "
                "use the engine flash_varlen_emulated or sdpa"
            )
        return attn.varlen_attention(q, k, v, meta.segments, scale, flash_attn_kernel())

    return attn.varlen_attention(q, k, v, meta.segments, scale, emulated)


def _attention_function(engine: Engine):
    """The function transformers calls in each layer: `fn(module, q, k, v, mask, dropout, scaling, **kw)`."""

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        attn_meta: AttnMeta | None = None,
        sliding_window: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if attn_meta is None:
            raise InputError(
                f"engine {engine!r} got no mask metadata: build the model with torchtrain.build_model "
                "(or torchtrain.attention.engines.install) so its forward turns doc_ids/variant into masks"
            )
        if sliding_window is not None or dropout:
            raise UnavailableError(f"engine {engine!r} implements neither sliding windows nor attention dropout")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        tap = getattr(module, TAP_ATTR, None)
        query, key, value = in_compute_dtype(query, key, value)  # under autocast: its dtype (compute_dtype)
        split = attn_meta.sp if attn_meta.sp is not None else attn_meta.cp  # Ulysses runs context parallel inside
        if split is not None:
            if tap is not None and (attn_meta.sp is not None or tap.rows):
                raise InputError("taps are not captured under sequence parallelism, nor scores and probs under "
                                 "context parallelism: capture them in one process")
            if tap is not None:  # a context-parallel rank's q and k: its own slots, as the other taps are
                tap.attention(module.layer_idx, query, key, scale, attn_meta)
            return split.attend(engine, query, key, value, attn_meta, scale), None
        out = attend(engine, query, key, value, attn_meta, scale)
        if tap is not None:
            tap.attention(module.layer_idx, query, key, scale, attn_meta)
        return out, None

    attention.__name__ = f"{_ATTN_NAMES[engine]}_attention"
    return attention


def _register() -> None:
    from transformers import AttentionInterface

    for engine in ENGINES:
        AttentionInterface.register(attn_implementation(engine), _attention_function(engine))  # type: ignore[arg-type]


_register()


def _prepare_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the decoder stack: doc_ids/variant -> `attn_meta` for every layer."""
    engine = engine_of(module)
    if engine is None:
        return None
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None:
        raise InputError("torchtrain engines attend within one packed window: pass use_cache=False and no past_key_values")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise InputError("torchtrain engines take padding from doc_ids (-1), not from attention_mask")
    if len(args) > 1:
        raise InputError("pass the model's inputs by keyword (input_ids=, position_ids=, doc_ids=, variant=)")
    if args:  # input_ids given positionally
        kwargs["input_ids"], args = args[0], ()
    device = module.get_input_embeddings().weight.device
    for key in ("input_ids", "position_ids"):  # numpy at the boundary (docs/DESIGN.md §7)
        if isinstance(kwargs.get(key), np.ndarray):
            kwargs[key] = torch.as_tensor(kwargs[key], dtype=torch.long, device=device)
    x = kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
    B, T = x.shape[:2]
    # sequence / context parallel: the input is this rank's slots, doc_ids the whole window
    sp, cp = getattr(module, SP_ATTR, None), getattr(module, CP_ATTR, None)
    T_all = T * (1 if sp is None else sp.degree) * (1 if cp is None else cp.degree)
    doc_ids, variant = kwargs.get("doc_ids"), kwargs.get("variant")
    if doc_ids is None:
        if variant not in (None, "full"):
            raise InputError(f"variant {variant!r} needs doc_ids [B, T]")
        doc_ids, variant = torch.ones(B, T_all, dtype=torch.long, device=x.device), "full"
    elif variant is None:
        raise InputError("doc_ids given without variant= (one of full, intra_doc, intra_doc_reset, anchor)")
    doc_ids = torch.as_tensor(doc_ids, device=x.device)
    if tuple(doc_ids.shape) != (B, T_all):
        if T_all == T and doc_ids.ndim == 2 and doc_ids.shape[0] == B and doc_ids.shape[1] > T and doc_ids.shape[1] % T == 0:
            raise InputError(  # e.g. accelerate's context parallelism (cp_size): each rank would attend in its share only
                f"the input ids hold {T} of the window's {doc_ids.shape[1]} slots: a window split by something other "
                "than torchtrain drops the document and anchor masks across the split; split it with Ulysses "
                "(torchtrain.hf.ulysses, sp_size) or anchor train's parallel.context_parallel")
        whole = "" if T_all == T else f" (split over {T_all // T} ranks: doc_ids are the whole window, {(B, T_all)})"
        raise InputError(f"doc_ids has shape {tuple(doc_ids.shape)}, the input ids {(B, T)}{whole}")
    kwargs["doc_ids"] = doc_ids.long()
    meta = (prepare_meta(engine, kwargs["doc_ids"], variant) if cp is None
            else prepare_meta(engine, kwargs["doc_ids"], variant, rows=cp.slots(T_all)))
    kwargs["attn_meta"] = dataclasses.replace(meta, sp=sp, cp=cp)
    return args, kwargs


def install(model: nn.Module, engine: Engine) -> nn.Module:
    """Switch a transformers causal LM to a torchtrain engine and make its forward accept
    `doc_ids=` and `variant=` (idempotent). Returns the model."""
    engine = check_engine(engine, next(model.parameters()).dtype)
    model.config._attn_implementation = attn_implementation(engine)
    decoder = model.base_model
    if getattr(decoder, _HOOK_ATTR, None) is None:
        setattr(decoder, _HOOK_ATTR, decoder.register_forward_pre_hook(_prepare_hook, with_kwargs=True))
    return model
