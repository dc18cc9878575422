"""A length schedule (`schedule.stages`, torchtrain.training.stages): two stages of different lengths train in one command,
each on windows packed for its length, with its RoPE base and learning rate; `kill -9` inside the second stage and
the same command resume it bit for bit, from a checkpoint inside the stage and from one that ends the first;
`anchor plan` names the stage that needs the most memory; bad stages are refused in one line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from anchor_core.data.packed import PackedData
from anchor_core.errors import InputError
from tests.train.conftest import (DETERMINISTIC, ROOT, final_weights, heldout_reference, kill_after, metrics,
                                  run_train, train_args)
from torchtrain.config import load_train_config

STAGES = ROOT / "configs" / "train" / "tiny_stages.yaml"
# odd lengths (RoPE bugs hide near position 0), the second stage with its own RoPE base and peak lr
ODD = ("schedule.steps=10", "schedule.stages=[{steps: 5, seq_len: 97}, {steps: 5, seq_len: 193, rope_theta: 5.0e+4, "
       "lr: 5.0e-4}]", "checkpoint.save_every=5", "eval.every=3", "eval.window=6", "checkpoint.keep_last=0",
       "logging.report_to=[]")


def _expected_lr(step: int, *, peak: float, warmup: int, steps: int, min_ratio: float) -> float:
    """Optimizer step `step`'s (from 1) learning rate under a cosine schedule, written out here."""
    s = step - 1
    if s < warmup:
        return peak * (s + 1) / warmup
    t = min(1.0, (s - warmup) / max(1, steps - warmup - 1))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _rope(run: Path, step: int) -> tuple[float, int]:
    config = json.loads((run / "checkpoints" / f"step-{step}" / "hf" / "config.json").read_text())
    return config["rope_parameters"]["rope_theta"], config["max_position_embeddings"]


def test_the_shipped_two_stage_config_trains_in_one_command(tmp_path):
    out = tmp_path / "run"
    p = run_train(out, "checkpoint.keep_last=0", "logging.report_to=[]", config=STAGES)
    cfg = load_train_config(STAGES)
    first, second = cfg.schedule.stages
    rows = metrics(out)
    print([(r["step"], r["stage"], r["seq_len"], r["lr"], r.get("heldout_loss")) for r in rows])
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [(r["stage"], r["seq_len"]) for r in rows] == [(1, 512)] * 6 + [(2, 1024)] * 6
    # each stage's windows packed for its length, from the one corpus
    for stage in (first, second):
        assert PackedData.open(out / f"data-{stage.seq_len}").seq_len == stage.seq_len
    assert not (out / "data").exists()
    # the learning rate: the schedule's shape over the whole run times each stage's peak
    for r in rows:
        peak = cfg.optim.lr if r["stage"] == 1 else second.lr
        assert r["lr"] == pytest.approx(_expected_lr(r["step"], peak=peak, warmup=2, steps=12, min_ratio=0.1),
                                        rel=1e-12)
    # the RoPE each checkpoint was trained with, in its hf/ config: the model's in stage 1, the stage's in stage 2
    assert [_rope(out, s) for s in (3, 6, 9, 12)] == [(1e4, 4096)] * 2 + [(second.rope_theta, 4096)] * 2
    # the held-out loss of each stage's windows, by slot range, at every eval.every
    held = [r for r in rows if "heldout_loss" in r]
    assert [r["step"] for r in held] == [3, 6, 9, 12]
    assert all(len(r["heldout_loss_by_position"]) == cfg.eval.heldout_buckets for r in held)
    assert "stage 2 of 2 (steps 7-12): 1024 slots, RoPE base 100000, lr 0.0005" in p.stderr
    # stage 2 ran with its RoPE: its held-out loss is what the step's exported weights give through transformers
    # (hf/config.json's RoPE base, the anchor_sdpa engine) on the held-out windows of RUN/data-1024
    for r in held:
        hf, data = out / "checkpoints" / f"step-{r['step']}" / "hf", out / f"data-{r['seq_len']}"
        reference, _, _ = heldout_reference(hf, data, cfg.eval.heldout_windows, np.array([0, r["seq_len"]]))
        print(f"step {r['step']}: logged {r['heldout_loss']:.8f}, transformers {reference:.8f}")
        assert abs(r["heldout_loss"] - reference) <= 1e-6 * reference


