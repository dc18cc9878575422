"""Weight readers without torch: a local Hugging Face directory, a `.gguf` file, `random:<preset>`.

Every reader returns `(spec, state)`: a `ModelSpec` and a state dict of float32 numpy arrays under
Hugging Face's parameter names (`model.layers.{i}.self_attn.q_proj.weight`, (out, in) layout), so
the oracle and the trainer start from the same numbers. Nothing here unpickles: safetensors is
parsed from its JSON header, GGUF through the `gguf` package.

A folder named as a model goes through `model_folder` before anything in it is read: a training
checkpoint (`RUN/checkpoints/step-<N>`, or its `hf/`) must match its manifest (`verify`, the one check
that resuming, `anchor eval --run` and every `--model` share), and a folder without a manifest is read
only where it is plainly a Hugging Face folder and no checkpoint, with a note that it was not verified.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from anchor_core.atomic import sha256_file
from anchor_core.errors import InputError, read_json_object
from anchor_core.gguf_file import read_gguf_file
from anchor_core.paths import resolve_model_name
from anchor_core.spec import ModelSpec, RopeSpec, from_hf_config, random_preset

StateDict = dict[str, np.ndarray]

# A Hugging Face folder's weights (transformers' names): one file, or shards named by an index.
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16"}


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


# ---------------------------------------------------------------------------------------------
# safetensors (parsed from its header; no pickle)


_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors library's own limit


def safetensors_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """The validated header of a `.safetensors` file and where its data starts.

    Checked before any tensor is read: the header is a JSON object of tensors, each with a known
    dtype, a shape of non-negative integers and `data_offsets` [begin, end] inside the file whose
    size is exactly shape x dtype size; an InputError names the file and the tensor otherwise.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError("truncated safetensors file (no header)", path=path)
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise InputError("truncated safetensors file (header runs past the end)", path=path)
            if n > _SAFETENSORS_MAX_HEADER:
                raise InputError(f"safetensors header of {n} bytes is larger than the format allows", path=path)
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"unreadable safetensors file: {e}", path=path) from None
    if not isinstance(header, dict):
        raise InputError(f"safetensors header must be a JSON object, got {type(header).__name__}", path=path)
    header.pop("__metadata__", None)
    start = 8 + n
    data_size = size - start
    for name, info in header.items():
        if not isinstance(info, dict):
            raise InputError(f"safetensors header: tensor {name} is not an object", path=path)
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _SAFETENSORS_ITEMSIZE:
            raise InputError(f"unsupported safetensors dtype {dtype!r} for {name} "
                             f"(supported: {', '.join(_SAFETENSORS_ITEMSIZE)})", path=path)
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise InputError(f"safetensors header: tensor {name} has no valid shape ({shape!r})", path=path)
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise InputError(f"safetensors header: tensor {name} has no valid data_offsets ({offsets!r})", path=path)
        b, e = offsets
        if not 0 <= b <= e:
            raise InputError(f"safetensors header: tensor {name} has data_offsets {offsets} out of order", path=path)
        if e > data_size:
            raise InputError(f"truncated safetensors file: tensor {name} runs past the end", path=path)
        want = int(np.prod(shape, dtype=np.int64)) * _SAFETENSORS_ITEMSIZE[dtype] if shape else \
            _SAFETENSORS_ITEMSIZE[dtype]
        if e - b != want:
            raise InputError(f"safetensors header: tensor {name} of shape {shape} ({dtype}) needs {want} bytes, "
                             f"its data_offsets span {e - b}", path=path)
    return header, start


def read_safetensors(path: Path, names: Collection[str] | None = None) -> StateDict:
    """Read a `.safetensors` file (`names`: only those tensors, each of which it must hold) into float32 numpy
    arrays; a truncated or corrupt file is an InputError. Only the tensors read are copied out of the
    file's memory map."""
    header, start = safetensors_header(path)
    check_listed(path, header, names)
    data = np.memmap(path, dtype=np.uint8, mode="r") if header else np.zeros(0, np.uint8)
    out: StateDict = {}
    for name, info in header.items():
        if names is not None and name not in names:
            continue
        b, e = info["data_offsets"]
        kind = _SAFETENSORS_DTYPES[info["dtype"]]
        if kind == "bfloat16":
            import ml_dtypes

            kind = ml_dtypes.bfloat16
        arr = np.frombuffer(data[start + b : start + e], dtype=kind).reshape(info["shape"])
        out[name] = arr.astype(np.float32)
    return out


def check_listed(path: Path, header: dict[str, Any], names: Collection[str] | None) -> None:
    """Every tensor the folder's index puts in the safetensors file `path` (`names`; None: no index) is in its
    `header`; else an InputError naming the first one absent and the folder."""
    absent = sorted(set(names or ()) - set(header))
    if absent:
        more = f" (nor {len(absent) - 1} more the index puts there)" if len(absent) > 1 else ""
        raise InputError(f"{SAFE_WEIGHTS_INDEX_NAME} puts {absent[0]} in {path.name}, which does not hold "
                         f"it{more}", path=path.parent)


