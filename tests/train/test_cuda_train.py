"""The trainer on a CUDA device (skipped without one): a bf16 ZeRO-1 run through NCCL trains,
checkpoints, and a run resumed from its checkpoint continues exactly as an uninterrupted run.
Catches host tensors reaching NCCL collectives (the counted-target all-reduce did, until the GPU
run of 2026-11-23) and batches left on the host.

Engine sdpa: its CUDA kernels are deterministic, so exact equality holds. The varlen engine (torch's
varlen attention, FlashAttention-2 inside) is not held to it here: on the H100 run its resumed
losses matched the uninterrupted run's at step 1 and departed by ~5e-5 relative from step 2, while
two uninterrupted runs of the tiny config agreed; whether that is FlashAttention-2's atomic dq
accumulation or a resume difference was not settled (see the issue 14 note)."""

from __future__ import annotations

import pytest
import torch

from tests.train.conftest import DETERMINISTIC, metrics, run_train

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# schedule constant: the 2-step run's updates are the 4-step run's first two
ARGS = ("steps=4", "save_every=2", "dtype=bfloat16", "zero_stage=1", "keep_last=2", "schedule=constant", "engine=sdpa")


def test_bf16_run_on_cuda_resumes_exactly(packed, tmp_path):
    run_train(tmp_path / "ref", *ARGS, f"data={packed}")
    short = tmp_path / "short"
    run_train(short, *ARGS[1:], "steps=2", f"data={packed}")
    run_train(short, *ARGS, f"data={packed}")
    a, b = metrics(tmp_path / "ref"), metrics(short)
    print("losses:", [r["loss"] for r in a], [r["loss"] for r in b])
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in DETERMINISTIC} == {k: rb[k] for k in DETERMINISTIC}
