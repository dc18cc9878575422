"""AnchorAttention in Hugging Face's Trainer (and TRL's SFTTrainer): a packing collator and attention functions.

    import torchtrain.hf as anchor_hf
    anchor_hf.register()                                  # idempotent; importing this module registers too
    model = AutoModelForCausalLM.from_config(config, attn_implementation="anchor_sdpa")
    collator = anchor_hf.PackingCollator("anchor", seq_len=4096, tokenizer=tok)
    args = TrainingArguments(..., remove_unused_columns=False)  # needed for pack windows only (below)
    Trainer(model, args, data_collator=collator, train_dataset=tokenized).train()

`PackingCollator` turns a list of features into packed windows (docs/DESIGN.md §1-§2) with the very
code `anchor train` uses: `anchor_core.data.packing.Packer` cuts the documents into windows of `seq_len` slots
(the first token at slot 0: the anchor of the `anchor` variant), `anchor_core.data.batch.make_batch` derives
the variant's `doc_ids`, `position_ids` and loss mask. Features are either

  documents  {"input_ids": [...]} as a tokenized dataset yields them (other keys are ignored); each is
             packed as `tokens + [EOS]`, back to back in the order given, the last window padded; or
  windows    with `windows=True`: {"input_ids": [T], "seg": [T], "tag": [T]} as an `anchor pack` folder holds
             them (`PackedWindows(folder)`): packed already, only the variant is derived.

It returns a dict of int64 tensors (B: the windows the features fill, so it varies with the documents'
lengths):

  input_ids     [B, T] the slots' tokens (padding: token 0)
  position_ids  [B, T] the variant's RoPE positions (§2)
  doc_ids       [B, T] 0 the anchor (anchor variant), documents 1, 2, ..., -1 padding (§1)
  labels        [B, T] the token where the prediction of the slot before is trained on (the loss mask of §1),
                -100 elsewhere; transformers' causal-LM loss shifts them by one, so it counts exactly the
                predictions `anchor train` counts
  variant       [B] the variant's index in `anchor_core.variants.VARIANTS` per window; with doc_ids it reaches
                every attention layer. A tensor, not the name: accelerate broadcasts and splits a batch
                across processes (an IterableDataset under several processes) only when every value is a
                tensor. The attention functions also take the name (`variant="anchor"`).

No `attention_mask`: padding is doc_ids -1. Transformers' Trainer drops dataset columns the model's
forward does not name (`remove_unused_columns=True`, its default) before the collator sees them: documents
need only `input_ids`, which it keeps; windows carry `seg` and `tag`, so train on them with
`remove_unused_columns=False` (without it the collator stops, naming the missing `seg`). What the collator returns reaches the model untouched.

Attention functions, registered in transformers' `AttentionInterface` under

  anchor_sdpa        torchtrain's sdpa engine: F.scaled_dot_product_attention with the variant's dense
                     bool mask [B, 1, T, T] (trains on CPU and CUDA; memory quadratic in T)
  anchor_eager       transformers' eager arithmetic with the same mask (the reference)
  anchor_varlen      torchtrain's varlen engine: fused SDPA calls per document, bucketed by length
                     (memory linear in T; CPU and CUDA)
  anchor_flex        FlexAttention with a BlockMask (trains on CUDA; CPU forward only)
  anchor_fa2         FlashAttention-2's varlen kernel on the documents (CUDA with flash-attn, bf16/fp16)
  anchor_fa2_emulated  the same segments through torchtrain's pure-torch emulation of that kernel

Each reads the keywords `doc_ids` [B, T] and `variant` that a stock Llama/Mistral/Qwen2/Qwen3 forward hands
from its `**kwargs` to every attention layer, builds the engine's mask metadata once per forward (cached on
the doc_ids tensor, so every layer and a checkpointed layer's recomputation reuse it), and attends with
`torchtrain.attention.engines.attend`: the same arithmetic as `anchor train` with that engine. q and k arrive rotated
by the model at the `position_ids` given (transformers' convention); `attention_mask` is not read.
The functions are also what `anchor parity --stack hf --attention torchtrain.hf:anchor_sdpa --rope-in model`
(parity_tests.hf_stack) calls, with the same keywords.

Sequence parallelism: DeepSpeed's Ulysses as transformers' Trainer runs it, through `ulysses(sp_size, seq_len)`
(accelerate's ParallelismConfig), `PackingCollator(..., sp_size=)` and the `UlyssesGradients` callback; each
function then gathers the whole window's doc_ids over the sequence-parallel group and checks them
(torchtrain.hf.trainer_sp).

Not supported here: domain tags and interleaved chunks from documents (pack them with `anchor pack --tags
--interleave` and train on `PackedWindows`), a KV cache (generation), sliding windows, attention dropout.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from anchor_core.data.batch import Batch, make_batch
from anchor_core.data.packed import PackedData
from anchor_core.data.packing import Packer
from anchor_core.data.store import TokenStore
from anchor_core.errors import InputError
from anchor_core.spec import HF_MODEL_TYPES
from anchor_core.variants import VARIANTS, Variant, check_variant
from torchtrain.attention.engines import AttnMeta, Engine, attend, check_engine, compute_dtype, prepare_meta
from torchtrain.hf.trainer_sp import UlyssesGradients, parallelism_config, share_gradients, whole_window

IGNORE_INDEX = -100  # transformers' causal-LM loss skips these labels

# Registered name -> torchtrain engine. No name contains "flash": transformers treats such a name as a
# FlashAttention request and tries to import its kernels.
ATTENTION_NAMES: dict[str, Engine] = {
    "anchor_sdpa": "sdpa",
    "anchor_eager": "eager",
    "anchor_varlen": "varlen",
    "anchor_flex": "flex",
    "anchor_fa2": "flash_varlen",
    "anchor_fa2_emulated": "flash_varlen_emulated",
}


# ---------------------------------------------------------------------------------------------
# The collator


def _token_ids(value: Any, what: str) -> np.ndarray:
    """A sequence of token ids (list, numpy or torch) as int64 [n]; anything else is an InputError."""
    try:
        arr = _array(value)
    except (TypeError, ValueError):
        arr = np.asarray([], dtype=object)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InputError(f"{what} must be a 1-D sequence of integer token ids, got {type(value).__name__}"
                         f"{'' if arr.dtype == object else f' {arr.dtype} of shape {arr.shape}'}")
    if arr.size and int(arr.min()) < 0:
        raise InputError(f"{what} holds a negative token id ({int(arr.min())})")
    return arr.astype(np.int64)


def _array(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _check_id(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 0:
        raise InputError(f"{name} must be a token id (an int >= 0), got {value!r}")
    return int(value)


def special_ids(tokenizer: Any) -> tuple[int, int]:
    """(first token, EOS) of a Hugging Face tokenizer: slot 0 holds BOS, or EOS where the tokenizer has
    no BOS (Qwen2, Qwen3), as `anchor pack` does (`anchor_core.tokenizer.Tok.first_token_id`)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    bos = getattr(tokenizer, "bos_token_id", None)
    if eos is None:
        raise InputError("tokenizer has no eos_token_id: pass first_token_id= and eos_token_id= instead")
    return (eos if bos is None else bos), eos


