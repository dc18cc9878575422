"""The parameters a model spec implies, and the seeded weights of a random preset.

`expected_shapes` names every tensor a model of a `ModelSpec` has, under Hugging Face's names and (out, in)
layout; `check_state` and `check_shapes` hold a reader's tensors against it, so that a missing, unexpected or
mis-shaped tensor is an InputError naming the first one before any model is built from it. `random_state`
draws the float32 weights of `random:<preset>` in that same order, the same numbers for the oracle and the
trainer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from anchor_core.errors import InputError
from anchor_core.spec import ModelSpec

StateDict = dict[str, np.ndarray]


# ---------------------------------------------------------------------------------------------
# Names and shapes


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter a model of this spec has, with its shape (Hugging Face names and layout)."""
    H, D, N, K, F = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, H), "model.norm.weight": (H,)}
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, H)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (N * D, H),
            p + "self_attn.k_proj.weight": (K * D, H),
            p + "self_attn.v_proj.weight": (K * D, H),
            p + "self_attn.o_proj.weight": (H, N * D),
            p + "mlp.gate_proj.weight": (F, H),
            p + "mlp.up_proj.weight": (F, H),
            p + "mlp.down_proj.weight": (H, F),
        })
        if spec.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (N * D,)
            shapes[p + "self_attn.k_proj.bias"] = (K * D,)
            shapes[p + "self_attn.v_proj.bias"] = (K * D,)
        if spec.qk_norm:  # one weight per head dimension, shared by all heads
            shapes[p + "self_attn.q_norm.weight"] = (D,)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
    return shapes


def check_state(spec: ModelSpec, state: StateDict, source: object) -> None:
    """Missing, unexpected or mis-shaped tensors are an InputError naming the first one."""
    check_shapes(spec, {name: tuple(a.shape) for name, a in state.items()}, source)


def check_shapes(spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
    """`check_state` on the tensors' shapes alone (name -> shape), read before their data."""
    want = expected_shapes(spec)
    # A tied model may still store lm_head (transformers writes it sometimes); it is ignored.
    extra = sorted(set(shapes) - set(want) - ({"lm_head.weight"} if spec.tie_embeddings else set()))
    missing = sorted(set(want) - set(shapes))
    if missing:
        raise InputError(f"weights lack {missing[0]} ({len(missing)} tensors missing)", path=source)
    if extra:
        raise InputError(f"weights hold an unexpected tensor {extra[0]} ({len(extra)} in all)", path=source)
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise InputError(
                f"config/weight shape mismatch: {name} has shape {tuple(shapes[name])}, "
                f"the config implies {shape}",
                path=source,
            )


# ---------------------------------------------------------------------------------------------
# Random presets


def random_state(spec: ModelSpec, seed: int = 0) -> StateDict:
    """Seeded float32 weights for `random:<preset>`, identical for both frameworks.

    Linear weights ~ N(0, 1/fan_in) so activations stay O(1) and attention is far from uniform
    (masks must matter); norm weights 1 + N(0, 0.1) so a norm-weight bug shows; biases N(0, 0.1).
    """
    return dict(random_tensors(spec, seed))


def random_tensors(spec: ModelSpec, seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """`random_state`'s tensors one at a time, in `expected_shapes` order (each draws from the one generator)."""
    rng = np.random.default_rng(seed)
    for name, shape in expected_shapes(spec).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight" or name == "lm_head.weight":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        yield name, w.astype(np.float32)
