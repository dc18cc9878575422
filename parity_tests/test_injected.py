"""The suite can fail: defects injected into the trainer are caught and localised.

Each defect is a context manager over a torchtrain model (forward hooks, pre-hooks, a swapped
buffer), entered by a `TorchRunner(setup=...)` around its forward: torchtrain's files are never
touched, and the shared cached model is restored when the block exits. Each test first checks that
the clean runner passes on the same inputs, then that the defective one fails with the first
divergence at the (layer, tap) where the defect sits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch

from parity_tests.cases import BF16, Case, case_inputs
from parity_tests.runners import TorchRunner, get_runner
from parity_tests.suite import describe, run_case
from torchtrain.attention.variants import dense_mask


@contextlib.contextmanager
def _hooks(*handles):
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def positions_off_by_one(layer: int):
    """Layer `layer` rotates q and k at positions + 1 (the other layers at the right positions)."""

    def setup(model):
        def pre(module, args, kwargs):
            pos = kwargs["position_ids"] + 1
            kwargs["position_embeddings"] = model.model.rotary_emb(kwargs["hidden_states"], pos)
            return args, kwargs

        return _hooks(model.model.layers[layer].self_attn.register_forward_pre_hook(pre, with_kwargs=True))

    return setup


def cos_sin_wrong_layout(layer: int):
    """Layer `layer` gets cos/sin tables in the interleaved (GPT-J) layout while rotating with
    rotate_half: [c0 … c_{D/2-1}, c0 … c_{D/2-1}] becomes [c0, c0, c1, c1, …]."""

    def setup(model):
        def pre(module, args, kwargs):
            cos, sin = kwargs["position_embeddings"]
            half = cos.shape[-1] // 2
            kwargs["position_embeddings"] = (cos[..., :half].repeat_interleave(2, -1),
                                             sin[..., :half].repeat_interleave(2, -1))
            return args, kwargs

        return _hooks(model.model.layers[layer].self_attn.register_forward_pre_hook(pre, with_kwargs=True))

    return setup


def _edit_mask(layer: int | None, edit):
    """Replace the dense mask the eager/sdpa engines use in one layer (every layer when None); the
    variant and doc_ids stay, so the taps' own probabilities still follow the variant's mask."""

    def setup(model):
        def pre(module, args, kwargs):
            meta = kwargs["attn_meta"]
            kwargs["attn_meta"] = dataclasses.replace(meta, dense=edit(meta.dense.clone(), meta))
            return args, kwargs

        layers = model.model.layers if layer is None else [model.model.layers[layer]]
        return _hooks(*[lay.self_attn.register_forward_pre_hook(pre, with_kwargs=True) for lay in layers])

    return setup


def mask_leaks_across_documents(layer: int):
    """In layer `layer` every query sees every earlier slot (the `full` mask instead of the variant's)."""
    return _edit_mask(layer, lambda dense, meta: dense_mask(meta.doc_ids, "full")[:, None])


def anchor_hidden_from_document():
    """In every layer, the longest document of each window cannot see the anchor (slot 0)."""

    def edit(dense, meta):
        for b in range(meta.doc_ids.shape[0]):
            docs, counts = torch.unique(meta.doc_ids[b][meta.doc_ids[b] > 0], return_counts=True)
            d = docs[counts.argmax()]
            dense[b, 0, meta.doc_ids[b] == d, 0] = False
        return dense

    return _edit_mask(None, edit)


def bf16_cast_after_mlp(layer: int):
    """Layer `layer`'s MLP output is rounded to bfloat16 in a float32 model (a stray cast)."""

    def setup(model):
        mlp = model.model.layers[layer].mlp
        return _hooks(mlp.register_forward_hook(lambda m, a, out: out.to(torch.bfloat16).to(out.dtype)))

    return setup


@contextlib.contextmanager
def _swap_buffer(module, name, value):
    old = getattr(module, name)
    module.register_buffer(name, value, persistent=False)
    try:
        yield
    finally:
        module.register_buffer(name, old, persistent=False)


def rope_frequencies_in_bf16():
    """RoPE `inv_freq` rounded to bfloat16 (what `model.to(torch.bfloat16)` does; TOOLCHAIN-FACTS):
    the angles `position * inv_freq` drift with the position."""

    def setup(model):
        rot = model.model.rotary_emb
        return _swap_buffer(rot, "inv_freq", rot.inv_freq.to(torch.bfloat16).float())

    return setup


def wrong_softmax_scale(layer: int):
    """Layer `layer` scales q·kᵀ by 1/D instead of 1/sqrt(D)."""

    def setup(model):
        attn = model.model.layers[layer].self_attn

        @contextlib.contextmanager
        def patched():
            old = attn.scaling
            attn.scaling = 1.0 / model.anchor_spec.head_dim
            try:
                yield
            finally:
                attn.scaling = old

        return patched()

    return setup


# (defect id, case, defect, expected first divergence (layer, tap))
DEFECTS = [
    ("positions_off_by_one_layer1", Case("random:llama", "anchor", "plain", "fp32", "eager", 97),
     positions_off_by_one(1), (1, "q")),
    ("cos_sin_wrong_layout_layer2", Case("random:llama", "anchor", "plain", "fp32", "sdpa", 97),
     cos_sin_wrong_layout(2), (2, "q")),
    ("mask_leak_layer2", Case("random:llama", "anchor", "plain", "fp32", "eager", 97),
     mask_leaks_across_documents(2), (2, "attn_out")),
    ("anchor_hidden_from_longest_document", Case("random:llama", "anchor", "plain", "fp32", "sdpa", 97),
     anchor_hidden_from_document(), (0, "attn_out")),
    ("bf16_cast_after_mlp_layer1", Case("random:llama", "anchor", "plain", "fp32", "eager", 97),
     bf16_cast_after_mlp(1), (1, "mlp_out")),
    ("rope_inv_freq_in_bf16", Case("random:llama", "anchor", "plain", BF16, "sdpa", 97),
     rope_frequencies_in_bf16(), (0, "q")),
    ("wrong_softmax_scale_layer1", Case("random:llama", "anchor", "plain", BF16, "eager", 97),
     wrong_softmax_scale(1), (1, "scores")),
]


@functools.cache
def _clean(case: Case) -> dict:
    return run_case(case)


@pytest.mark.parametrize("case,setup,expected", [pytest.param(c, s, e, id=i) for i, c, s, e in DEFECTS])
def test_defect_is_caught_and_localised(case, setup, expected):
    clean = _clean(case)
    print(describe(clean))
    assert clean["pass"], "the clean trainer must pass before a defect can be judged"
    runner = TorchRunner(case.engine, name=f"{case.engine}+defect", setup=setup)
    broken = run_case(case, runner=runner)
    print(describe(broken))
    first = broken["first_divergence"]
    assert not broken["pass"]
    assert (first["layer"], first["tap"]) == expected, first


def test_defects_leave_the_model_as_it_was():
    """After a defective run, the shared cached model passes again (hooks and buffers restored)."""
    case = Case("random:llama", "anchor", "plain", BF16, "sdpa", 97)
    for setup in (rope_frequencies_in_bf16(), positions_off_by_one(0), anchor_hidden_from_document()):
        run_case(case, runner=TorchRunner("sdpa", name="sdpa+defect", setup=setup))
    again = run_case(case, runner=get_runner("sdpa"))
    print(describe(again))
    assert again["pass"]
    assert case_inputs(case).rows[0] == 0
