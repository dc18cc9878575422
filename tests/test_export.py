"""anchor_core.export.export_hf (what a checkpoint's `hf/` holds) for every family, tied and untied heads:
the folder reloads in transformers' own `from_pretrained` with logits identical to those of the model it
was exported from (stock transformers built from the spec and the state), reads back through
anchor_core.weights as the same spec and weights, and its tokenizer loads in transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from anchor_core.export import export_hf
from anchor_core.spec import RANDOM_PRESETS, random_preset, to_hf_config
from anchor_core.tokenizer import load_tokenizer
from anchor_core.weights import load_weights, random_state

# Every preset as it is (qwen2, qwen3, smollm2 tie their embeddings), and Qwen3 untied (as Qwen3-8B and up).
MODELS = [*RANDOM_PRESETS, "qwen3+untied"]


def spec_and_state(model: str):
    preset, _, variant = model.partition("+")
    spec = random_preset(preset)
    if variant == "untied":
        spec = spec.replace(tie_embeddings=False)
    return preset, spec, random_state(spec, seed=1)


@pytest.mark.parametrize("model", MODELS)
def test_export_reloads_in_transformers_with_identical_logits(model, tmp_path):
    preset, spec, state = spec_and_state(model)
    folder = export_hf(spec, state, tmp_path / "hf", tokenizer_of=f"random:{preset}")

    source = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(spec)), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    missing, unexpected = source.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if spec.tie_embeddings else set())
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == type(source).__name__ == to_hf_config(spec)["architectures"][0]
    assert reloaded.config.tie_word_embeddings == spec.tie_embeddings
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == spec.tie_embeddings

    ids = torch.from_numpy(np.random.default_rng(0).integers(3, spec.vocab_size, (2, 97)))
    with torch.no_grad():
        a, b = source(ids, use_cache=False).logits, reloaded(ids, use_cache=False).logits
    print(f"{model} ({type(reloaded).__name__}, tied {spec.tie_embeddings}): max |diff| {(a - b).abs().max():.1e}")
    assert torch.equal(a, b)

    spec_back, state_back = load_weights(str(folder))
    assert spec_back == spec
    assert set(state_back) == set(state) and all(np.array_equal(state_back[k], v) for k, v in state.items())

    text = "Qwen3 q/k norms, ünïcode"
    assert AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"] == \
        load_tokenizer(f"random:{preset}").encode_batch([text])[0]
