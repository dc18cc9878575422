"""Taps: names, shapes, and that they are what they claim to be."""

from __future__ import annotations

import pytest
import torch

import torchtrain
from tests.torchtrain.conftest import packed_batch
from torchtrain.attention.variants import dense_mask

ROWS = [0, 1, 17, 38]


@pytest.fixture(scope="module")
def captured():
    model = torchtrain.build_model("random:mistral", engine="eager")
    spec = model.anchor_spec
    batch = packed_batch("anchor", 39, vocab=spec.vocab_size)
    with torch.no_grad(), torchtrain.capture_taps(model, rows=ROWS) as taps:
        out = model(**batch.model_inputs())
    return model, batch, taps, out


def test_names_and_shapes(captured):
    model, batch, taps, _ = captured
    s = model.anchor_spec
    B, T, L, R = 2, 39, s.num_layers, len(ROWS)
    want = {
        "embed": (1, (B, T, s.hidden_size)),
        "q": (L, (B, T, s.num_heads, s.head_dim)),
        "k": (L, (B, T, s.num_kv_heads, s.head_dim)),
        "attn_out": (L, (B, T, s.hidden_size)),
        "mlp_out": (L, (B, T, s.hidden_size)),
        "hidden": (L, (B, T, s.hidden_size)),
        "scores": (L, (B, s.num_heads, R, T)),
        "probs": (L, (B, s.num_heads, R, T)),
        "logits": (1, (B, T, s.vocab_size)),
    }
    assert set(taps) == set(want) == set(torchtrain.TAP_NAMES)
    for name, (n, shape) in want.items():
        print(name, len(taps[name]), tuple(taps[name][0].shape))
        assert len(taps[name]) == n and all(tuple(t.shape) == shape and t.dtype == torch.float32 for t in taps[name])
    assert not hasattr(model.model.layers[0].self_attn, "_torchtrain_tap")


def test_taps_are_consistent(captured):
    model, batch, taps, out = captured
    torch.testing.assert_close(taps["logits"][0], out.logits, rtol=0, atol=0)
    torch.testing.assert_close(taps["embed"][0], model.model.embed_tokens(batch.tokens), rtol=0, atol=0)
    prev = taps["embed"][0]
    for l in range(model.config.num_hidden_layers):
        # the residual stream: hidden_l = hidden_{l-1} + attn_out_l + mlp_out_l
        torch.testing.assert_close(taps["hidden"][l], prev + taps["attn_out"][l] + taps["mlp_out"][l], rtol=1e-5, atol=1e-5)
        prev = taps["hidden"][l]
    mask = dense_mask(batch.doc_ids, "anchor", torch.tensor(ROWS))[:, None]
    for l in range(model.config.num_hidden_layers):
        p = taps["probs"][l]
        assert torch.equal(p[~mask.expand_as(p)], torch.zeros_like(p[~mask.expand_as(p)]))
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)))
        q, k = taps["q"][l], taps["k"][l]
        G = q.shape[2] // k.shape[2]
        s = torch.einsum("BRND,BTND->BNRT", q[:, ROWS], k.repeat_interleave(G, dim=2)) * model.anchor_spec.head_dim**-0.5
        torch.testing.assert_close(taps["scores"][l], s, rtol=1e-5, atol=1e-5)


def test_q_is_rotated(captured):
    """Layer 0's q tap is q_proj(input_layernorm(embed)) rotated by RoPE at the batch's positions."""
    model, batch, taps, _ = captured
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(taps["embed"][0])
        q = attn.q_proj(x).view(2, 39, -1, model.anchor_spec.head_dim)
        cos, sin = model.model.rotary_emb(x, batch.positions)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q_rot, _ = apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close(taps["q"][0], q_rot, rtol=1e-6, atol=1e-6)


def test_probs_match_the_engine_output(captured):
    """probs · v of the layer equals the attention output before o_proj, for the tapped rows."""
    model, batch, taps, _ = captured
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        x = model.model.layers[1].input_layernorm(taps["hidden"][0])
        v = attn.v_proj(x).view(2, 39, -1, model.anchor_spec.head_dim)
        G = model.anchor_spec.groups
        ctx = torch.einsum("BNRT,BTND->BRND", taps["probs"][1], v.repeat_interleave(G, dim=2))
        o = attn.o_proj(ctx.reshape(2, len(ROWS), -1))
    torch.testing.assert_close(o, taps["attn_out"][1][:, ROWS], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine", ["sdpa", "flex", "flash_varlen_emulated"])
def test_taps_on_every_engine(engine):
    model = torchtrain.build_model("random:qwen2", engine=engine)
    batch = packed_batch("intra_doc_reset", 97)  # the engine matrix's shape: flex is compiled once
    with torch.no_grad(), torchtrain.capture_taps(model, rows=[5]) as taps:
        model(**batch.model_inputs())
    assert len(taps["q"]) == model.config.num_hidden_layers and taps["probs"][0].shape[2] == 1


def test_without_rows_no_scores():
    model = torchtrain.build_model("random:llama", engine="sdpa")
    with torch.no_grad(), torchtrain.capture_taps(model) as taps:
        model(**packed_batch("full", 12).model_inputs())
    assert "scores" not in taps and "probs" not in taps and len(taps["hidden"]) == 3
