"""Loading the oracle's params: any model name of docs/DESIGN.md §6, and orbax save/restore."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from anchor_core.errors import InputError
from anchor_core.spec import ModelSpec, RopeSpec
from anchor_core.weights import load_weights
from jaxref.reference import Params, params_from_state


def load_model(name: str, *, seed: int = 0) -> tuple[Params, ModelSpec]:
    """`(params, config)` for a local Hugging Face folder, a `.gguf` file, "default" or `random:<preset>`."""
    spec, state = load_weights(name, seed=seed)
    return params_from_state(spec, state), spec


def save_params(params: Params, config: ModelSpec, path: str | Path) -> Path:
    """Save params with orbax-checkpoint (atomic: orbax writes to a temporary folder, then renames)."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", params)
    spec = config.__dict__ | {"rope": config.rope.__dict__}
    tmp = path / "spec.json.tmp"
    tmp.write_text(json.dumps(spec, indent=2))
    tmp.rename(path / "spec.json")
    return path


def restore_params(path: str | Path) -> tuple[Params, ModelSpec]:
    """Restore what `save_params` wrote; a missing or corrupt checkpoint is an InputError."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    try:
        raw = json.loads((path / "spec.json").read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"not an oracle checkpoint (spec.json: {e})", path=path) from None
    spec = ModelSpec(**(raw | {"rope": RopeSpec(**raw["rope"])}))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(path / "params")
    except Exception as e:  # orbax raises a variety of errors on a damaged checkpoint
        raise InputError(f"cannot restore the oracle checkpoint: {type(e).__name__}: {e}", path=path) from None
    return jax.tree_util.tree_map(np.asarray, params), spec