def safetensors_index(path: Path) -> dict[str, str]:
    """The weight map of a sharded Hugging Face folder's `model.safetensors.index.json`: tensor name -> the
    shard holding it, checked: a JSON object with a non-empty `weight_map` object whose values name
    `.safetensors` files in the folder (a bare file name, no other folder); else an InputError naming the
    index and the problem."""
    where = path / SAFE_WEIGHTS_INDEX_NAME
    index = read_json_object(where)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        got = {None: "none", dict: "an empty object"}.get(weight_map if weight_map is None else type(weight_map),
                                                          f"a {type(weight_map).__name__}")
        raise InputError(f"a sharded model's index needs a non-empty weight_map object (tensor name -> file), got "
                         f"{got}", path=where)
    for name, file in weight_map.items():
        if (not isinstance(file, str) or not file.endswith(".safetensors") or Path(file).name != file
                or file in (".", "..")):
            raise InputError(f"weight_map: {name} is in {repr(file)[:80]}, not a .safetensors file of this folder",
                             path=where)
        if not (path / file).is_file():
            raise InputError(f"weight_map: {name} is in {file}, which is missing", path=where)
    return weight_map


def weight_files(path: Path) -> dict[Path, set[str] | None]:
    """The safetensors files of a Hugging Face folder, chosen as transformers' `from_pretrained` chooses:
    `model.safetensors` where there is one; else the shards of `model.safetensors.index.json`, each with the
    tensors the index puts in it; else (a folder of neither, read as this toolkit always has) every
    `*.safetensors`. None: every tensor of the file."""
    if (path / SAFE_WEIGHTS_NAME).is_file():
        return {path / SAFE_WEIGHTS_NAME: None}
    if (path / SAFE_WEIGHTS_INDEX_NAME).is_file():
        files: dict[Path, set[str] | None] = {}
        for name, file in safetensors_index(path).items():
            files.setdefault(path / file, set()).add(name)  # type: ignore[union-attr]
        return files
    return {f: None for f in sorted(path.glob("*.safetensors"))}


def read_hf_config(path: Path) -> ModelSpec:
    """The spec in a Hugging Face model folder's `config.json`."""
    cfg = path / "config.json"
    if not cfg.is_file():
        raise InputError("not a model folder: config.json is missing", path=path)
    return from_hf_config(read_json_object(cfg), source=str(cfg))


def read_hf_dir(path: Path) -> tuple[ModelSpec, StateDict]:
    """A local Hugging Face model folder: `config.json` and its safetensors (`weight_files`: one file, or
    the shards of an index)."""
    spec = read_hf_config(path)
    files = weight_files(path)
    if not files:
        raise InputError("no *.safetensors weight files in the model folder", path=path)
    state: StateDict = {}
    for f, names in files.items():
        state.update(read_safetensors(f, names))
    check_state(spec, state, path)
    return spec, state


def readable_by_umask(path: Path) -> None:
    """safetensors writes its files 0600 (a private temporary file renamed); give them the mode every other
    file gets (0666 less the umask), so a checkpoint's weights are as readable as its config."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


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


# ---------------------------------------------------------------------------------------------
# Training checkpoints: verified against their manifest before anything in them is read

MANIFEST = "manifest.json"
# What a training checkpoint holds beside hf/ (torchtrain.training.checkpoint): a folder with one of these, or an
# `hf/` whose parent has one, is a checkpoint's, never a plain Hugging Face folder.
CHECKPOINT_FILES = ("trainer.json", "ds")
MANIFEST_ERRORS = (OSError, ValueError, KeyError, TypeError)
_NOTED: set[str] = set()


def read_manifest(folder: Path) -> dict[str, Any]:
    """`folder`'s manifest.json: a mapping with a `files` mapping, else one of `MANIFEST_ERRORS`."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError("not a manifest with a files mapping")
    return manifest


def verify(folder: Path) -> str | None:
    """None if `folder` matches its manifest exactly (same files, same sha256); else what is wrong.
    Each file is hashed once per process while its bytes stay the same (`file_digest`), so a checkpoint
    checked by a verb and again by the readers it calls is read once."""
    folder = Path(folder)
    try:
        files = read_manifest(folder)["files"]
    except MANIFEST_ERRORS as e:
        return f"no readable manifest ({type(e).__name__})"
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST}
    missing = sorted(set(files) - present)
    if missing:
        return f"missing file {missing[0]}"
    extra = sorted(present - set(files))
    if extra:
        return f"unexpected file {extra[0]}"
    for rel, digest in files.items():
        if file_digest(folder / rel) != digest:
            return f"checksum mismatch in {rel}"
    return None


