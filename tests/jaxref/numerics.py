"""Comparisons shared by the oracle's tests."""

from __future__ import annotations

import contextlib

import numpy as np


def jitted(fn, *static):
    """`fn(*arrays, *static)` as one compiled program of the arrays (the attention paths' tests run at
    T = 1025: op by op, each of their scans and key-block loops compiled and dispatched piecewise,
    took 3-10 times longer). The static arguments (variant, policy, scale) are closed over."""
    import jax

    return jax.jit(lambda *arrays: fn(*arrays, *static))


def rel(a, b) -> float:
    """Relative L2 error of `a` against the reference `b`, in fp64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@contextlib.contextmanager
def torch_float_is_float64():
    """Run transformers' own code in float64 throughout: it computes RoPE, its RMSNorm statistics and
    its eager softmax in float32 whatever the model dtype (`.float()`, `dtype=torch.float`,
    `torch.float32`, and the default dtype for the dynamic base); inside the block those four spellings
    mean float64, so a model built and run there is transformers' definition evaluated in float64."""
    import pytest
    import torch

    old_default = torch.get_default_dtype()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "float", torch.float64)
        mp.setattr(torch, "float32", torch.float64)
        mp.setattr(torch.Tensor, "float", torch.Tensor.double)
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(old_default)
