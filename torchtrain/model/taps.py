"""Taps: what the oracle's taps return, captured from a transformers model by hooks.

Legend: B batch, T slots, H hidden, N query heads, K kv heads, D head dim, V vocabulary,
R requested query rows. Every tap is a detached float32 CPU copy, in a list with one entry per
layer (`embed` and `logits`: a list of one).

  embed     [B,T,H]    token embeddings (input of layer 0)
  q         [B,T,N,D]  queries after RoPE (captured inside the attention function)
  k         [B,T,K,D]  keys after RoPE
  attn_out  [B,T,H]    attention block output (o_proj output, before the residual add)
  mlp_out   [B,T,H]    MLP output (before the residual add)
  hidden    [B,T,H]    the layer's output residual stream
  scores    [B,N,R,T]  q·kᵀ·scale for rows R against all keys, unmasked (Hugging Face eager
                       arithmetic: in the activation dtype)
  probs     [B,N,R,T]  attention probabilities of rows R (fp32 softmax over allowed keys), 0 where masked
  logits    [B,T,V]    lm-head output

Usage:
    with capture_taps(model, rows=[0, 5]) as taps:
        model(input_ids=..., position_ids=..., doc_ids=..., variant="anchor")
    taps["q"][layer]  # torch float32 [B, T, N, D]

    # a stock model (transformers' own attention, or a function registered in its AttentionInterface):
    with capture_taps(stock, rows=[0, 5], doc_ids=doc_ids, variant="anchor") as taps:
        stock(input_ids=..., position_ids=...)

One recorder serves both: the parity runners of torchtrain's engines, of transformers' own
implementations and of users' functions (parity_tests.runners, parity_tests.hf_stack) and the black-box
check of a user's step (parity_tests.blackbox) all read their taps here.
`scores`/`probs` are captured only when `rows` is given. A second forward inside one capture
overwrites the first (so a gradient-checkpointing recomputation leaves the taps unchanged).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from anchor_core.errors import InputError
from torchtrain.attention.engines import TAP_ATTR, AttnMeta, engine_of
from torchtrain.attention.functions import expand_kv
from torchtrain.attention.variants import dense_mask

TAP_NAMES: tuple[str, ...] = ("embed", "q", "k", "attn_out", "mlp_out", "hidden", "scores", "probs", "logits")


def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(device="cpu", dtype=torch.float32, copy=True)


class TapRecorder:
    """Where the taps of one capture go: `put` by hooks, `attention` by the attention function.

    rows: query slots R for `scores` and `probs` (None or empty: neither is recorded).
    doc_ids, variant: the mask under which the rows' probabilities are read, for a model whose attention
      function carries no mask metadata (a stock implementation, a user's function); a torchtrain engine
      hands its own (`AttnMeta`) with every call.
    """

    def __init__(self, rows: Sequence[int] | None, doc_ids: torch.Tensor | None = None, variant: str | None = None):
        self.rows = None if rows is None else [int(r) for r in rows]
        self.doc_ids, self.variant = doc_ids, variant
        self.store: dict[str, dict[int, torch.Tensor]] = {name: {} for name in TAP_NAMES}

    def put(self, name: str, layer: int, x: torch.Tensor) -> None:
        self.store[name][layer] = _copy(x)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float, meta: AttnMeta | None = None) -> None:
        """q [B,N,T,D], k [B,K,T,D] as the attention function receives them (after RoPE)."""
        self.put("q", layer, q.transpose(1, 2))
        self.put("k", layer, k.transpose(1, 2))
        if not self.rows:
            return
        T = q.shape[2]
        if not all(0 <= r < T for r in self.rows):
            raise InputError(f"tap rows {self.rows} outside 0..{T - 1}")
        doc_ids, variant = (meta.doc_ids, meta.variant) if meta is not None else (self.doc_ids, self.variant)
        if doc_ids is None or variant is None:
            raise InputError("capture_taps: rows of a model without a torchtrain engine need doc_ids= and variant=")
        rows = torch.tensor(self.rows, device=q.device)
        with torch.no_grad():
            s = torch.matmul(q[:, :, rows], expand_kv(k, q.shape[1] // k.shape[1]).transpose(2, 3)) * scale
            allowed = dense_mask(doc_ids.to(q.device), variant, rows)[:, None]  # [B,1,R,T]
            p = F.softmax(s.float().masked_fill(~allowed, float("-inf")), dim=-1)
        self.put("scores", layer, s)
        self.put("probs", layer, p)

    def result(self) -> dict[str, list[torch.Tensor]]:
        return {name: [by_layer[i] for i in sorted(by_layer)] for name, by_layer in self.store.items() if by_layer}


def _output(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[index,return-value]


@contextmanager
def _wrapped_attention(model: nn.Module, rec: TapRecorder, qk: str) -> Iterator[None]:
    """The model's own attention implementation wrapped for the block (a local entry of transformers'
    AttentionInterface under the implementation's name, removed on exit), so q and k are recorded as the
    function gets them. qk="function": the function is handed `record_qk(q, k)` in its keywords instead
    and records them itself (a function that applies RoPE inside)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS[name] if name in ALL_ATTENTION_FUNCTIONS else None  # None: eager

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        layer = module.layer_idx
        if qk == "function":
            kwargs["record_qk"] = lambda q, k: rec.attention(layer, q, k, scale)
        else:
            rec.attention(layer, query, key, scale)
        fn = original or sys.modules[type(module).__module__].eager_attention_forward
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[name] = attention
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS[name]


@contextmanager
def capture_taps(model: nn.Module, rows: Sequence[int] | None = None, *, doc_ids: torch.Tensor | None = None,
                 variant: str | None = None, qk: str = "call") -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the taps of the forward passes run inside the block; the dict fills in on exit.

    Args:
      model: a transformers decoder of the families here. With a torchtrain engine active
        (torchtrain.build_model) q and k are captured inside the engine's attention function, which
        hands over its mask metadata; any other attention implementation (transformers' eager, sdpa,
        flex_attention, a function registered in its AttentionInterface) is wrapped for the block.
      rows: query slots R for `scores` and `probs` (none captured when omitted).
      doc_ids, variant: int [B,T] and a variant (docs/DESIGN.md §1-§2): the mask the rows' probabilities
        are read under, for a model without a torchtrain engine.
      qk: "call" (q and k as the attention function is called with them) or "function" (the function
        records them through `kwargs["record_qk"](q, k)`: one that applies RoPE itself).
    """
    if qk not in ("call", "function"):
        raise InputError(f"capture_taps: qk must be 'call' or 'function', got {qk!r}")
    engine = engine_of(model) is not None
    rec = TapRecorder(rows, doc_ids, variant)
    decoder = model.base_model
    handles = [decoder.embed_tokens.register_forward_hook(lambda m, a, out: rec.put("embed", 0, out))]
    for i, layer in enumerate(decoder.layers):
        if engine:
            setattr(layer.self_attn, TAP_ATTR, rec)
        handles += [
            layer.self_attn.register_forward_hook(lambda m, a, out, i=i: rec.put("attn_out", i, _output(out))),
            layer.mlp.register_forward_hook(lambda m, a, out, i=i: rec.put("mlp_out", i, _output(out))),
            layer.register_forward_hook(lambda m, a, out, i=i: rec.put("hidden", i, _output(out))),
        ]
    handles.append(model.get_output_embeddings().register_forward_hook(lambda m, a, out: rec.put("logits", 0, out)))
    taps: dict[str, list[torch.Tensor]] = {}
    try:
        with (nullcontext() if engine else _wrapped_attention(model, rec, qk)):
            yield taps
    finally:
        for h in handles:
            h.remove()
        if engine:
            for layer in decoder.layers:
                delattr(layer.self_attn, TAP_ATTR)
    taps.update(rec.result())
