"""Hugging Face folders of trained weights, as transformers' `save_pretrained` writes them: config.json,
the weights as safetensors (`model.safetensors`, or shards `model-00001-of-0000N.safetensors` ... with
`model.safetensors.index.json` past `max_shard_size`) and the tokenizer.

    export_hf(spec, state, "RUN/checkpoints/step-8/hf", tokenizer_of="default")

The folder loads in transformers (`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer`) and as
`--model` everywhere in this toolkit (anchor_core.weights, anchor_core.tokenizer).

The weights are split as transformers splits them (huggingface_hub's `split_state_dict_into_shards_factory`:
tensors in order, a new shard where the next one would pass `max_shard_size`, a tensor larger than that alone
in its own) and written by `ShardWriter` as they come: the split is planned from the shapes alone, each
shard's header first, then each tensor's bytes as it arrives, so a writer holds one tensor at a time, never a
shard or the model (the trainer gathers one layer at a time under ZeRO-3: torchtrain.training.checkpoint).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from anchor_core.errors import InputError
from anchor_core.paths import resolve_model_name
from anchor_core.spec import ModelSpec, to_hf_config
from anchor_core.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_OFFSET, BYTE_UNK, bytes_to_unicode, gguf_tokenizer_cached
from anchor_core.weights import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, StateDict

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# transformers' own default: `PreTrainedModel.save_pretrained(max_shard_size="50GB")` in transformers 5.23, the
# version this project installs (transformers 4.x said "5GB"; huggingface_hub's splitter alone, 5GB).
DEFAULT_MAX_SHARD_SIZE = "50GB"
# The dtype of an export: "auto" is the training dtype (float32 or bfloat16), or either on request.
EXPORT_DTYPES = ("auto", "float32", "bfloat16")
_SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}


def shard_size_bytes(size: int | str, *, option: str = "max_shard_size") -> int:
    """A shard size in transformers' notation as bytes, read as transformers' `convert_file_size_to_int` reads
    it: an integer is bytes; "5GiB"/"500MiB"/"64KiB" are powers of 2, "5GB"/"500MB"/"64KB" powers of 10 and,
    with a lower-case final b ("5Gb"), bits (an eighth). Anything else, or a size under one byte, is an
    InputError naming `option`."""
    value: int | None = None
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        text = size.upper()
        units = (("GIB", 2**30, False), ("MIB", 2**20, False), ("KIB", 2**10, False),
                 ("GB", 10**9, True), ("MB", 10**6, True), ("KB", 10**3, True))
        for unit, scale, bits in units:
            if text.endswith(unit):
                try:
                    value = int(size[: -len(unit)]) * scale
                except ValueError:
                    break
                if bits and size.endswith("b"):
                    value //= 8
                break
    if value is None:
        raise InputError(f"{option}: expected a size such as \"5GB\", \"500MB\" or \"2GiB\" (transformers' "
                         f"notation) or a number of bytes, got {size!r}")
    if value < 1:
        raise InputError(f"{option}: a shard holds at least one byte, got {size!r}")
    return value


def resolve_export_dtype(export_dtype: str, train_dtype: str, *, option: str = "export_dtype") -> str:
    """"float32" or "bfloat16": `export_dtype` itself, or the training dtype for "auto"; anything else is an
    InputError naming `option`."""
    if export_dtype not in EXPORT_DTYPES:
        raise InputError(f"{option}: expected one of {', '.join(EXPORT_DTYPES)}, got {export_dtype!r}")
    dtype = train_dtype if export_dtype == "auto" else export_dtype
    if dtype not in ("float32", "bfloat16"):
        raise InputError(f"{option}: the training dtype {dtype!r} is neither float32 nor bfloat16")
    return dtype


# ---------------------------------------------------------------------------------------------
# Shards


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of an export: its Hugging Face name, shape and safetensors dtype ("F32", "BF16", ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _ITEMSIZE[self.dtype]


def plan_shards(tensors: Sequence[TensorInfo], max_shard_size: int | str) -> list[tuple[str, list[TensorInfo]]]:
    """The files of an export and the tensors in each, in order, as transformers splits them: one file
    `model.safetensors` when all fit in `max_shard_size`, else `model-0000i-of-0000N.safetensors`."""
    limit = shard_size_bytes(max_shard_size)
    shards: list[list[TensorInfo]] = []
    current: list[TensorInfo] = []
    size = 0
    for t in tensors:
        if t.nbytes > limit:  # alone in a shard of its own, the current one going on after it
            shards.append([t])
            continue
        if size + t.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    if len(shards) == 1:
        return [(SAFE_WEIGHTS_NAME, shards[0])]
    n = len(shards)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", shard) for i, shard in enumerate(shards)]


def safetensors_dtype(array: np.ndarray) -> str:
    """The safetensors dtype of a numpy array (bfloat16: ml_dtypes')."""
    name = array.dtype.name
    if name not in _SAFETENSORS_DTYPE:
        raise TypeError(f"no safetensors dtype for numpy {array.dtype}")
    return _SAFETENSORS_DTYPE[name]


def _header(tensors: list[TensorInfo]) -> bytes:
    """A safetensors header: the tensors' dtypes, shapes and offsets in this order, `format: pt` as
    transformers writes, padded with spaces so the data starts 8-byte aligned (as the safetensors library
    pads)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class ShardWriter:
    """Writes an export's safetensors files into `folder` as the tensors come, in `tensors`' order.

    The split (`plan_shards`) is fixed from the shapes before any data: a file is opened with its header when
    its first tensor arrives, each tensor's bytes are appended as it is `add`ed, and a file is closed when its
    last tensor is in (a tensor larger than the shard size has a file of its own, written while the shard
    before it stays open). `close` checks every tensor came and writes `model.safetensors.index.json`
    (metadata total_size and total_parameters, weight_map) when there are several files; it returns the
    files written."""

    def __init__(self, folder: Path, tensors: Sequence[TensorInfo], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
        self.folder = Path(folder)
        self.tensors = list(tensors)
        self.plan = plan_shards(self.tensors, max_shard_size)
        self._file_of = {t.name: file for file, shard in self.plan for t in shard}
        self._left = {file: len(shard) for file, shard in self.plan}
        self._next = 0
        self._open: dict[str, IO[bytes]] = {}
        self.folder.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, array: np.ndarray) -> None:
        """Append tensor `name` (the next in order; its shape and dtype as planned) to its file."""
        if self._next >= len(self.tensors):
            raise AssertionError(f"{name}: every planned tensor has been written")
        want = self.tensors[self._next]
        got = TensorInfo(name, tuple(int(s) for s in array.shape), safetensors_dtype(array))
        if got != want:
            raise AssertionError(f"expected {want} next, got {got}")
        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = open(self.folder / file, "wb")
            self._open[file].write(_header(dict(self.plan)[file]))
        data = np.ascontiguousarray(array).reshape(-1)
        if data.dtype.byteorder == ">":
            data = data.byteswap().view(data.dtype.newbyteorder("<"))
        self._open[file].write(data.view(np.uint8).data)
        self._next += 1
        self._left[file] -= 1
        if not self._left[file]:
            self._open.pop(file).close()

    def close(self) -> list[str]:
        if self._next != len(self.tensors):
            self.abort()
            raise AssertionError(f"{self.tensors[self._next].name} and {len(self.tensors) - self._next - 1} "
                                 "more planned tensors were never written")
        files = [file for file, _ in self.plan]
        if len(files) > 1:
            index = {"metadata": {"total_parameters": sum(t.nbytes // _ITEMSIZE[t.dtype] for t in self.tensors),
                                  "total_size": sum(t.nbytes for t in self.tensors)},
                     "weight_map": {t.name: self._file_of[t.name] for t in self.tensors}}
            (self.folder / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n",
                                                               encoding="utf-8")
            files.append(SAFE_WEIGHTS_INDEX_NAME)
        return files

    def abort(self) -> None:
        """Close the files a failure left open (the folder is a staging one, discarded whole)."""
        while self._open:
            self._open.popitem()[1].close()


def write_weights(state: Mapping[str, np.ndarray], folder: Path, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                  dtype: str = "float32") -> list[str]:
    """`state` (numpy, Hugging Face names, in the model's order) as safetensors in `dtype` ("float32" or
    "bfloat16"), split by `max_shard_size`. Returns the files written."""
    if dtype == "bfloat16":
        import ml_dtypes

        kind: Any = ml_dtypes.bfloat16
    elif dtype == "float32":
        kind = np.float32
    else:
        raise InputError(f"export dtype: expected float32 or bfloat16, got {dtype!r}")
    infos = [TensorInfo(k, tuple(int(s) for s in v.shape), _SAFETENSORS_DTYPE[np.dtype(kind).name])
             for k, v in state.items()]
    writer = ShardWriter(folder, infos, max_shard_size)
    try:
        for name, value in state.items():
            writer.add(name, np.asarray(value).astype(kind, copy=False))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


# ---------------------------------------------------------------------------------------------
# Tokenizer


def byte_tokenizer_json(spec: ModelSpec) -> str:
    """The `random:<preset>` byte tokenizer (0 unk, 1 bos, 2 eos, 3 + byte) as a `tokenizers` BPE
    without merges over the byte-level alphabet: every byte is one token, as anchor_core.tokenizer.ByteTok."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": BYTE_UNK, "<s>": BYTE_BOS, "</s>": BYTE_EOS}
    vocab.update({ch: BYTE_OFFSET + b for b, ch in bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok.to_str()


def _tokenizer_config(tokenizer_json: str, bos_id: int | None, eos_id: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None if bos_id is None else tok.id_to_token(bos_id),
        "eos_token": tok.id_to_token(eos_id),
        "pad_token": tok.id_to_token(eos_id),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def write_tokenizer(model: str, spec: ModelSpec, folder: Path) -> None:
    """The tokenizer of the model named `model` (docs/DESIGN.md §6) into a Hugging Face folder."""
    name = resolve_model_name(model)
    folder = Path(folder)
    if name.startswith("random:"):
        text, bos, eos = byte_tokenizer_json(spec), spec.bos_token_id, spec.eos_token_id
    elif name.endswith(".gguf"):
        text, meta = gguf_tokenizer_cached(Path(name))
        bos, eos = meta["bos_id"], meta["eos_id"]
    else:
        for f in _HF_TOKENIZER_FILES:
            if (Path(name) / f).is_file():
                shutil.copyfile(Path(name) / f, folder / f)
        return
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(text, bos, eos), indent=1),
                                                  encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# A whole folder from numpy weights


def export_hf(spec: ModelSpec, state: StateDict, folder: str | Path, *, tokenizer_of: str,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, dtype: str = "float32") -> Path:
    """Write `state` (numpy, Hugging Face names, in the model's order) in `dtype` ("float32" or "bfloat16"),
    split by `max_shard_size`, with `spec`'s config and the tokenizer of the model `tokenizer_of` into
    `folder`. Returns the folder. (A training checkpoint's hf/ is written by torchtrain.training.checkpoint from the
    model itself, its config from the model's own.)"""
    folder = write_model(spec, state, folder, max_shard_size=max_shard_size, dtype=dtype)
    write_tokenizer(tokenizer_of, spec, folder)
    return folder


def write_model(spec: ModelSpec, state: StateDict, folder: str | Path, *,
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, dtype: str = "float32") -> Path:
    """`spec`'s config.json and `state` (numpy, Hugging Face names) as safetensors in `folder`, without a
    tokenizer: a model folder `from_pretrained` and `--model` read. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_weights(state, folder, max_shard_size=max_shard_size, dtype=dtype)
    (folder / "config.json").write_text(json.dumps({**to_hf_config(spec), "dtype": dtype}, indent=2))
    return folder