class PackingCollator:
    """Packs features into the windows `anchor train` trains on, for one variant (module docstring).

    Args:
      variant: full | intra_doc | intra_doc_reset | anchor.
      seq_len: T, slots per window (>= 2).
      first_token_id: the token at slot 0 of every window (the anchor of the anchor variant): BOS, or EOS
        where the tokenizer has none. eos_token_id: appended to every document. Both are optional with
        `windows=True` (the windows hold them already).
      tokenizer: instead of the two ids, a Hugging Face tokenizer to read them from (`special_ids`).
      mask_cross_doc_loss: in `full`, also leave out predictions of a token in another document (train key
        of the same name).
      windows: the features are pack windows (input_ids, seg, tag of seq_len slots each), not documents.
      sp_size: the sequence-parallel degree of DeepSpeed's Ulysses in Trainer (`ulysses`): seq_len must be a
        multiple of it, and `variant` is returned as [B, T] so that Ulysses' loader cuts it with the rest.
    """

    def __init__(self, variant: Variant, seq_len: int, *, first_token_id: int | None = None,
                 eos_token_id: int | None = None, tokenizer: Any = None, mask_cross_doc_loss: bool = False,
                 windows: bool = False, sp_size: int = 1):
        self.variant = check_variant(variant)
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
            raise InputError(f"seq_len must be an int >= 2, got {seq_len!r}")
        self.seq_len = int(seq_len)
        if isinstance(sp_size, bool) or not isinstance(sp_size, (int, np.integer)) or sp_size < 1 or seq_len % sp_size:
            raise InputError(f"sp_size must be an int >= 1 that divides seq_len {seq_len}, got {sp_size!r}")
        self.sp_size = int(sp_size)
        if not isinstance(windows, bool):
            raise InputError(f"windows must be a bool, got {windows!r}")
        self.packed = windows
        if tokenizer is not None:
            if first_token_id is not None or eos_token_id is not None:
                raise InputError("pass either tokenizer= or first_token_id= and eos_token_id=, not both")
            first_token_id, eos_token_id = special_ids(tokenizer)
        elif (first_token_id is None or eos_token_id is None) and not windows:
            raise InputError("first_token_id= and eos_token_id= are required to pack documents (or pass tokenizer=)")
        # pack windows hold their first token and EOS already: the ids are optional there
        self.first_token_id = None if first_token_id is None else _check_id(first_token_id, "first_token_id")
        self.eos_token_id = None if eos_token_id is None else _check_id(eos_token_id, "eos_token_id")
        if not isinstance(mask_cross_doc_loss, bool):
            raise InputError(f"mask_cross_doc_loss must be a bool, got {mask_cross_doc_loss!r}")
        self.mask_cross_doc_loss = mask_cross_doc_loss

    def __repr__(self) -> str:
        return (f"PackingCollator(variant={self.variant!r}, seq_len={self.seq_len}, first_token_id="
                f"{self.first_token_id}, eos_token_id={self.eos_token_id}, mask_cross_doc_loss={self.mask_cross_doc_loss}, "
                f"windows={self.packed}, sp_size={self.sp_size})")

    def windows(self, features: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The packed windows of the features: tokens, seg, tag, each [B, T] (docs/DESIGN.md §1)."""
        if isinstance(features, Mapping) or not isinstance(features, Sequence) or not features:
            raise InputError(f"features must be a non-empty list of dicts with input_ids, got {type(features).__name__}")
        for i, f in enumerate(features):
            if not isinstance(f, Mapping) or "input_ids" not in f:
                raise InputError(f"features[{i}] must be a dict with input_ids, got {type(f).__name__}"
                                 f"{' with keys ' + ', '.join(map(str, f)) if isinstance(f, Mapping) else ''}")
        if self.packed:
            return self._stack_windows(features)
        if any("seg" in f for f in features):
            raise InputError("features hold seg: pack windows are read with PackingCollator(..., windows=True)")
        docs = [_token_ids(f["input_ids"], f"features[{i}]['input_ids']") for i, f in enumerate(features)]
        store = TokenStore.from_docs(docs, [0] * len(docs), ["documents"])
        packer = Packer(store, np.arange(len(docs)), self.seq_len, first_token=int(self.first_token_id),  # type: ignore[arg-type]
                        eos=int(self.eos_token_id))  # type: ignore[arg-type]
        block = packer.block(0, packer.num_windows)
        return block.tokens.astype(np.int64), block.seg, block.tag

    def _stack_windows(self, features: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        T = self.seq_len
        rows = []
        for i, f in enumerate(features):
            if "seg" not in f:
                raise InputError(f"features[{i}] has no seg: a pack window holds input_ids, seg and tag (transformers' "
                                 "Trainer drops seg and tag unless remove_unused_columns=False)")
            tok = _token_ids(f["input_ids"], f"features[{i}]['input_ids']")
            seg = _array(f["seg"])
            tag = _array(f["tag"]) if "tag" in f else np.zeros(T, dtype=np.uint8)  # no tag: no domain tags
            if tok.shape != (T,) or seg.shape != (T,) or tag.shape != (T,):
                raise InputError(f"features[{i}]: a pack window holds input_ids, seg and tag of seq_len {T} slots each, "
                                 f"got {tok.shape}, {seg.shape}, {tag.shape}")
            if seg.dtype.kind not in "iu" or seg[0] != 0 or int(seg.min()) < -1:
                raise InputError(f"features[{i}]['seg'] must be 0 at slot 0, then documents 1, 2, ... and -1 padding")
            if tag.dtype.kind not in "iub" or int(tag.min(initial=0)) < 0 or int(tag.max(initial=0)) > 1:
                raise InputError(f"features[{i}]['tag'] must be 0 or 1 per slot (1 on domain-tag slots)")
            rows.append((tok, seg.astype(np.int32), tag.astype(np.uint8)))
        return tuple(np.stack(a) for a in zip(*rows))  # type: ignore[return-value]

    def batch(self, features: Sequence[Mapping[str, Any]]) -> Batch:
        """The windows as `anchor train` sees them: make_batch's int32 numpy arrays (docs/DESIGN.md §1)."""
        tokens, seg, tag = self.windows(features)
        return make_batch(tokens, seg, tag, self.variant, mask_cross_doc_loss=self.mask_cross_doc_loss)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        inputs = to_model_inputs(self.batch(features), self.variant)
        if self.sp_size > 1:  # Ulysses' loader cuts every tensor along dim 1 (torchtrain.hf.trainer_sp)
            inputs["variant"] = inputs["variant"][:, None].expand_as(inputs["input_ids"]).contiguous()
        return inputs


def labels_of(tokens: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """Labels for transformers' causal-LM loss (which predicts labels[t + 1] at slot t): tokens[t + 1] where
    loss_mask[t] is 1, else -100; slot 0 is never a target. int64 [B, T]."""
    labels = np.full(tokens.shape, IGNORE_INDEX, dtype=np.int64)
    labels[:, 1:] = np.where(np.asarray(loss_mask)[:, :-1] != 0, tokens[:, 1:], IGNORE_INDEX)
    return labels


def to_model_inputs(batch: Batch, variant: Variant) -> dict[str, Any]:
    """A make_batch Batch as the keyword arguments of a transformers causal LM (module docstring)."""
    tokens = np.asarray(batch.tokens, dtype=np.int64)
    return {"input_ids": torch.from_numpy(tokens),
            "position_ids": torch.from_numpy(np.asarray(batch.positions, dtype=np.int64)),
            "doc_ids": torch.from_numpy(np.asarray(batch.doc_ids, dtype=np.int64)),
            "labels": torch.from_numpy(labels_of(tokens, batch.loss_mask)),
            "variant": torch.full((tokens.shape[0],), VARIANTS.index(check_variant(variant)), dtype=torch.int64)}


def variant_name(variant: Any) -> Variant:
    """The variant a forward keyword names: a name of VARIANTS, or a [B] (or, under sequence parallelism,
    [B, t]) integer tensor of one index into it (PackingCollator's `variant`); anything else is an InputError."""
    if isinstance(variant, str) and variant in VARIANTS:
        return variant  # type: ignore[return-value]
    if (isinstance(variant, torch.Tensor) and variant.ndim in (1, 2) and variant.numel()
            and not variant.is_floating_point()):
        values = set(variant.reshape(-1).tolist())
        if len(values) == 1 and 0 <= (v := values.pop()) < len(VARIANTS):
            return VARIANTS[v]
    raise InputError(f"variant must be one of {', '.join(VARIANTS)} or a [B] tensor of one index into them, "
                     f"got {variant!r} (the model's forward takes variant= with doc_ids=; PackingCollator returns both)")


class PackedWindows(torch.utils.data.Dataset):
    """The windows of an `anchor pack` folder as a map-style dataset of window features
    ({"input_ids", "seg", "tag"}, numpy [T] each) for `PackingCollator(..., windows=True)` (train with
    remove_unused_columns=False)."""

    def __init__(self, folder: str | Path):
        self.data = PackedData.open(folder)
        self.seq_len = self.data.seq_len

    def __len__(self) -> int:
        return int(self.data.num_windows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not -len(self) <= index < len(self):
            raise IndexError(f"window index {index!r} out of range for {len(self)} windows")
        tokens, seg, tag = self.data.windows(np.array([int(index) % len(self)]))
        return {"input_ids": tokens[0].astype(np.int64), "seg": seg[0], "tag": tag[0]}


# ---------------------------------------------------------------------------------------------
# The attention functions


@dataclass
class _MetaCache:
    """The mask metadata of the forward running now, keyed on the doc_ids object every layer receives (held
    weakly: the entry goes when the batch does, so no T x T mask outlives its step)."""

    ref: Any = None  # weakref.ref to the caller's doc_ids
    version: int = -1
    engine: str | None = None
    variant: Any = None
    device: torch.device | None = None
    meta: AttnMeta | None = None


_CACHE = _MetaCache()


def _forget(meta_id: int) -> None:
    if id(_CACHE.meta) == meta_id:
        _CACHE.__init__()


def _meta(engine: Engine, doc_ids: Any, variant: Any, device: torch.device, T: int, kwargs: dict[str, Any]) -> AttnMeta:
    c = _CACHE
    version = getattr(doc_ids, "_version", -1)
    if (c.meta is not None and c.ref is not None and c.ref() is doc_ids and c.version == version and c.engine == engine
            and (c.variant is variant or (isinstance(variant, str) and c.variant == variant)) and c.device == device):
        return c.meta
    name = variant_name(variant)
    ids = torch.as_tensor(np.asarray(doc_ids) if isinstance(doc_ids, (list, tuple)) else doc_ids, device=device)
    if ids.ndim == 2 and ids.shape[1] != T:  # this rank's slice under Ulysses: the whole window, checked
        ids = whole_window(ids, name, T, kwargs).to(device)
    if ids.ndim != 2 or ids.shape[1] != T:
        raise InputError(f"doc_ids must be [B, T] with T = {T} slots (the model's input), got {tuple(ids.shape)}")
    if isinstance(variant, torch.Tensor) and variant.shape[0] != ids.shape[0]:
        raise InputError(f"variant has {variant.shape[0]} rows, doc_ids {ids.shape[0]}")
    meta = prepare_meta(engine, ids.long().clone(), name)  # a copy: the metadata holds no reference to the caller's
    try:
        ref = weakref.ref(doc_ids)
        weakref.finalize(doc_ids, _forget, id(meta))
    except TypeError:  # a list: not cached
        return meta
    _CACHE.__init__(ref, version, engine, variant, device, meta)
    return meta


def _attention_function(name: str, engine: Engine) -> Callable[..., tuple[torch.Tensor, None]]:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, dropout: float = 0.0, scaling: float | None = None,
                  sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if model_type is not None and model_type not in HF_MODEL_TYPES:
            raise InputError(f"attention {name!r} supports the model types {', '.join(HF_MODEL_TYPES)} (RoPE decoders, "
                             f"whose positions the variants set), not {model_type!r}")
        doc_ids = kwargs.get("doc_ids")
        if doc_ids is None:
            raise InputError(f"attention {name!r} needs doc_ids= [B, T] and variant= in the model's forward "
                             "(torchtrain.hf.PackingCollator returns both)")
        if sliding_window is not None or dropout:
            raise InputError(f"attention {name!r} implements neither sliding windows nor attention dropout "
                             f"(sliding_window={sliding_window!r}, dropout={dropout!r})")
        if query.shape[0] != len(doc_ids):
            raise InputError(f"doc_ids has {len(doc_ids)} rows, the batch {query.shape[0]} "
                             "(a KV cache or generation is not supported)")
        check_engine(engine, compute_dtype(query, key, value))  # under autocast its dtype: `attend` casts to it
        meta = _meta(engine, doc_ids, kwargs.get("variant"), query.device, query.shape[2], kwargs)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return attend(engine, query, key, value, meta, scale), None

    attention.__name__ = attention.__qualname__ = name
    attention.__doc__ = (f"transformers attention function {name!r}: torchtrain's {engine!r} engine on the "
                         "variant's mask from the doc_ids/variant keywords (torchtrain.hf docstring).")
    return attention


anchor_sdpa = _attention_function("anchor_sdpa", "sdpa")
anchor_eager = _attention_function("anchor_eager", "eager")
anchor_varlen = _attention_function("anchor_varlen", "varlen")
anchor_flex = _attention_function("anchor_flex", "flex")
anchor_fa2 = _attention_function("anchor_fa2", "flash_varlen")
anchor_fa2_emulated = _attention_function("anchor_fa2_emulated", "flash_varlen_emulated")
FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, None]]] = {
    f.__name__: f for f in (anchor_sdpa, anchor_eager, anchor_varlen, anchor_flex, anchor_fa2, anchor_fa2_emulated)
}


