"""What a checkpoint carries beside DeepSpeed's own states, and how it is read back safely.

trainer.json (`read_trainer_state`: its shape checked), every RNG state a rank draws from (`seed_rng`, `rng_state`,
`set_rng_state`: torch on CPU and CUDA, numpy, Python's `random`), and `safe_loads`, inside which DeepSpeed's pickled
files are read through torch's weights_only unpickler with the few DeepSpeed types of `DEEPSPEED_ALLOWLIST` and
nothing else (torchtrain.training.checkpoint's docstring says why).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import pickle
import random
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from anchor_core.errors import InputError

# The types DeepSpeed pickles into its checkpoint files besides tensors and containers (read off the
# files of runs at ZeRO 0-3, float32 and bfloat16: the optimizer states of the bf16 and ZeRO paths).
DEEPSPEED_ALLOWLIST = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


@contextlib.contextmanager
def safe_loads(allowlist: tuple[str, ...] = DEEPSPEED_ALLOWLIST) -> Iterator[None]:
    """Inside, every `torch.load` (DeepSpeed's `load_checkpoint` calls it with weights_only=False) runs
    torch's weights_only unpickler with `allowlist` as its only extra types. A file holding any other
    object raises InputError naming the file and the object; the object is never built."""
    import torch

    allowed = [getattr(importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2])
               for name in allowlist]
    real_load = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            # torch's reader warns of a pickle protocol other than its own (a file torch did not write) before
            # it meets what it refuses: the refusal below is the one line the user gets
            with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                return real_load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            found = re.search(r"(?:Unsupported global: GLOBAL|Unsupported class) ([\w.]+)", str(e))
            what = found.group(1) if found else "an object torch's weights_only reader refuses"
            raise InputError(f"{f}: a pickle naming {what}, not one of the types DeepSpeed writes: refused "
                             "before building it") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = real_load


def read_trainer_state(path: Path) -> dict[str, Any]:
    """trainer.json, its shape checked: a file that is not what `Checkpointer.save` writes (tampered with a
    matching manifest, or from another version) is one InputError naming it."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the trainer state: {e}", path=path) from None
    shape = {"step": int, "loader": dict, "rng": list, "elapsed_s": (int, float)}
    bad = [k for k, t in shape.items() if not isinstance(state, dict) or not isinstance(state.get(k), t)
           or isinstance(state.get(k), bool)]
    if not bad and (not state["rng"] or not all(isinstance(r, dict) for r in state["rng"]) or state["step"] < 0):
        bad = ["rng" if state["step"] >= 0 else "step"]
    if bad:
        raise InputError(f"not a trainer state this run wrote ({', '.join(bad)} missing or malformed)", path=path)
    return state


def seed_rng(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and Python's `random` (a rank passes `seed + rank`)."""
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON-able lists (CUDA's only where torch sees a device)."""
    import torch

    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    import torch

    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
