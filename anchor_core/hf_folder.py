"""A local Hugging Face model folder read without torch: its `config.json` and its safetensors weights.

A `.safetensors` file is parsed from its JSON header, never unpickled, and the header is checked before any
tensor is read (`safetensors_header`). The files of a folder are chosen as transformers' `from_pretrained`
chooses them (`weight_files`: `model.safetensors`, or the shards of `model.safetensors.index.json`, whose
weight map is checked too), and `read_hf_dir` returns `(spec, state)`: the folder's `ModelSpec` and every
tensor as float32 numpy under Hugging Face's names, checked against the spec's shapes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from anchor_core.errors import InputError, read_json_object
from anchor_core.spec import ModelSpec, from_hf_config
from anchor_core.weight_shapes import StateDict, check_state

# A Hugging Face folder's weights (transformers' names): one file, or shards named by an index.
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16"}


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
