"""Weight readers without torch: a local Hugging Face directory, a `.gguf` file, `random:<preset>`.

Every reader returns `(spec, state)`: a `ModelSpec` and a state dict of float32 numpy arrays under
Hugging Face's parameter names (`model.layers.{i}.self_attn.q_proj.weight`, (out, in) layout), so
the oracle and the trainer start from the same numbers. Nothing here unpickles: safetensors is
parsed from its JSON header, GGUF through the `gguf` package.

A folder named as a model goes through `model_folder` before anything in it is read: a training
checkpoint (`RUN/checkpoints/step-<N>`, or its `hf/`) must match its manifest (`verify`, the one check
that resuming, `anchor eval --run` and every `--model` share), and a folder without a manifest is read
only where it is plainly a Hugging Face folder and no checkpoint, with a note that it was not verified.

The readers live beside this module, one per concern: `weight_shapes` (the parameters a spec implies, the
shape check, the random presets), `hf_folder` (safetensors and Hugging Face folders), `gguf_weights` (GGUF
files) and `manifest` (the manifest check and `model_folder`). This module picks the reader for a model's name
(`load_spec`, `load_weights`) and says what a model is for a cache key (`model_identity`); the readers' names
that other code imports from here are imported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anchor_core.errors import InputError
from anchor_core.gguf_weights import (  # noqa: F401 (re-exported)
    _gguf_reader,
    gguf_name,
    gguf_shapes,
    gguf_spec,
    gguf_tensors,
    read_gguf,
)
from anchor_core.hf_folder import (  # noqa: F401 (re-exported)
    _SAFETENSORS_DTYPES,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    check_listed,
    read_hf_config,
    read_hf_dir,
    read_safetensors,
    readable_by_umask,
    safetensors_header,
    safetensors_index,
    weight_files,
)
from anchor_core.manifest import (  # noqa: F401 (re-exported)
    CHECKPOINT_FILES,
    MANIFEST,
    MANIFEST_ERRORS,
    _model_folder,
    _note_unverified,
    file_digest,
    model_folder,
    read_manifest,
    verify,
)
from anchor_core.paths import resolve_model_name
from anchor_core.spec import ModelSpec, random_preset
from anchor_core.weight_shapes import (  # noqa: F401 (re-exported)
    StateDict,
    check_shapes,
    check_state,
    expected_shapes,
    random_state,
    random_tensors,
)


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
