"""build_model: weights, dtypes, RoPE overrides; unavailable engines and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchtrain
from anchor_core.errors import InputError, UnavailableError
from anchor_core.spec import RopeSpec, to_hf_config
from anchor_core.weights import load_weights
from tests.torchtrain.conftest import packed_batch
from torchtrain.attention.engines import flash_attn_kernel


@pytest.mark.parametrize("name", ["random:llama", "random:qwen2", "random:mistral", "random:smollm2", "random:qwen3"])
def test_random_presets_hold_the_oracle_weights(name):
    spec, state = load_weights(name)
    model = torchtrain.build_model(name, engine="eager")
    got = model.state_dict()
    assert type(model).__name__ == to_hf_config(spec)["architectures"][0]  # Qwen3ForCausalLM for qwen3
    assert set(got) - {"lm_head.weight"} <= set(state)  # every parameter from the oracle's (q/k norms too)
    for k, v in state.items():
        assert torch.equal(got[k], torch.from_numpy(v)), k
    assert model.config.use_cache is False
    assert model.config.tie_word_embeddings == spec.tie_embeddings
    if spec.tie_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bf16_keeps_rope_frequencies_fp32():
    spec, state = load_weights("random:llama3")
    m32 = torchtrain.build_model("random:llama3", dtype="float32")
    m16 = torchtrain.build_model("random:llama3", dtype="bfloat16")
    assert next(m16.parameters()).dtype == torch.bfloat16
    for (name, b32), (_, b16) in zip(m32.named_buffers(), m16.named_buffers()):
        print(name, b32.dtype, b16.dtype)
        assert name.endswith("inv_freq") and b16.dtype == torch.float32
        assert torch.equal(b16, b32)
    w = state["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(m16.model.layers[0].self_attn.q_proj.weight, torch.from_numpy(w).bfloat16())


def test_rope_override_goes_through_the_spec():
    base = 1e6
    model = torchtrain.build_model("random:llama", rope={"base": base})
    D = model.anchor_spec.head_dim
    want = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    assert model.anchor_spec.rope.base == base
    assert torch.equal(model.model.rotary_emb.inv_freq, want)
    linear = torchtrain.build_model("random:llama", rope=RopeSpec(base=base, kind="linear", factor=4.0))
    assert linear.config.rope_parameters["rope_type"] == "linear"
    torch.testing.assert_close(linear.model.rotary_emb.inv_freq, want / 4.0, rtol=0, atol=0)


def test_local_hf_folder(tmp_path):
    from anchor_core.export import write_model

    spec, state = load_weights("random:qwen2")
    write_model(spec, state, tmp_path / "m")
    a = torchtrain.build_model(str(tmp_path / "m"), engine="sdpa")
    b = torchtrain.build_model("random:qwen2", engine="sdpa")
    batch = packed_batch("intra_doc", 30)
    with torch.no_grad():
        torch.testing.assert_close(a(**batch.model_inputs()).logits, b(**batch.model_inputs()).logits, rtol=0, atol=0)


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    print(type(excinfo.value).__name__, ":", msg)
    assert msg and "\n" not in msg
    return msg


def test_unknown_engine():
    with pytest.raises(UnavailableError) as e:
        torchtrain.build_model("random:llama", engine="flash_attention_2")
    msg = _one_line(e)
    assert "flash_attention_2" in msg and "sdpa" in msg


@pytest.mark.skipif(flash_attn_kernel() is not None, reason="flash-attn imports here")
def test_flash_varlen_without_flash_attn():
    with pytest.raises(UnavailableError) as e:
        torchtrain.build_model("random:llama", engine="flash_varlen", dtype="bfloat16")
    msg = _one_line(e)
    assert "flash_varlen" in msg and "flash_varlen_emulated" in msg


def test_flash_varlen_in_float32_is_refused(monkeypatch):
    """FlashAttention has no fp32 kernel: the engine/dtype combination is refused even where it imports."""
    monkeypatch.setattr(torchtrain.attention.engines, "flash_attn_kernel", lambda: object())
    with pytest.raises(UnavailableError) as e:
        torchtrain.build_model("random:llama", engine="flash_varlen", dtype="float32")
    assert "bfloat16" in _one_line(e)


def test_flash_varlen_on_cpu_tensors_is_refused(monkeypatch):
    monkeypatch.setattr(torchtrain.attention.engines, "flash_attn_kernel", lambda: object())
    model = torchtrain.build_model("random:llama", engine="flash_varlen", dtype="bfloat16")
    with pytest.raises(UnavailableError) as e, torch.no_grad():
        model(**packed_batch("anchor", 20).model_inputs())
    assert "CUDA" in _one_line(e)


def test_flex_backward_on_cpu_is_refused():
    model = torchtrain.build_model("random:llama", engine="flex")
    batch = packed_batch("anchor", 97)  # the engine matrix's shape: the compiled kernel is reused
    logits = model(**batch.model_inputs()).logits  # the forward runs
    with pytest.raises(UnavailableError) as e:
        logits.sum().backward()
    msg = _one_line(e)
    assert "flex" in msg and "sdpa" in msg


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"variant": "sliding"}, "unknown attention variant"),
        ({"variant": "anchor", "doc_ids": None}, "needs doc_ids"),
        ({"variant": None}, "without variant"),
        ({"use_cache": True}, "use_cache=False"),
        ({"doc_ids": np.ones((2, 7), dtype=np.int64), "variant": "full"}, "shape"),
    ],
)
def test_bad_forward_inputs(kwargs, needle):
    model = torchtrain.build_model("random:llama", engine="sdpa")
    inputs = {**packed_batch("anchor", 20).model_inputs(), **kwargs}
    with pytest.raises(InputError) as e, torch.no_grad():
        model(**inputs)
    assert needle in _one_line(e)


def test_bad_build_inputs():
    with pytest.raises(InputError) as e:
        torchtrain.build_model("random:llama", dtype="float16")
    assert "float16" in _one_line(e)
    with pytest.raises(InputError) as e:
        torchtrain.build_model("random:llama", rope={"bsae": 1e6})
    assert "bsae" in _one_line(e)
    with pytest.raises(InputError) as e:
        torchtrain.build_model("random:gpt2")
    _one_line(e)
