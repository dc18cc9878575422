"""Greedy generation with a KV cache through the torchtrain model and its engines (docs/DESIGN.md §9).

    model = load_eval_model("default")                         # bf16, engine sdpa, eval mode
    tok = load_tokenizer(eval_model_source("default"))
    outs = greedy_generate(model, tok, prompts, max_new_tokens=32)  # list[list[int]], input order

Legend: B rows of a batch, L the longest prompt of the batch, S cached slots, N query heads, K kv heads,
D head dim, V vocabulary.

Design. torchtrain's engines attend within one packed window: the decoder's forward pre-hook
(`torchtrain.attention.engines.install`) turns `doc_ids`/`variant` into an `AttnMeta`, refuses a cache, and every
engine assumes as many queries as keys. Generation therefore runs the same stock transformers model,
for the duration of one `greedy_generate` call, under a second attention function registered here
(`anchor_eval_cached`; the config's `_attn_implementation` is switched and restored, and the torchtrain
pre-hook, which sees no torchtrain engine then, stays out of the way), with transformers' `DynamicCache`:

- prefill: the prompts of a batch, left-padded to the longest, go through the model's own engine:
  `torchtrain.attention.engines.prepare_meta(engine, doc_ids, "full")` once per batch, with doc_ids 1 on prompt
  tokens and -1 on padding (docs/DESIGN.md §1-§2: a padding slot attends only to itself and is never
  attended to), then `torchtrain.attention.engines.attend` in every layer: the mask metadata and the arithmetic
  of training. transformers writes the keys and values into the cache before calling it.
- decode: each step feeds one token per row against the cache (queries fewer than keys, causal aligned
  to the bottom right, as FlashAttention aligns it), with a boolean mask [B, 1, q, S] that hides the
  padding. The arithmetic is the engine family's: Hugging Face eager for `eager`, SDPA for every other
  engine (flex and the varlen engines have no cache path; in fp32 they agree with SDPA to rounding).
- positions: RoPE positions start at 0 at each row's first prompt token (padding slots get 0 and are
  masked). A prompt is one document, so every variant of docs/DESIGN.md §2 gives the same mask and
  positions as `full`.
- batching: prompts are sorted by length (longest first, ties by input order) into batches of
  `batch_size`, to keep padding small; results come back in input order. A row that stops leaves the
  batch (its cache rows are dropped), so the others do not pay for it.
- stopping: a row stops after `max_new_tokens` tokens or at a stop id (default: the tokenizer's EOS);
  the stop token is not returned.

Costs: the prefill costs what the engine costs on a [B, L] window (the dense engines build a
[B, 1, L, L] boolean mask); each decode step appends to `DynamicCache` (a copy of the cache per layer)
and reads every weight once, so it is memory-bound.

Greedy is `argmax` over the last slot's logits (ties: the lowest id), so the output is deterministic
for the same prompts, budgets, batch size, dtype and engine. In float32 it equals an argmax over a full
forward without a cache at every step (tests/eval/test_generate.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anchor_core.errors import InputError
from anchor_core.progress import ProgressBar
from anchor_core.tokenizer import Tok
from anchor_core.weights import model_folder
from torchtrain.attention import functions as attn
from torchtrain.attention.engines import AttnMeta, Engine, attend, engine_of, prepare_meta
from torchtrain.model import DType, build_model

CACHED_ATTENTION = "anchor_eval_cached"  # the name registered in transformers' AttentionInterface
PAD_ID = 0  # token id of left padding: never attended to, so any valid id works


def eval_model_source(source: str | Path) -> str:
    """The model name to load for `source` (docs/DESIGN.md §6): a folder is `anchor_core.weights.model_folder`'s
    (a checkpoint `RUN/checkpoints/step-N` or its `hf/` verified against its manifest, and read from its
    `hf/`, docs/DESIGN.md §8); other names are returned as they are."""
    path = Path(source)
    return str(model_folder(path)) if path.is_dir() else str(source)


def load_eval_model(source: str | Path, engine: Engine = "sdpa", dtype: DType = "bfloat16", *,
                    rope: Any = None, seed: int = 0) -> nn.Module:
    """A torchtrain model in eval mode for generation and perplexity.

    Args:
      source: a model name `torchtrain.build_model` accepts (a local Hugging Face folder, a `.gguf`
        file, `default`/`smollm2`, `random:<preset>`) or a checkpoint folder (its `hf/` is loaded).
      engine: the torchtrain engine of the prefill and of perplexity.
      dtype: "bfloat16" (default) or "float32". Where the CPU has no native bf16
        matmul (AVX2 only, like the 2-core development machine), float32 is the faster one: there a
        bf16 GEMM runs at about 1/8 of float32's speed and greedy generation takes about 5x as long.
      rope, seed: as in `torchtrain.build_model`.
    Returns:
      the model; a folder without weights is a one-line InputError.
    """
    return build_model(eval_model_source(source), engine=engine, dtype=dtype, rope=rope, seed=seed).eval()


# ---------------------------------------------------------------------------------------------
# The attention function of cached generation


@dataclass(frozen=True)
class CachedStep:
    """What one forward step of generation tells every layer: exactly one of
    `prefill` (the engine's metadata while the empty cache fills: queries = keys = the prompt slots) or
    `mask` (decode: bool [B, 1, q, S], True = attend; the last q cached slots are the queries)."""

    engine: Engine
    prefill: AttnMeta | None = None
    mask: torch.Tensor | None = None


def cached_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cached_step: CachedStep | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function call: q [B,N,q,D], k/v [B,K,S,D] (the cache, RoPE applied) -> [B,q,N,D]."""
    if cached_step is None:
        raise InputError(f"attention implementation {CACHED_ATTENTION!r} runs only inside "
                         "anchor.eval.generate.greedy_generate")
    if sliding_window is not None or dropout:
        raise InputError("cached generation implements neither sliding windows nor attention dropout")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if cached_step.prefill is not None:
        if query.shape[2] != key.shape[2]:
            raise AssertionError(f"prefill into a non-empty cache: {query.shape[2]} queries, {key.shape[2]} keys")
        return attend(cached_step.engine, query, key, value, cached_step.prefill, scale), None
    mask = cached_step.mask
    if mask is None or mask.shape[-2:] != (query.shape[2], key.shape[2]):
        raise AssertionError(f"decode mask {None if mask is None else tuple(mask.shape)} does not fit "
                             f"{query.shape[2]} queries and {key.shape[2]} keys")
    if cached_step.engine == "eager":
        return attn.eager_attention(query, key, value, mask, scale), None
    return attn.sdpa_attention(query, key, value, mask, scale), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CACHED_ATTENTION, cached_attention)  # type: ignore[arg-type]