def register() -> tuple[str, ...]:
    """Register the attention functions in transformers' AttentionInterface (idempotent: registering again
    puts the same functions under the same names). Returns the names."""
    from transformers import AttentionInterface

    for name, fn in FUNCTIONS.items():
        AttentionInterface.register(name, fn)
    return tuple(FUNCTIONS)


def ulysses(sp_size: int, seq_len: int | None = None, attn_implementation: str = "anchor_varlen") -> Any:
    """accelerate's ParallelismConfig for DeepSpeed's Ulysses around one of these attention functions: pass it
    as TrainingArguments(parallelism_config=...) beside a DeepSpeed config, and `sp_size` to PackingCollator
    (torchtrain.hf.trainer_sp). seq_len: the windows' T when every batch has it, else None (variable). On a CPU
    the TrainingArguments also need use_cpu=True (the UlyssesGradients callback refuses a run without it)."""
    if attn_implementation not in FUNCTIONS:
        raise InputError(f"attn_implementation must be one of {', '.join(FUNCTIONS)}, got {attn_implementation!r}")
    return parallelism_config(sp_size, seq_len, attn_implementation)


register()

__all__ = ["ATTENTION_NAMES", "FUNCTIONS", "IGNORE_INDEX", "PackedWindows", "PackingCollator", "anchor_eager",
           "anchor_fa2", "anchor_fa2_emulated", "anchor_flex", "anchor_sdpa", "anchor_varlen", "labels_of",
           "UlyssesGradients", "register", "share_gradients", "special_ids", "to_model_inputs", "ulysses", "variant_name"]