def model_folder(path: str | Path) -> Path:
    """The Hugging Face folder to read for a model named by the folder `path`, checked first.

    A training checkpoint (`path` holds manifest.json, or is the `hf/` of a folder that does) must verify
    against its manifest and have `hf/`; its `hf/` is returned. A folder without a manifest is returned as
    it is only where it is plainly not a checkpoint's: config.json, no trainer.json, ds/ or hf/ in it, nor
    trainer.json or ds/ beside it when it is named hf (`load_weights` notes that it read such a folder
    unverified). Anything else is a one-line InputError naming the folder and the problem."""
    return _model_folder(Path(path))[0]


def _model_folder(path: Path) -> tuple[Path, bool]:
    """`model_folder`'s folder, and whether it was verified against a manifest."""
    where = Path(os.path.abspath(path))
    if (where / MANIFEST).is_file():
        checkpoint, hf = where, path / "hf"
    elif where.name == "hf" and (where.parent / MANIFEST).is_file():
        checkpoint, hf = where.parent, path
    else:
        checkpoint = hf = None
    if checkpoint is not None:
        problem = verify(checkpoint)
        if problem:
            raise InputError(f"checkpoint {checkpoint.name} does not verify: {problem}", path=checkpoint)
        if not (hf / "config.json").is_file():
            raise InputError(f"checkpoint {checkpoint.name} has no hf/ weights", path=checkpoint)
        return hf, True
    beside = [where] + ([where.parent] if where.name == "hf" else [])
    if (where / "hf").is_dir() or any((p / f).exists() for p in beside for f in CHECKPOINT_FILES):
        raise InputError("a training checkpoint without its manifest.json, so it cannot be verified (a published "
                         "checkpoint always has one: this one is unfinished or damaged)", path=path)
    if not (where / "config.json").is_file():
        raise InputError("neither a Hugging Face model folder (no config.json) nor a training checkpoint "
                         "(no hf/, no manifest.json)", path=path)
    return path, False


def _note_unverified(path: Path) -> None:
    """One line on stderr, once per folder and process: a folder without a manifest was read as it is."""
    key = os.path.abspath(path)
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"note: {path}: a Hugging Face model folder without manifest.json, read as it is (not verified)",
              file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Entry points


def _locate(name: str) -> tuple[str, str | Path]:
    """("random", preset) | ("gguf", path) | ("checkpoint", its verified hf/) | ("dir", path: a folder
    without a manifest) for a model named as in docs/DESIGN.md §6 (`model_folder`)."""
    name = resolve_model_name(name)
    if name.startswith("random:"):
        return "random", name.split(":", 1)[1]
    path = Path(name)
    if not path.exists():
        raise InputError("no such model file or folder", path=path)
    if path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir():
        folder, verified = _model_folder(path)
        return ("checkpoint" if verified else "dir"), folder
    raise InputError("a model is a Hugging Face folder, a .gguf file or random:<preset>", path=path)


def load_spec(name: str) -> ModelSpec:
    """The spec of a model named as in docs/DESIGN.md §6, without reading the weights."""
    kind, where = _locate(name)
    if kind == "random":
        return random_preset(str(where))
    return gguf_spec(Path(where)) if kind == "gguf" else read_hf_config(Path(where))


def load_weights(name: str, *, seed: int = 0) -> tuple[ModelSpec, StateDict]:
    """`(spec, float32 state dict)` for a model named as in docs/DESIGN.md §6 (`seed` is for random presets)."""
    kind, where = _locate(name)
    if kind == "random":
        spec = random_preset(str(where))
        return spec, random_state(spec, seed)
    if kind == "gguf":
        return read_gguf(Path(where))
    spec, state = read_hf_dir(Path(where))
    if kind == "dir":
        _note_unverified(Path(where))
    return spec, state


# ---------------------------------------------------------------------------------------------
# Identity: what a result computed from a model was computed from

_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, hashed once per (path, size, modification time, status-change time, inode)
    in a process: a rewrite within the process changes the status-change time, which no one can set back."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(p)
    return _DIGESTS[key]


def model_identity(name: str | Path) -> list[list[Any]]:
    """What a model named as in docs/DESIGN.md §6 is, for a cache key: the content of the file or folder it
    resolves to (`default` and `smollm2` resolve to the cached GGUF), as [relative name, size, sha256] per
    file, so that a model whose bytes changed (whatever its name, size or modification time) keys anew;
    [["random", preset]] for a random preset, whose weights the seed makes. A name that resolves to nothing
    is an InputError."""
    resolved = resolve_model_name(str(name))
    if resolved.startswith("random:"):
        return [["random", resolved.split(":", 1)[1]]]
    p = Path(resolved)
    if p.is_file():
        return [[p.name, p.stat().st_size, file_digest(p)]]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        return [[f.relative_to(p).as_posix(), f.stat().st_size, file_digest(f)] for f in files]
    raise InputError("no such model file or folder", path=p)
