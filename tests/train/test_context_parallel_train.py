"""Training under context parallelism (parallel.context_parallel, torchtrain.parallel.context), float32:
  * the embedded SmolLM2-135M with its real weights (9 query heads: Ulysses cannot split it over 2) at context
    parallel 2 on 2 processes trains 3 steps of a 1024-slot window with one process's losses (1e-6 relative) and gradient norms (1e-5),
    anchor and intra-doc + reset;
  * Ulysses 3 x context parallel 2 on 6 processes (a random model of 6 heads) likewise;
  * a context-parallel run killed with SIGKILL resumes on another degree (2 processes at context parallel 2 ->
    1 process) with the losses of an uninterrupted run on the new one.
Both sides run the sdpa engine, so the comparison isolates the split. `make test-all` runs them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import ROOT, kill_after, metrics, run_train, train_args

pytestmark = pytest.mark.slow
SMOLLM2 = ROOT / "configs" / "train" / "smollm2_2k.yaml"
COMMON = ("eval.window=0", "checkpoint.save_every=0", "logging.report_to=[]", "model.engine=sdpa")


def _compare(one: Path, split: Path, what: str, first: int = 0) -> None:
    a, b = metrics(one)[first:], metrics(split)[first:]
    la, lb = np.array([r["loss"] for r in a]), np.array([r["loss"] for r in b])
    ga, gb = np.array([r["grad_norm"] for r in a]), np.array([r["grad_norm"] for r in b])
    rel, grel = np.abs(la - lb) / np.abs(la), np.abs(ga - gb) / np.abs(ga)
    print(f"{what}: one process {la.round(7)} grad norms {ga.round(6)}\n  split {lb.round(7)} grad norms {gb.round(6)}\n"
          f"  max rel loss {rel.max():.2e}, grad norm {grel.max():.2e}")
    assert [r["step"] for r in a] == [r["step"] for r in b] and [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert rel.max() <= 1e-6 and grel.max() <= 1e-5


@pytest.mark.model
@pytest.mark.parametrize("variant", ["anchor", "intra_doc_reset"])
def test_smollm2_at_context_parallel_2_equals_one_process(tmp_path, variant):
    steps = ("schedule.steps=3", "data.global_batch=1", "data.micro_batch=1", f"model.variant={variant}",
             "data.seq_len=1024")
    one, two = tmp_path / "one", tmp_path / "cp2"
    run_train(one, *COMMON, *steps, config=SMOLLM2)
    run_train(two, *COMMON, *steps, f"data.path={one / 'data'}", "parallel.nproc=2", "parallel.context_parallel=2",
              config=SMOLLM2)
    _compare(one, two, f"SmolLM2-135M {variant}, context parallel 2")


def test_ulysses_3_by_context_parallel_2_on_6_processes_equals_one_process(tmp_path):
    """T = 126: two context-parallel shares of 63 slots, each split over 3 Ulysses ranks of 21."""
    steps = ("schedule.steps=3", "data.global_batch=2", "data.micro_batch=2", "data.seq_len=126",
             "model.variant=intra_doc_reset")
    one, six = tmp_path / "one", tmp_path / "u3c2"
    run_train(one, *COMMON, *steps)
    run_train(six, *COMMON, *steps, f"data.path={one / 'data'}", "parallel.nproc=6", "parallel.sequence_parallel=3",
              "parallel.context_parallel=2")
    _compare(one, six, "random:llama intra_doc_reset, Ulysses 3 x context parallel 2")


def test_a_killed_context_parallel_run_resumes_on_another_degree(packed, tmp_path):
    """Context parallel 2 on 2 processes (ZeRO-1), checkpoints every 2 steps, killed once step 3 is logged; the same
    command on 1 process (degree 1) resumes from step 2 through the universal checkpoint and continues the
    uninterrupted one-process run's losses and gradient norms."""
    common = (*COMMON[:1], "checkpoint.save_every=2", "checkpoint.keep_last=0", "schedule.steps=6",
              "schedule.kind=constant", "data.global_batch=4", "data.micro_batch=1", "parallel.zero_stage=1",
              f"data.path={packed}", *COMMON[2:])
    ref, out = tmp_path / "uninterrupted", tmp_path / "run"
    run_train(ref, *common, "parallel.nproc=1")
    seen = kill_after(train_args(out, *common, "parallel.nproc=2", "parallel.context_parallel=2"), out, 3)
    assert seen >= 3
    run_train(out, *common, "parallel.nproc=1")
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    _compare(ref, out, "context parallel 2 killed at step 3, resumed on 1 process", first=2)


# (name, overrides of both runs, the split run's own): each holds one process's losses and gradient norms
COMPOSED = {
    "zero3": (("parallel.zero_stage=3",), ()),
    "activation_checkpointing_tiled_mlp": (("model.activation_checkpointing=true", "model.tiled_mlp=true"), ()),
    "data_parallel_2_x_context_parallel_2": ((), ("parallel.nproc=4",)),
    "tags_interleaved_anchor": (("data.tags=true", "data.interleave=true", "data.path=corpus"), ()),
    "eager": (("model.engine=eager",), ()),
    "varlen": (("model.engine=varlen",), ()),
}


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_context_parallelism_composes(packed, tmp_path, name):
    """Context parallel 2 with ZeRO-3, activation checkpointing and the tiled MLP, data parallelism beside it, domain
    tags with interleaved chunks, the eager and varlen engines: 3 steps with one process's losses and gradient norms; the
    held-out loss (every 2 steps, by position bucket) is one process's too."""
    both, own = COMPOSED[name]
    data = () if any(o.startswith("data.path=") for o in both) else (f"data.path={packed}",)
    engine = () if any(o.startswith("model.engine=") for o in both) else COMMON[-1:]
    common = (*COMMON[:-1], *engine, "schedule.steps=4", "data.global_batch=4", "data.micro_batch=1", "eval.every=2",
              "eval.heldout_windows=3", *data, *both)
    one, split = tmp_path / "one", tmp_path / "split"
    run_train(one, *common)
    if not data:
        common = tuple(o if not o.startswith("data.path=") else f"data.path={one / 'data'}" for o in common)
    nproc = next((o for o in own if o.startswith("parallel.nproc=")), "parallel.nproc=2")
    run_train(split, *common, nproc, "parallel.context_parallel=2", *(o for o in own if o != nproc))
    _compare(one, split, f"context parallel 2, {name}")
    held = [(a["heldout_loss"], b["heldout_loss"], a["heldout_loss_by_position"], b["heldout_loss_by_position"])
            for a, b in zip(metrics(one), metrics(split)) if "heldout_loss" in a]
    assert len(held) == 2
    for a, b, by_a, by_b in held:
        assert abs(a - b) <= 1e-6 * abs(a)
        np.testing.assert_allclose(by_b, by_a, rtol=1e-6)