def _same_run(a: Path, b: Path) -> None:
    ma, mb = metrics(a), metrics(b)
    print("uninterrupted:", [round(r["loss"], 6) for r in ma])
    print("resumed:      ", [round(r["loss"], 6) for r in mb])
    assert [r["step"] for r in mb] == list(range(1, 11))
    keys = (*DETERMINISTIC, "stage", "seq_len")
    for ra, rb in zip(ma, mb):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
        assert ra.get("heldout_loss_by_position") == rb.get("heldout_loss_by_position")
    wa, wb = final_weights(a, 10), final_weights(b, 10)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert np.array_equal(wa[name], wb[name]), name


@pytest.mark.slow
def test_kill9_in_the_second_stage_resumes_bit_for_bit(tmp_path):
    """Checkpoints at 5 (the end of stage 1), 7 (inside stage 2: eval.every 3 over the last 6) and 10. Killed in
    stage 2 after step 7's checkpoint and resumed from it; the same kill with step 7's checkpoint gone (a kill
    before it was written) resumes from step 5, and stage 2 starts at its first window."""
    ref = tmp_path / "ref"
    run_train(ref, *ODD, config=STAGES)
    out = tmp_path / "killed"
    seen = kill_after(train_args(out, *ODD, config=STAGES), out, 8)
    steps = sorted(int(q.name.split("-")[1]) for q in (out / "checkpoints").glob("step-*"))
    print(f"killed after {seen} logged steps; checkpoints {steps}")
    assert 7 in steps and 10 not in steps
    boundary = tmp_path / "boundary"
    shutil.copytree(out, boundary)
    shutil.rmtree(boundary / "checkpoints" / "step-7")

    p = run_train(out, *ODD, config=STAGES)
    assert "stage 2 of 2 (steps 6-10): 193 slots, RoPE base 50000, lr 0.0005 (resumed)" in p.stderr, p.stderr[-800:]
    _same_run(ref, out)
    p = run_train(boundary, *ODD, config=STAGES)
    assert "stage 2 of 2 (steps 6-10): 193 slots, RoPE base 50000, lr 0.0005\n" in p.stderr, p.stderr[-800:]
    _same_run(ref, boundary)