_register()


@contextlib.contextmanager
def cached_mode(model: nn.Module) -> Iterator[Engine]:
    """Run `model` under `cached_attention` inside the block; yields its torchtrain engine."""
    engine = engine_of(model)
    if engine is None:
        raise InputError("greedy generation needs a torchtrain model (anchor.eval.generate.load_eval_model "
                         "or torchtrain.build_model)")
    old = model.config._attn_implementation
    model.config._attn_implementation = CACHED_ATTENTION
    try:
        yield engine
    finally:
        model.config._attn_implementation = old


# ---------------------------------------------------------------------------------------------
# Greedy decoding


def _budgets(max_new_tokens: int | Sequence[int], n: int) -> list[int]:
    if isinstance(max_new_tokens, int):
        budgets = [max_new_tokens] * n
    else:
        budgets = [int(b) for b in max_new_tokens]
        if len(budgets) != n:
            raise InputError(f"max_new_tokens has {len(budgets)} entries for {n} prompts")
    if any(b < 0 for b in budgets):
        raise InputError(f"max_new_tokens must be >= 0, got {min(budgets)}")
    return budgets


def _check_prompts(prompts: Sequence[Sequence[int]], vocab: int) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise InputError(f"prompt {i} is empty")
        if min(p) < 0 or max(p) >= vocab:
            raise InputError(f"prompt {i} holds token id {min(p) if min(p) < 0 else max(p)}, outside the "
                             f"model's vocabulary of {vocab}")
        out.append(p)
    return out


