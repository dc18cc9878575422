"""Where jaxref runs: `use_device("cpu")` (its fused CPU kernels, the path the tests hold) or
`use_device("cuda")` (JAX's CUDA backend, for windows whose fp64 gradients hold gigabytes a layer).

Where JAX has not started its backends yet, only the one asked for starts (a JAX_PLATFORMS the user set
stands): on the CPU no GPU client, whose preallocation of 75% of the GPU's memory would leave little to a
torch model beside it, and on CUDA a client that allocates as it goes (XLA_PYTHON_CLIENT_PREALLOCATE=false
unless set). Arrays and programs then go to that device (`jax_default_device`).
"""

from __future__ import annotations

import os

import jax

from anchor_core.errors import InputError

DEVICES = ("cpu", "cuda")


def use_device(name: str, *, option: str = "device") -> str:
    """Run jaxref on `name` ("cpu" or "cuda"). Returns the device in words, e.g. "cpu (cpu)".
    An InputError (one line, naming `option`, the caller's flag) where the name is unknown or JAX has no
    such backend here; the process's JAX platforms are then as they were."""
    if name not in DEVICES:
        raise InputError(f"{option}: expected cpu or cuda, got {name!r}")
    if name == "cuda":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    before = jax.config.jax_platforms
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu" if name == "cpu" else "cuda,cpu")
    try:
        dev = jax.devices("cpu" if name == "cpu" else "gpu")[0]
    except RuntimeError as e:
        jax.config.update("jax_platforms", before)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{option} {name}: JAX has no {name} backend here ({first})") from None
    jax.config.update("jax_default_device", dev)
    return f"{name} ({dev.device_kind})"
