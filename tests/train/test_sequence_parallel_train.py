"""Training with Ulysses sequence parallelism (SP=2, 2 gloo processes, fp32) gives the losses of one
process for 5 steps, for every variant and with domain tags and interleaved chunks; also with
activation checkpointing (its recompute runs the all-to-all again on every rank in step)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import metrics, pack_for, run_train

STEPS = 5
COMMON = (f"schedule.steps={STEPS}", "data.global_batch=4", "eval.window=0", "checkpoint.save_every=0",
          "optim.grad_clip=1.0")
CASES = [  # (variant, layout, extra overrides)
    # each case trains `anchor train` on 2 processes (half a minute on 2 cores): make test-all; make test holds the
    # sequence-parallel model against one process in tests/torchtrain/test_sequence_parallel.py
    pytest.param("anchor", "plain", (), marks=pytest.mark.slow),
    pytest.param("full", "plain", (), marks=pytest.mark.slow),
    pytest.param("intra_doc", "plain", (), marks=pytest.mark.slow),
    pytest.param("intra_doc_reset", "plain", (), marks=pytest.mark.slow),
    pytest.param("anchor", "tags", (), marks=pytest.mark.slow),
    pytest.param("anchor", "interleave", (), marks=pytest.mark.slow),
    pytest.param("intra_doc_reset", "interleave", ("model.activation_checkpointing=true",), marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def layouts(packed, corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("sp-data")
    return {"plain": packed, "tags": pack_for(corpus, root / "tags", tags=True),
            "interleave": pack_for(corpus, root / "interleave", interleave=True)}


@pytest.mark.parametrize("variant,layout,extra", CASES)
def test_sp2_training_equals_one_process(layouts, tmp_path, variant, layout, extra):
    data = layouts[layout]
    flags = [f"data.path={data}", f"model.variant={variant}", f"data.tags={layout == 'tags'}".lower(),
             f"data.interleave={layout == 'interleave'}".lower(), *extra]
    one, two = tmp_path / "one", tmp_path / "sp2"
    run_train(one, *COMMON, *flags, "data.micro_batch=4", "parallel.nproc=1")
    run_train(two, *COMMON, *flags, "data.micro_batch=1", "parallel.nproc=2", "parallel.sequence_parallel=2")
    a, b = metrics(one), metrics(two)
    la, lb = np.array([r["loss"] for r in a]), np.array([r["loss"] for r in b])
    rel = np.abs(la - lb) / np.abs(la)
    print(f"{variant}/{layout}{extra}: one process {la.round(7)}\n  SP=2 {lb.round(7)}\n  max rel {rel.max():.2e}")
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    # Not bitwise: SP=2 runs 4 micro-batches of one window (accumulated) where one process runs one
    # batch of four, and its linear layers see 64-row instead of 4x128-row matmuls (other blocking).
    assert rel.max() <= 1e-6


@pytest.mark.slow
def test_dp2_x_sp2_under_torchrun_equals_one_process(layouts, tmp_path):
    """Four ranks (2 data-parallel x 2 sequence-parallel) started by torchrun running the same
    `anchor train` command: the launcher's world replaces nproc, ZeRO-2 reduces over all four."""
    import shutil
    import subprocess
    import sys

    from tests.train.conftest import ENV, TINY

    flags = (*COMMON, f"data.path={layouts['plain']}", "model.variant=anchor")
    one = tmp_path / "one"
    run_train(one, *flags, "data.micro_batch=4", "parallel.nproc=1")
    four = tmp_path / "four"
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    cmd = [torchrun, "--nproc_per_node", "4", "-m", "anchor", "train", "--config", str(TINY), "--out", str(four),
           "--no-progress", *flags, "data.micro_batch=1", "parallel.sequence_parallel=2", "parallel.zero_stage=2"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    la = np.array([r["loss"] for r in metrics(one)])
    lb = np.array([r["loss"] for r in metrics(four)])
    rel = np.abs(la - lb) / np.abs(la)
    print(f"one process {la.round(7)}\nDP2 x SP2  {lb.round(7)}\nmax rel {rel.max():.2e}")
    assert rel.max() <= 1e-6
