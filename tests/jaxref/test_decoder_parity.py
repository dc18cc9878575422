"""The oracle's decoder against transformers (torch, fp32, eager attention with an explicit 4-D mask)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import jaxref
from anchor.spec import to_hf_config
from anchor.weights import load_weights
from tests.jaxref.layouts import random_layout

_MODELS: dict[str, tuple] = {}


def hf_and_oracle(name: str):
    """(spec, oracle params, transformers eager fp32 model), built once per test process."""
    if name not in _MODELS:
        spec, state = load_weights(name)
        cfg = AutoConfig.for_model(**to_hf_config(spec))
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        missing, unexpected = model.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        _MODELS[name] = (spec, jaxref.params_from_state(spec, state), model)
    return _MODELS[name]


def real_text_tokens(name: str, T: int) -> np.ndarray:
    """Token ids of real text (the json package's source) for a pretrained model.

    A pretrained model fed random ids grows pathological activations (|h| ~ 3e4 in SmolLM2)
    that amplify fp32 rounding chaotically; on text it behaves as in use.
    """
    import json
    from pathlib import Path

    from anchor.tokenizer import load_tokenizer

    tok = load_tokenizer(name)
    text = "".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py")))
    ids = np.asarray(tok.encode_batch([text])[0][:T], dtype=np.int64)
    assert len(ids) == T
    ids[0] = tok.bos_id if tok.bos_id is not None else tok.eos_id
    return ids[None]


def hf_logits(model, tokens, doc, pos, variant):
    mask = torch.from_numpy(jaxref.attention_mask(doc, variant))[None, None]
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), attention_mask=additive,
                    position_ids=torch.from_numpy(pos[None]), use_cache=False)
    return out.logits.double().numpy()


CASES = [
    pytest.param(name, T, marks=[pytest.mark.model] if name == "default" else [])
    for name in ("random:llama", "random:qwen2", "random:mistral", "random:llama3", "default")
    for T in (97, 1025)
]


@pytest.mark.parametrize("name,T", CASES)
def test_final_logits_match_transformers_fp32(name, T):
    spec, params, model = hf_and_oracle(name)
    rng = np.random.default_rng(T)
    for variant in ("full", "intra_doc", "anchor"):
        # Short documents in a pretrained model are ill-conditioned: on SmolLM2 at T=1025,
        # transformers' own fp32 logits are 1.7e-5 (one-token documents) and 1.2e-5 (16-token
        # documents, anchor) from fp64 truth, so no fp32 implementation can meet 1e-5 against
        # them. The pretrained case uses realistic lengths (>= 64 tokens; transformers' fp32 error
        # 1.2e-6); the random presets cover one-token documents.
        min_len = 64 if name == "default" else 1
        doc = random_layout(rng, T, variant, min_len=min_len) if variant != "full" else np.ones(T, np.int32)
        pos = jaxref.positions(doc, variant)
        tokens = real_text_tokens(name, T) if name == "default" else rng.integers(3, spec.vocab_size, (1, T))
        ref = hf_logits(model, tokens, doc, pos, variant)
        out = np.asarray(jaxref.forward(params, spec, tokens, positions=pos[None], doc_ids=doc[None],
                                        variant=variant, policy="fp32"), dtype=np.float64)
        real = doc >= 0  # padding outputs are not defined by the contract beyond "attends to itself"
        err = np.linalg.norm((out - ref)[:, real]) / np.linalg.norm(ref[:, real])
        print(f"{name} T={T} {variant}: rel L2 {err:.3e}, max abs {np.abs(out - ref)[:, real].max():.3e}")
        assert err <= 1e-5
