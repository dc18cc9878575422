"""How a batch reaches the model, per input style (the package docstring says what each style feeds):
`feed` (the model's keyword inputs for a stack and a variant), built from `collate`
(DataCollatorWithFlattening's batch of the windows' `sequences`), `packed_positions` (its restarting
position_ids) and `mask4d` (the variant's mask as a 4-D attention_mask); `feed_description` says a row's
inputs in words.

Legend: B windows, T slots.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from anchor_core.errors import InputError
from parity_tests.cases import CaseInputs
from parity_tests.hf_stack.stacks import INPUT_STYLES, Stack
from parity_tests.hf_stack.subjects import torch_dtype
from torchtrain.attention.variants import dense_mask


def packed_positions(doc_ids: np.ndarray) -> np.ndarray:
    """DataCollatorWithFlattening's position_ids for windows whose sequences are the runs of equal
    doc_ids: 0, 1, … restarting wherever doc_ids changes. int [B, T] -> int64 [B, T]."""
    doc_ids = np.asarray(doc_ids)
    B, T = doc_ids.shape
    out = np.zeros((B, T), dtype=np.int64)
    for b in range(B):
        starts = np.flatnonzero(np.r_[True, doc_ids[b, 1:] != doc_ids[b, :-1]])
        run = np.repeat(starts, np.diff(np.r_[starts, T]))
        out[b] = np.arange(T) - run
    return out


def sequences(doc_ids: np.ndarray, variant: str) -> list[list[tuple[int, int]]]:
    """The sequences a flattening collator is given, per window, as (start, end) slots: `full` has no
    documents to keep apart, so its window is one sequence; the other variants' sequences are the runs of
    equal doc_ids (`anchor`'s anchor slot is a run of its own; padding is one run)."""
    doc_ids = np.asarray(doc_ids)
    B, T = doc_ids.shape
    if variant == "full":
        return [[(0, T)] for _ in range(B)]
    out = []
    for b in range(B):
        starts = np.flatnonzero(np.r_[True, doc_ids[b, 1:] != doc_ids[b, :-1]])
        out.append(list(zip(starts.tolist(), np.r_[starts[1:], T].tolist())))
    return out


def collate(inputs: CaseInputs, variant: str, flash_kwargs: bool) -> dict[str, Any]:
    """The batch transformers' DataCollatorWithFlattening makes of the windows' sequences (`sequences`):
    input_ids and position_ids restarting at 0 per sequence, and with `flash_kwargs` also cu_seq_lens_q/k
    and max_length_q/k. The collator lays every sequence of the batch end to end in one row [1, B*T]; as no
    sequence crosses a window, that row is cut back into the B windows [B, T] (each window's tokens and
    positions unchanged; cu_seq_lens_q/k index the B*T slots laid end to end, as FlashAttention's varlen
    path reads a [B, T] batch). The collator's labels are left out (the forward takes no loss)."""
    import torch
    from transformers import DataCollatorWithFlattening

    B, T = inputs.shape
    features = [{"input_ids": inputs.tokens[b, s:e].tolist()}
                for b, runs in enumerate(sequences(inputs.doc_ids, variant)) for s, e in runs]
    batch = DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=flash_kwargs)(
        features, return_tensors="pt")
    ids = torch.as_tensor(batch["input_ids"])
    if ids.shape != (1, B * T) or not torch.equal(ids.reshape(B, T), torch.from_numpy(inputs.tokens).long()):
        raise AssertionError(f"DataCollatorWithFlattening gave input_ids {tuple(ids.shape)}, not the windows' "
                             f"{B * T} tokens in order")
    out = {"input_ids": ids.reshape(B, T), "position_ids": torch.as_tensor(batch["position_ids"]).reshape(B, T)}
    if flash_kwargs:
        out.update({k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
    return out


def mask4d(doc_ids: np.ndarray, variant: str, kind: Literal["bool", "float"], dtype: str):
    """The variant's mask (§2) as a 4-D attention_mask [B, 1, T, T]: bool (True where a query slot may see
    a key slot), or float in `dtype` (0 where it may, the dtype's most negative number where it may not)."""
    import torch


    allowed = dense_mask(torch.from_numpy(np.asarray(doc_ids)), variant)[:, None]
    if kind == "bool":
        return allowed
    want = torch_dtype(dtype)
    return torch.zeros(allowed.shape, dtype=want).masked_fill(~allowed, torch.finfo(want).min)


def feed(stack: Stack, inputs: CaseInputs, variant: str, dtype: str = "float32") -> dict[str, Any]:
    """The model's keyword inputs for the variant in the stack's input style (the package docstring);
    `dtype`: the model's, for a float mask."""
    import torch

    tokens = torch.from_numpy(inputs.tokens)
    if stack.user:
        return {"input_ids": tokens, "position_ids": torch.from_numpy(inputs.positions),
                "doc_ids": torch.from_numpy(inputs.doc_ids), "variant": variant, "use_cache": False}
    style = stack.inputs
    if style in ("flattening", "flattening-nocache", "flash-kwargs"):
        out = collate(inputs, variant, flash_kwargs=style == "flash-kwargs")
    elif style == "continuous":
        out = {"input_ids": tokens, "position_ids": torch.arange(inputs.shape[1]).expand(inputs.shape).contiguous()}
    elif style in ("mask4d-bool", "mask4d-float"):
        out = {"input_ids": tokens, "position_ids": torch.from_numpy(inputs.positions),
               "attention_mask": mask4d(inputs.doc_ids, variant, style.removeprefix("mask4d-"), dtype)}
    else:
        raise InputError(f"--inputs: unknown input style {style!r} (known: {', '.join(INPUT_STYLES)})")
    if stack.positions == "variant":
        out["position_ids"] = torch.from_numpy(np.ascontiguousarray(inputs.positions))
    if stack.attention_mask:
        out["attention_mask"] = torch.ones_like(tokens)
    if style not in ("flattening", "flash-kwargs"):  # those two leave use_cache at the model's default
        out["use_cache"] = False
    return out


def feed_description(stack: Stack, variant: str) -> str:
    """The inputs of a row, in words."""
    if stack.user:
        where = "rotated by the model" if stack.rope_in == "model" else "unrotated (the function applies RoPE)"
        return f"position_ids of the variant (§2), doc_ids and variant as keywords; q/k {where}"
    style = stack.inputs
    cache = "use_cache left at the model's default" if style in ("flattening", "flash-kwargs") else "use_cache=False"
    mask = "an attention_mask of ones" if stack.attention_mask else "no attention_mask"
    if style.startswith("mask4d"):
        mask = f"the variant's mask as a 4-D {style.removeprefix('mask4d-')} attention_mask [B,1,T,T]"
    if stack.positions == "variant" or style.startswith("mask4d"):
        positions = "position_ids of the variant (§2)"
    elif style == "continuous":
        positions = "position_ids 0..T-1"
    elif variant == "full":
        positions = "one sequence: position_ids 0..T-1 (DataCollatorWithFlattening)"
    else:
        positions = "documents flattened: position_ids restart at 0 per document (DataCollatorWithFlattening)"
    flash = ", cu_seq_lens_q/k and max_length_q/k" if style == "flash-kwargs" else ""
    return f"{positions}{flash}, {mask}, {cache}"
