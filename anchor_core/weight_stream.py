"""A model's weights a tensor at a time, for building a model that no one process holds whole.

    stream = stream_weights("path/to/hf-folder")      # or a .gguf file, or random:<preset>
    stream.spec, stream.shapes                        # every tensor's name and shape, in reading order; no data read
    for name, array in stream.tensors():              # float32 numpy, Hugging Face names and layout
        ...
    stream.check_finite()                             # a NaN or infinity anywhere: an InputError naming file and tensor

`anchor_core.weights.load_weights` reads the same tensors into one dict; this reads them one at a time in the
order of `shapes`, which every process knows before any data is read (from the safetensors headers, the GGUF's
tensor table, or a preset's spec), so that processes can step through a model's weights together while one of
them reads. A safetensors tensor is read from its file a chunk at a time into its float32 array, never mapped (the
file's pages stay in the page cache, out of the process's resident memory): the reader holds one tensor at a time,
never a whole shard. The shapes are checked against the spec before any data
is read (`anchor_core.weights.check_shapes`), as `load_weights` checks them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anchor_core.errors import InputError
from anchor_core.spec import ModelSpec, random_preset
from anchor_core.weights import (
    _SAFETENSORS_DTYPES,
    _gguf_reader,
    _locate,
    _note_unverified,
    check_listed,
    check_shapes,
    expected_shapes,
    gguf_shapes,
    gguf_spec,
    gguf_tensors,
    random_tensors,
    read_hf_config,
    safetensors_header,
    weight_files,
)


@dataclass(frozen=True)
class WeightStream:
    """A model's spec and its tensors' names and shapes (in reading order), and a reader of their data."""

    spec: ModelSpec
    shapes: dict[str, tuple[int, ...]]
    source: str
    _read: Callable[[], Iterator[tuple[str, np.ndarray]]]
    files: dict[str, str] = field(default_factory=dict)  # tensor -> the file it is read from (none: generated)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every tensor as float32 numpy, in `shapes` order; a tensor out of that order (a reader's bug) is an
        AssertionError."""
        names = iter(self.shapes)
        for name, array in self._read():
            if name != next(names, None) or tuple(array.shape) != self.shapes[name]:
                raise AssertionError(f"{self.source}: {name} {array.shape} read out of its announced order")
            yield name, array

    def check_finite(self) -> None:
        """Every value of every tensor a finite number (one tensor in memory at a time); else an InputError naming
        the file and the tensor: a NaN or an infinity in the weights makes every loss computed from them NaN."""
        for name, array in self.tensors():
            bad = int(array.size - np.count_nonzero(np.isfinite(array)))
            if bad:
                raise InputError(f"tensor {name} holds {bad} of {array.size} values that are not finite numbers "
                                 "(NaN or infinity); a model trains only from finite weights",
                                 path=self.files.get(name, self.source))


def stream_weights(name: str, *, seed: int = 0) -> WeightStream:
    """The weights of a model named as in docs/DESIGN.md §6 (`seed` for random presets), as `load_weights` would
    read them, a tensor at a time (module docstring)."""
    kind, where = _locate(name)
    if kind == "random":
        spec = random_preset(str(where))
        return WeightStream(spec, expected_shapes(spec), str(name), lambda: random_tensors(spec, seed))
    path = Path(where)
    if kind == "gguf":
        reader = _gguf_reader(path)
        spec = gguf_spec(path, reader)
        shapes = gguf_shapes(path, reader)
        check_shapes(spec, shapes, path)
        return WeightStream(spec, shapes, str(path), lambda: gguf_tensors(path, reader, spec),
                            dict.fromkeys(shapes, str(path)))
    spec = read_hf_config(path)
    files = _safetensors_layout(path)
    shapes = {n: tuple(info["shape"]) for _, header, _, names in files for n, info in header.items() if n in names}
    check_shapes(spec, shapes, path)
    if kind == "dir":
        _note_unverified(path)
    return WeightStream(spec, shapes, str(path), lambda: _safetensors_tensors(files),
                        {n: str(file) for file, header, _, names in files for n in header if n in names})


Layout = list[tuple[Path, dict, int, set[str]]]


def _safetensors_layout(path: Path) -> Layout:
    """Each weight file of a Hugging Face folder (`weight_files`) with its validated header, where its data
    starts and the tensors read from it; a tensor the index puts in a file that does not hold it is an
    InputError (`check_listed`, as `read_safetensors` says it)."""
    files = weight_files(path)
    if not files:
        raise InputError("no *.safetensors weight files in the model folder", path=path)
    layout: Layout = []
    for file, names in files.items():
        header, start = safetensors_header(file)
        check_listed(file, header, names)
        layout.append((file, header, start, set(header) if names is None else set(names)))
    return layout


_READ_CHUNK = 1 << 24  # bytes of a file read at a time into the float32 array (`_read_float32`)


def _safetensors_tensors(layout: Layout) -> Iterator[tuple[str, np.ndarray]]:
    for file, header, start, names in layout:
        for name, info in header.items():
            if name not in names:
                continue
            b, e = info["data_offsets"]
            kind = _SAFETENSORS_DTYPES[info["dtype"]]
            if kind == "bfloat16":
                import ml_dtypes

                kind = ml_dtypes.bfloat16
            yield name, _read_float32(file, start + b, e - b, np.dtype(kind), tuple(info["shape"]))


def _read_float32(file: Path, offset: int, size: int, kind: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """`size` bytes of `file` from `offset`, values of `kind`, as a float32 array of `shape`: read with `readinto` a
    chunk at a time into the array (float32 in the file: straight in), never mapped, so that the file's pages stay
    in the page cache and out of this process's resident set, which holds the array and one chunk."""
    out = np.empty(shape, np.float32)
    flat = out.reshape(-1)
    step = max(1, _READ_CHUNK // kind.itemsize) * kind.itemsize
    with open(file, "rb") as f:
        f.seek(offset)
        if kind == np.float32:
            got = f.readinto(memoryview(flat).cast("B"))
            if got != size:
                raise InputError(f"a tensor's data ends early ({got} of {size} bytes)", path=file)
            return out
        done = 0
        while done < size:
            chunk = f.read(min(step, size - done))
            if not chunk:
                raise InputError(f"a tensor's data ends early ({done} of {size} bytes)", path=file)
            n = len(chunk) // kind.itemsize
            first = done // kind.itemsize
            flat[first:first + n] = np.frombuffer(chunk, dtype=kind, count=n)
            done += len(chunk)
    return out