@pytest.mark.parametrize("rope", [{"base": 5e5}, {"kind": "yarn", "factor": 4.0, "original_max_position": 1024}])
def test_set_rope_makes_the_model_built_with_that_rope(rope):
    """A model built with one RoPE and switched to another (a stage's) computes exactly what one built with the
    other does, at odd positions away from 0."""
    from torchtrain.model import build_model, set_rope

    want = build_model("random:llama", rope=rope, seed=3)
    got = build_model("random:llama", seed=3)
    buffers = dict(got.named_buffers())
    for name, value in set_rope(got, want.anchor_spec).items():
        buffers[name].data = value
    assert got.anchor_spec == want.anchor_spec
    ids = torch.randint(0, want.anchor_spec.vocab_size, (1, 97), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(97)[None] + 515
    with torch.no_grad():
        a = want(input_ids=ids, position_ids=positions).logits
        b = got(input_ids=ids, position_ids=positions).logits
        before = build_model("random:llama", seed=3)(input_ids=ids, position_ids=positions).logits
    assert torch.equal(a, b)
    assert not torch.equal(a, before)  # the RoPE changed what the model computes


def test_anchor_plan_names_the_stage_that_needs_the_most_memory(capsys):
    from tests.cli.helpers import run_cli

    stages = "schedule.stages=[{steps: 6, seq_len: 4097}, {steps: 3, seq_len: 16385}, {steps: 3, seq_len: 1025}]"
    code, out, _ = run_cli(["plan", "--config", STAGES, "--start", "1024", "--json", stages], capsys)
    assert code == 0
    plan = json.loads(out)
    print(plan["stages"])
    assert [s["seq_len"] for s in plan["stages"]] == [4097, 16385, 1025]
    assert plan["largest_stage"] == 2
    assert max(plan["stages"], key=lambda s: s["total_bytes"])["stage"] == 2
    code, out, _ = run_cli(["plan", "--config", STAGES, "--start", "1024", stages], capsys)
    assert code == 0 and "stage 2 needs the most memory" in out, out


@pytest.mark.parametrize("overrides, words", [
    (["schedule.steps=11"], "the steps of schedule.stages sum to 12, schedule.steps is 11"),
    (["data.seq_len=512"], "data.seq_len 512 with schedule.stages: each stage gives its own seq_len"),
    (["schedule.stages=[{steps: 12, seq_len: 1}]"], "schedule.stages[1].seq_len: expected an integer >= 2"),
    (["schedule.stages=[{steps: 12, seq_len: 64, theta: 5}]"], "unknown key 'schedule.stages[1].theta'"),
    (["eval.heldout_data=/somewhere"], "eval.heldout_data holds windows of one length"),
])
def test_bad_stages_are_one_line(overrides, words):
    with pytest.raises(InputError) as e:
        load_train_config(STAGES, overrides)
    print(e.value)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_stage_too_long_for_the_model_is_refused_naming_the_stage(tmp_path):
    """random:llama has 4096 positions: a stage past them without a RoPE base of its own is refused before any
    packing, naming the stage; and a packed folder of one length is refused as a staged run's data."""
    out = tmp_path / "run"
    stages = "schedule.stages=[{steps: 6, seq_len: 512}, {steps: 6, seq_len: 5001}]"
    p = run_train(out, stages, config=STAGES, check=False)
    print(p.stderr)
    assert p.returncode == 2
    assert "schedule.stages[2] (5001 slots): data.seq_len 5001 is beyond the model's 4096 positions" in p.stderr
    assert not out.exists()


def test_the_stage_whose_step_does_not_fit_is_refused_before_any_packing(tmp_path, monkeypatch):
    """With memory for one step at 512 slots but not at 1024, the run is refused naming stage 2, before the run
    folder is made."""
    from torchtrain.attention import engines
    from torchtrain.training.memory import step_memory, step_of
    from torchtrain.training.fit import model_spec
    from torchtrain.training.stages import run_stages
    from torchtrain.training.trainer import train

    cfg = load_train_config(STAGES, ["model.engine=varlen"])
    needs = [step_memory(model_spec(s.cfg), seq_len=s.seq_len, **step_of(s.cfg, engine="varlen", dtype=torch.float32,
                                                                          procs=1, world=1, on_gpu=False)).total
             for s in run_stages(cfg)]
    print("one step's estimate per stage:", needs)
    assert needs[0] < needs[1]
    monkeypatch.setattr(engines, "available_memory", lambda device="cpu": (needs[0] + needs[1]) // 2)
    with pytest.raises(InputError) as e:
        train(cfg, tmp_path / "run", progress=False)
    print(e.value)
    assert "schedule.stages[2] (1024 slots): data.seq_len=1024 (data.micro_batch=2) needs about" in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("resume_nproc", [2, 1])
def test_two_processes_zero2_killed_in_stage_two_resume_to_1e6(tmp_path, resume_nproc):
    """The whole job (launcher and both ranks) killed in stage 2, then rerun on the same 2 processes, or on 1 (the
    checkpoint converted to DeepSpeed's universal format): the stage's loader position and RoPE hold, and the losses
    and final weights equal the uninterrupted run's within the fp32 rule of a multi-process resume (1e-6)."""
    args = (*ODD, "parallel.zero_stage=2", "data.micro_batch=1")
    ref = tmp_path / "ref"
    run_train(ref, *args, "parallel.nproc=2", config=STAGES)
    out = tmp_path / "killed"
    kill_after(train_args(out, *args, "parallel.nproc=2", config=STAGES), out, 8, job=True)
    print("checkpoints after the kill:", sorted(q.name for q in (out / "checkpoints").glob("step-*")))
    p = run_train(out, *args, f"parallel.nproc={resume_nproc}", config=STAGES)
    assert "(resumed)" in p.stderr
    ma, mb = metrics(ref), metrics(out)
    assert [(r["step"], r["stage"], r["seq_len"]) for r in mb] == [(r["step"], r["stage"], r["seq_len"]) for r in ma]
    la, lb = np.array([r["loss"] for r in ma]), np.array([r["loss"] for r in mb])
    print("uninterrupted:", la.round(7), "\nresumed:      ", lb.round(7))
    assert np.abs(la - lb).max() / np.abs(la).max() <= 1e-6
    wa, wb = final_weights(ref, 10), final_weights(out, 10)
    worst = max(float(np.abs(wa[n] - wb[n]).max() / (np.abs(wa[n]).max() + 1e-30)) for n in wa)
    print("final weights max rel diff", worst)
    assert worst <= 1e-6
