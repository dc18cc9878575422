"""benchmarks/bench_oracle_grad_memory.py: XLA's memory plan of the oracle's gradient program, compiled, not run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.slow  # two gradient programs of SmolLM2 compiled: make test-all
def test_the_plan_holds_the_fp64_gradients_and_grows_with_the_window():
    import jax
    import numpy as np

    import jaxref
    from bench_oracle_grad_memory import plan

    params, spec = jaxref.load_model("random:llama")
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    short, long = plan(params, spec, 33, "fp64"), plan(params, spec, 129, "fp64")
    for r in (short, long):
        # out: the loss and every parameter's gradient in fp64 (8 bytes each); in: the stored fp32 parameters
        assert 8 * n <= r["bytes"]["output"] < 8 * n + 1024 and r["bytes"]["argument"] >= 4 * n
    assert long["bytes"]["temp"] > short["bytes"]["temp"]  # the activations of one layer and its attention map
