"""The numpy random init follows PyTorch's defaults (nn.Linear kaiming-uniform a=√5, nn.Embedding N(0,1))."""

from __future__ import annotations

import numpy as np
import pytest

from anchor_core.spec import random_preset
from anchor_core.weights import expected_shapes
from parity_tests.audit import torch_default_state


def test_shapes_bounds_and_stats():
    spec = random_preset("qwen2")  # has q/k/v biases
    st = torch_default_state(spec, seed=1)
    assert {k: v.shape for k, v in st.items()} == expected_shapes(spec)
    for name, w in st.items():
        assert w.dtype == np.float32
        if name.endswith("norm.weight"):
            assert (w == 1).all()
        elif name == "model.embed_tokens.weight":
            assert abs(w.std() - 1) < 0.05
        else:
            fan_in = w.shape[1] if w.ndim == 2 else st[name[:-4] + "weight"].shape[1]
            bound = 1 / np.sqrt(fan_in)
            assert np.abs(w).max() <= bound
            if w.size > 2000:
                assert w.std() == pytest.approx(bound / np.sqrt(3), rel=0.05)
    assert (torch_default_state(spec, seed=1)["model.layers.0.self_attn.q_proj.weight"]
            == st["model.layers.0.self_attn.q_proj.weight"]).all()
    assert not (torch_default_state(spec, seed=2)["model.layers.0.self_attn.q_proj.weight"]
                == st["model.layers.0.self_attn.q_proj.weight"]).all()


def test_matches_torch_default_distribution():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    lin = torch.nn.Linear(384, 200)
    emb = torch.nn.Embedding(500, 64)
    spec = random_preset("llama")
    st = torch_default_state(spec.replace(hidden_size=384, num_heads=6, head_dim=64, num_kv_heads=6), seed=0)
    ours = st["model.layers.0.mlp.gate_proj.weight"]  # (F, 384)
    theirs = lin.weight.detach().numpy()
    print(f"std ours {ours.std():.5f} torch {theirs.std():.5f}; max ours {np.abs(ours).max():.5f} "
          f"torch {np.abs(theirs).max():.5f}; bias bound {1 / np.sqrt(384):.5f}")
    assert ours.std() == pytest.approx(theirs.std(), rel=0.05)
    assert np.abs(ours).max() == pytest.approx(np.abs(theirs).max(), rel=0.01)
    assert st["model.embed_tokens.weight"].std() == pytest.approx(emb.weight.detach().numpy().std(), rel=0.05)
