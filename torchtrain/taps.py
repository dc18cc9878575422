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

`scores`/`probs` are captured only when `rows` is given. A second forward inside one capture
overwrites the first (so a gradient-checkpointing recomputation leaves the taps unchanged).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from anchor.errors import InputError
from torchtrain.attention import expand_kv
from torchtrain.engines import TAP_ATTR, AttnMeta, engine_of
from torchtrain.variants import dense_mask

TAP_NAMES: tuple[str, ...] = ("embed", "q", "k", "attn_out", "mlp_out", "hidden", "scores", "probs", "logits")


def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(device="cpu", dtype=torch.float32, copy=True)


class _Recorder:
    def __init__(self, rows: Sequence[int] | None):
        self.rows = None if rows is None else [int(r) for r in rows]
        self.store: dict[str, dict[int, torch.Tensor]] = {name: {} for name in TAP_NAMES}

    def put(self, name: str, layer: int, x: torch.Tensor) -> None:
        self.store[name][layer] = _copy(x)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float, meta: AttnMeta) -> None:
        """q [B,N,T,D], k [B,K,T,D] as the attention function receives them."""
        self.put("q", layer, q.transpose(1, 2))
        self.put("k", layer, k.transpose(1, 2))
        if not self.rows:
            return
        T = q.shape[2]
        if not all(0 <= r < T for r in self.rows):
            raise InputError(f"tap rows {self.rows} outside 0..{T - 1}")
        rows = torch.tensor(self.rows, device=q.device)
        with torch.no_grad():
            s = torch.matmul(q[:, :, rows], expand_kv(k, q.shape[1] // k.shape[1]).transpose(2, 3)) * scale
            allowed = dense_mask(meta.doc_ids, meta.variant, rows)[:, None]  # [B,1,R,T]
            p = F.softmax(s.float().masked_fill(~allowed, float("-inf")), dim=-1)
        self.put("scores", layer, s)
        self.put("probs", layer, p)

    def result(self) -> dict[str, list[torch.Tensor]]:
        return {name: [by_layer[i] for i in sorted(by_layer)] for name, by_layer in self.store.items() if by_layer}


def _output(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[index,return-value]


@contextmanager
def capture_taps(model: nn.Module, rows: Sequence[int] | None = None) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the taps of the forward passes run inside the block; the dict fills in on exit.

    Args:
      model: a model from torchtrain.build_model (a torchtrain engine must be active: q/k are
        captured inside its attention function).
      rows: query slots R for `scores` and `probs` (none captured when omitted).
    """
    if engine_of(model) is None:
        raise InputError("capture_taps needs a model running a torchtrain engine (torchtrain.build_model)")
    rec = _Recorder(rows)
    decoder = model.base_model
    handles = [decoder.embed_tokens.register_forward_hook(lambda m, a, out: rec.put("embed", 0, out))]
    for i, layer in enumerate(decoder.layers):
        setattr(layer.self_attn, TAP_ATTR, rec)
        handles += [
            layer.self_attn.register_forward_hook(lambda m, a, out, i=i: rec.put("attn_out", i, _output(out))),
            layer.mlp.register_forward_hook(lambda m, a, out, i=i: rec.put("mlp_out", i, _output(out))),
            layer.register_forward_hook(lambda m, a, out, i=i: rec.put("hidden", i, _output(out))),
        ]
    handles.append(model.get_output_embeddings().register_forward_hook(lambda m, a, out: rec.put("logits", 0, out)))
    taps: dict[str, list[torch.Tensor]] = {}
    try:
        yield taps
    finally:
        for h in handles:
            h.remove()
        for layer in decoder.layers:
            delattr(layer.self_attn, TAP_ATTR)
    taps.update(rec.result())
