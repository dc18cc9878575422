"""A `.gguf` file (llama.cpp) read as Hugging Face weights: its spec from the metadata, its tensors dequantized.

GGUF tensor names are mapped to Hugging Face's (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`),
shapes are reversed to (out, in), and the q/k rows of Llama-architecture files are un-permuted (llama.cpp's
converter interleaves the rotary halves), so that a GGUF model and the Hugging Face folder it came from give the
same state dict. The file is read through `anchor_core.gguf_file`; the dequantization is the `gguf` package's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from anchor_core.errors import InputError
from anchor_core.gguf_file import read_gguf_file
from anchor_core.spec import ModelSpec, RopeSpec
from anchor_core.weight_shapes import StateDict, check_state


# ---------------------------------------------------------------------------------------------
# GGUF (llama.cpp)

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gguf_reader(path: Path):
    try:
        return read_gguf_file(path)
    except (ValueError, OSError) as e:
        raise InputError(f"not a readable GGUF file (truncated or corrupt): {e}", path=path) from None


def _gguf_field(reader, key: str, default=None):
    return reader.fields.get(key, default)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter interleaves the rotary halves)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def gguf_spec(path: Path, reader=None) -> ModelSpec:
    """The ModelSpec of a GGUF file, read from its metadata."""
    reader = reader or _gguf_reader(path)
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise InputError(f"unsupported architecture {arch!r} (supported: llama, qwen2, qwen3)", path=path)

    def need(key):
        v = _gguf_field(reader, f"{arch}.{key}")
        if v is None:
            raise InputError(f"GGUF metadata lacks {arch}.{key}", path=path)
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv = int(_gguf_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_gguf_field(reader, f"{arch}.attention.key_length", hidden // heads))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    vocab = int(_gguf_field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    scaling = _gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(_gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    base = float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0))
    if scaling in ("none", None) or factor == 1.0:
        rope = RopeSpec(base=base)
    elif scaling in ("linear", "yarn"):
        orig = _gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
        rope = RopeSpec(base=base, kind=scaling, factor=factor, original_max_position=None if orig is None else int(orig))
    else:
        raise InputError(f"unsupported GGUF RoPE scaling {scaling!r}", path=path)
    eps = float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id", 2)
    family = arch if arch in ("qwen2", "qwen3") else ("smollm2" if tied else "llama")
    return ModelSpec(
        family=family,  # type: ignore[arg-type]
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=int(need("feed_forward_length")),
        rms_norm_eps=float(np.float32(eps)),
        max_position=int(_gguf_field(reader, f"{arch}.context_length", 4096)),
        rope=rope,
        tie_embeddings=tied,
        qkv_bias=arch == "qwen2",
        bos_token_id=None if arch in ("qwen2", "qwen3") or bos is None else int(bos),
        eos_token_id=int(eos),
    )


def read_gguf(path: Path) -> tuple[ModelSpec, StateDict]:
    """Dequantize a GGUF file to float32 Hugging Face-layout tensors."""
    reader = _gguf_reader(path)
    spec = gguf_spec(path, reader)
    state = dict(gguf_tensors(path, reader, spec))
    check_state(spec, state, path)
    return spec, state


def gguf_name(path: Path, name: str) -> str:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
    a tensor this toolkit does not read is an InputError naming it."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    if name == "rope_freqs.weight":
        raise InputError("GGUF files with a rope_freqs tensor (llama3 scaling) are not supported", path=path)
    raise InputError(f"unexpected GGUF tensor {name}", path=path)


def gguf_shapes(path: Path, reader) -> dict[str, tuple[int, ...]]:
    """Every tensor of a GGUF file under its Hugging Face name, with its shape, in the file's order."""
    return {gguf_name(path, t.name): tuple(int(s) for s in reversed(t.shape)) for t in reader.tensors}


def gguf_tensors(path: Path, reader, spec: ModelSpec) -> Iterator[tuple[str, np.ndarray]]:
    """A GGUF file's tensors dequantized to float32, one at a time in the file's order, under Hugging Face
    names and layout."""
    import gguf

    arch = _gguf_field(reader, "general.architecture")
    for t in reader.tensors:
        name = gguf_name(path, t.name)
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            w = np.asarray(w, dtype=np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
        except Exception as e:
            raise InputError(f"cannot read GGUF tensor {t.name} (truncated or corrupt): {e}", path=path) from None
        # llama.cpp permutes q/k rows of Llama-architecture models only.
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _unpermute(w, spec.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _unpermute(w, spec.num_kv_heads)
        yield name, w
