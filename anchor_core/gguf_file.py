"""A GGUF file's metadata and tensors, read in one pass over a memory map.

    f = read_gguf_file(path)
    f.fields["llama.block_count"]            # 30 (Python values: int, float, bool, str, lists of them)
    for t in f.tensors: t.name, t.shape, t.tensor_type, t.data   # data: a read-only view of the file

The same values as the `gguf` package's `GGUFReader` (its `field.contents()`, its `tensor.data`: raw
blocks of a quantized type as uint8 rows, float types as their dtype), which builds a numpy view per
metadata item: 3-4 s for SmolLM2's 98K tokenizer strings on the 2 CPU cores here, against 0.1 s with
`struct` on one buffer. The format (github.com/ggml-org/ggml, docs/gguf.md), little-endian, version 2
and 3: magic "GGUF", uint32 version, uint64 tensor count, uint64 metadata count; each metadata item a
string key (uint64 length + UTF-8), a uint32 type and its value (arrays: uint32 item type, uint64
count, items); each tensor info a string name, uint32 dims, uint64 dims (fastest-varying first), uint32
ggml type, uint64 offset into the data section, which starts at the next multiple of
`general.alignment` (default 32) after the infos.

A file that ends early, or whose counts, types or offsets make no sense, raises ValueError naming what.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF metadata value types: struct format of the scalar ones
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8
# ggml types stored as plain arrays (the rest: blocks, handed over as uint8 rows, as GGUFReader does)
_PLAIN = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
_MAX_COUNT = 1 << 40


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # numpy order (reversed shape); quantized types: uint8 blocks, last dim in bytes


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"the file ends at byte {len(self.buf)}, inside the metadata")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file ({len(self.buf)} bytes)")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("<I"), self.take("<Q")
            if count > _MAX_COUNT:
                raise ValueError(f"an array of {count} items")
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[itype])
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise ValueError(f"an array of {count} items runs past the end of the file")
                out = np.frombuffer(self.buf, dt, count, self.pos).tolist()
                self.pos = end
                return out
            if itype not in (_STRING, _ARRAY):
                raise ValueError(f"unknown metadata value type {itype}")
            return [self.value(itype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Parse `path` (see the module docstring). Raises ValueError on a truncated or malformed file, OSError
    when it cannot be opened."""
    import gguf

    path = Path(path)
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        if size < 24:
            raise ValueError(f"{size} bytes: too short for a GGUF header")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    buf = memoryview(mm)
    c = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic at the start of the file")
    c.pos = 4
    version = c.take("<I")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in (2, 3):
            raise ValueError("a big-endian GGUF file (only little-endian ones are read)")
        raise ValueError(f"GGUF version {version} (versions 2 and 3 are read)")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
        raise ValueError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata items")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = c.value(c.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("<I")
        if n_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name}: {n_dims} dimensions")
        dims = tuple(c.take("<Q") for _ in range(n_dims))
        infos.append((name, dims, c.take("<I"), c.take("<Q")))
    align = int(fields.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align} is not a power of two")
    start = -(-c.pos // align) * align
    tensors = []
    if len({i[0] for i in infos}) != len(infos):
        raise ValueError("two tensors have the same name")
    for name, dims, ttype, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name}: unknown ggml type {ttype}") from None
        n = int(np.prod(dims, dtype=np.int64)) if dims else 1
        np_shape = tuple(int(d) for d in reversed(dims)) or (1,)
        if qtype.name in _PLAIN:
            dt, count, shape = np.dtype(_PLAIN[qtype.name]), n, np_shape
        else:
            if not dims or dims[0] % block:
                raise ValueError(f"tensor {name}: a row of {dims[0] if dims else 0} is not whole blocks of {block}")
            dt = np.dtype(np.uint8)
            count = n // block * type_size
            shape = (*np_shape[:-1], np_shape[-1] // block * type_size)
        at = start + offset
        if at + count * dt.itemsize > size:
            raise ValueError(f"tensor {name} ({count * dt.itemsize} bytes at {at}) runs past the end of the "
                             f"file ({size} bytes)")
        tensors.append(GGUFTensor(name, dims, qtype, np.frombuffer(buf, dt, count, at).reshape(shape)))
    return GGUFFile(path, version, fields, tensors)


__all__ = ["GGUFFile", "GGUFTensor", "read_gguf_file"]