def greedy_generate(
    model: nn.Module,
    tokenizer: Tok,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    batch_size: int = 4,
    stop_ids: Sequence[int] | None = None,
    progress: bool = True,
) -> list[list[int]]:
    """Greedy continuations of `prompts` with a KV cache (module docstring).

    Args:
      model: a torchtrain model (`load_eval_model`); its engine runs the prefill.
      tokenizer: the model's tokenizer; its EOS is the default stop id.
      prompts: token ids per prompt, as the model should see them (put the BOS first where the model
        expects one; nothing is added).
      max_new_tokens: the budget of every prompt, or one per prompt.
      batch_size: prompts per forward.
      stop_ids: ids that end a row (not returned); default (tokenizer.eos_id,).
      progress: a progress bar (anchor_core.progress) over the prompts.
    Returns:
      the generated ids per prompt, in input order, at most its budget long.
    """
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    prompts = _check_prompts(prompts, int(model.get_input_embeddings().weight.shape[0]))
    budgets = _budgets(max_new_tokens, len(prompts))
    stop = frozenset(int(s) for s in ((tokenizer.eos_id,) if stop_ids is None else stop_ids))
    order = sorted((i for i in range(len(prompts)) if budgets[i] > 0), key=lambda i: (-len(prompts[i]), i))
    results: list[list[int]] = [[] for _ in prompts]
    bar = ProgressBar("generate", len(order), progress, unit="prompts")
    try:
        with cached_mode(model) as engine, torch.inference_mode():
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                bar.describe(f"{len(rows)} x {len(prompts[rows[0]])} prompt tokens", log=False)
                outs = _generate_batch(model, engine, [prompts[i] for i in rows], [budgets[i] for i in rows], stop)
                for i, out in zip(rows, outs):
                    results[i] = out
                bar.advance(len(rows))
    finally:
        bar.close()
    return results


def _generate_batch(model: nn.Module, engine: Engine, prompts: list[list[int]], budgets: list[int],
                    stop: frozenset[int]) -> list[list[int]]:
    """Greedy continuations of one batch: the prefill through `engine`, then one token per step."""
    from transformers import DynamicCache

    device = model.get_input_embeddings().weight.device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids_BL = torch.full((B, L), PAD_ID, dtype=torch.long)
    doc_BL = torch.full((B, L), -1, dtype=torch.long)
    pos_BL = torch.zeros((B, L), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's last prompt token sits at slot L-1
        ids_BL[b, L - len(p):] = torch.tensor(p)
        doc_BL[b, L - len(p):] = 1
        pos_BL[b, L - len(p):] = torch.arange(len(p))
    ids_BL, doc_BL, pos_BL = ids_BL.to(device), doc_BL.to(device), pos_BL.to(device)
    cache = DynamicCache(config=model.config)
    step = CachedStep(engine, prefill=prepare_meta(engine, doc_BL, "full"))
    logits_BV = model(input_ids=ids_BL, position_ids=pos_BL, past_key_values=cache, use_cache=True,
                      logits_to_keep=1, cached_step=step).logits[:, -1]
    visible_BS = doc_BL >= 0  # cached slots a new query may see (padding never)
    next_pos_B = torch.tensor([len(p) for p in prompts], device=device)
    active = list(range(B))  # rows of `prompts` still generating, in cache-row order
    outs: list[list[int]] = [[] for _ in prompts]
    while True:
        tok_B = logits_BV.argmax(dim=-1)
        keep = []
        for j, (r, t) in enumerate(zip(active, tok_B.tolist())):
            if t in stop:
                continue
            outs[r].append(t)
            if len(outs[r]) < budgets[r]:
                keep.append(j)
        if not keep:
            return outs
        if len(keep) < len(active):  # finished rows leave the batch and the cache
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            tok_B, visible_BS, next_pos_B = tok_B[idx], visible_BS[idx], next_pos_B[idx]
            active = [active[j] for j in keep]
        visible_BS = torch.cat([visible_BS, visible_BS.new_ones((len(active), 1))], dim=1)
        step = CachedStep(engine, mask=visible_BS[:, None, None, :])
        logits_BV = model(input_ids=tok_B[:, None], position_ids=next_pos_B[:, None], past_key_values=cache,
                          use_cache=True, cached_step=step).logits[:, -1]
        next_pos_B = next_pos_B + 1
