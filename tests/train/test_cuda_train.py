"""The trainer on a CUDA device (skipped without one): a bf16 ZeRO-1 run through NCCL trains,
checkpoints, and a run resumed from its checkpoint continues exactly as an uninterrupted run.
Catches host tensors reaching NCCL collectives (the counted-target all-reduce, say) and batches left on
the host.

Both engines resume exactly: varlen's row gathers (index_select, and repeat_interleave for GQA) would add
in their backward with CUDA atomics in no fixed order (the anchor's row is gathered once per document),
so they have a fixed-order backward (varlen_sdpa._GatherRows); an H100's log: results/gpu/cuda_tests_h100.log."""

from __future__ import annotations

import pytest
import torch

from tests.train.conftest import DETERMINISTIC, metrics, run_train

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# schedule constant: the 2-step run's updates are the 4-step run's first two
ARGS = ("schedule.steps=4", "checkpoint.save_every=2", "model.dtype=bfloat16", "parallel.zero_stage=1",
        "checkpoint.keep_last=2", "schedule.kind=constant")


@pytest.mark.parametrize("engine", ["sdpa", "varlen"])
def test_bf16_run_on_cuda_resumes_exactly(packed, tmp_path, engine):
    run_train(tmp_path / "ref", *ARGS, f"data.path={packed}", f"model.engine={engine}")
    short = tmp_path / "short"
    run_train(short, *ARGS[1:], "schedule.steps=2", f"data.path={packed}", f"model.engine={engine}")
    run_train(short, *ARGS, f"data.path={packed}", f"model.engine={engine}")
    a, b = metrics(tmp_path / "ref"), metrics(short)
    print("losses:", [r["loss"] for r in a], [r["loss"] for r in b])
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in DETERMINISTIC} == {k: rb[k] for k in DETERMINISTIC}
    # the allocator's peaks on the device (torchtrain.training.metrics.peak_memory), not the process's resident set
    assert all(0 < r["peak_memory_gib"] <= r["peak_reserved_gib"] < 80 for r in a)
