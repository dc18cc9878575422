"""A length schedule (`schedule.phases`, torchtrain.training.phases): two phases of different lengths train in one command,
each on windows packed for its length, with its RoPE base and learning rate; `kill -9` inside the second phase and
the same command resume it bit for bit, from a checkpoint inside the phase and from one that ends the first;
`anchor plan` names the phase that needs the most memory; bad phases are refused in one line. Phases were stages in
an earlier release: that release's config key, shipped config name, loader state and run folder still work."""

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

PHASES = ROOT / "configs" / "train" / "tiny_phases.yaml"
# odd lengths (RoPE bugs hide near position 0), the second phase with its own RoPE base and peak lr
ODD = ("schedule.steps=10", "schedule.phases=[{steps: 5, seq_len: 97}, {steps: 5, seq_len: 193, rope_theta: 5.0e+4, "
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


def test_the_shipped_two_phase_config_trains_in_one_command(tmp_path):
    out = tmp_path / "run"
    p = run_train(out, "checkpoint.keep_last=0", "logging.report_to=[]", config=PHASES)
    cfg = load_train_config(PHASES)
    first, second = cfg.schedule.phases
    rows = metrics(out)
    print([(r["step"], r["phase"], r["seq_len"], r["lr"], r.get("heldout_loss")) for r in rows])
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [(r["phase"], r["seq_len"]) for r in rows] == [(1, 512)] * 6 + [(2, 1024)] * 6
    # each phase's windows packed for its length, from the one corpus
    for phase in (first, second):
        assert PackedData.open(out / f"data-{phase.seq_len}").seq_len == phase.seq_len
    assert not (out / "data").exists()
    # the learning rate: the schedule's shape over the whole run times each phase's peak
    for r in rows:
        peak = cfg.optim.lr if r["phase"] == 1 else second.lr
        assert r["lr"] == pytest.approx(_expected_lr(r["step"], peak=peak, warmup=2, steps=12, min_ratio=0.1),
                                        rel=1e-12)
    # the RoPE each checkpoint was trained with, in its hf/ config: the model's in phase 1, the phase's in phase 2
    assert [_rope(out, s) for s in (3, 6, 9, 12)] == [(1e4, 4096)] * 2 + [(second.rope_theta, 4096)] * 2
    # the held-out loss of each phase's windows, by slot range, at every eval.every
    held = [r for r in rows if "heldout_loss" in r]
    assert [r["step"] for r in held] == [3, 6, 9, 12]
    assert all(len(r["heldout_loss_by_position"]) == cfg.eval.heldout_buckets for r in held)
    assert "phase 2 of 2 (steps 7-12): 1024 slots, RoPE base 100000, lr 0.0005" in p.stderr
    # phase 2 ran with its RoPE: its held-out loss is what the step's exported weights give through transformers
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
    keys = (*DETERMINISTIC, "phase", "seq_len")
    for ra, rb in zip(ma, mb):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
        assert ra.get("heldout_loss_by_position") == rb.get("heldout_loss_by_position")
    wa, wb = final_weights(a, 10), final_weights(b, 10)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert np.array_equal(wa[name], wb[name]), name


@pytest.mark.slow
def test_kill9_in_the_second_phase_resumes_bit_for_bit(tmp_path):
    """Checkpoints at 5 (the end of phase 1), 7 (inside phase 2: eval.every 3 over the last 6) and 10. Killed in
    phase 2 after step 7's checkpoint and resumed from it; the same kill with step 7's checkpoint gone (a kill
    before it was written) resumes from step 5, and phase 2 starts at its first window."""
    ref = tmp_path / "ref"
    run_train(ref, *ODD, config=PHASES)
    out = tmp_path / "killed"
    seen = kill_after(train_args(out, *ODD, config=PHASES), out, 8)
    steps = sorted(int(q.name.split("-")[1]) for q in (out / "checkpoints").glob("step-*"))
    print(f"killed after {seen} logged steps; checkpoints {steps}")
    assert 7 in steps and 10 not in steps
    boundary = tmp_path / "boundary"
    shutil.copytree(out, boundary)
    shutil.rmtree(boundary / "checkpoints" / "step-7")

    p = run_train(out, *ODD, config=PHASES)
    assert "phase 2 of 2 (steps 6-10): 193 slots, RoPE base 50000, lr 0.0005 (resumed)" in p.stderr, p.stderr[-800:]
    _same_run(ref, out)
    p = run_train(boundary, *ODD, config=PHASES)
    assert "phase 2 of 2 (steps 6-10): 193 slots, RoPE base 50000, lr 0.0005\n" in p.stderr, p.stderr[-800:]
    _same_run(ref, boundary)


@pytest.mark.parametrize("rope", [{"base": 5e5}, {"kind": "yarn", "factor": 4.0, "original_max_position": 1024}])
def test_set_rope_makes_the_model_built_with_that_rope(rope):
    """A model built with one RoPE and switched to another (a phase's) computes exactly what one built with the
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


def test_anchor_plan_names_the_phase_that_needs_the_most_memory(capsys):
    from tests.cli.helpers import run_cli

    phases = "schedule.phases=[{steps: 6, seq_len: 4097}, {steps: 3, seq_len: 16385}, {steps: 3, seq_len: 1025}]"
    code, out, _ = run_cli(["plan", "--config", PHASES, "--start", "1024", "--json", phases], capsys)
    assert code == 0
    plan = json.loads(out)
    print(plan["phases"])
    assert [s["seq_len"] for s in plan["phases"]] == [4097, 16385, 1025]
    assert plan["largest_phase"] == 2
    assert max(plan["phases"], key=lambda s: s["total_bytes"])["phase"] == 2
    code, out, _ = run_cli(["plan", "--config", PHASES, "--start", "1024", phases], capsys)
    assert code == 0 and "phase 2 needs the most memory" in out, out


@pytest.mark.parametrize("overrides, words", [
    (["schedule.steps=11"], "the steps of schedule.phases sum to 12, schedule.steps is 11"),
    (["data.seq_len=512"], "data.seq_len 512 with schedule.phases: each phase gives its own seq_len"),
    (["schedule.phases=[{steps: 12, seq_len: 1}]"], "schedule.phases[1].seq_len: expected an integer >= 2"),
    (["schedule.phases=[{steps: 12, seq_len: 64, theta: 5}]"], "unknown key 'schedule.phases[1].theta'"),
    (["eval.heldout_data=/somewhere"], "eval.heldout_data holds windows of one length"),
])
def test_bad_phases_are_one_line(overrides, words):
    with pytest.raises(InputError) as e:
        load_train_config(PHASES, overrides)
    print(e.value)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_phase_too_long_for_the_model_is_refused_naming_the_phase(tmp_path):
    """random:llama has 4096 positions: a phase past them without a RoPE base of its own is refused before any
    packing, naming the phase; and a packed folder of one length is refused as a phased run's data."""
    out = tmp_path / "run"
    phases = "schedule.phases=[{steps: 6, seq_len: 512}, {steps: 6, seq_len: 5001}]"
    p = run_train(out, phases, config=PHASES, check=False)
    print(p.stderr)
    assert p.returncode == 2
    assert "schedule.phases[2] (5001 slots): data.seq_len 5001 is beyond the model's 4096 positions" in p.stderr
    assert not out.exists()


def test_the_phase_whose_step_does_not_fit_is_refused_before_any_packing(tmp_path, monkeypatch):
    """With memory for one step at 512 slots but not at 1024, the run is refused naming phase 2, before the run
    folder is made."""
    from torchtrain.attention import engines
    from torchtrain.training.memory import step_memory, step_of
    from torchtrain.training.fit import model_spec
    from torchtrain.training.phases import run_phases
    from torchtrain.training.trainer import train

    cfg = load_train_config(PHASES, ["model.engine=varlen"])
    needs = [step_memory(model_spec(s.cfg), seq_len=s.seq_len, **step_of(s.cfg, engine="varlen", dtype=torch.float32,
                                                                          procs=1, world=1, on_gpu=False)).total
             for s in run_phases(cfg)]
    print("one step's estimate per phase:", needs)
    assert needs[0] < needs[1]
    monkeypatch.setattr(engines, "available_memory", lambda device="cpu": (needs[0] + needs[1]) // 2)
    with pytest.raises(InputError) as e:
        train(cfg, tmp_path / "run", progress=False)
    print(e.value)
    assert "schedule.phases[2] (1024 slots): data.seq_len=1024 (data.micro_batch=2) needs about" in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("resume_nproc", [2, 1])
def test_two_processes_zero2_killed_in_phase_two_resume_to_1e6(tmp_path, resume_nproc):
    """The whole job (launcher and both ranks) killed in phase 2, then rerun on the same 2 processes, or on 1 (the
    checkpoint converted to DeepSpeed's universal format): the phase's loader position and RoPE hold, and the losses
    and final weights equal the uninterrupted run's within the fp32 rule of a multi-process resume (1e-6)."""
    args = (*ODD, "parallel.zero_stage=2", "data.micro_batch=1")
    ref = tmp_path / "ref"
    run_train(ref, *args, "parallel.nproc=2", config=PHASES)
    out = tmp_path / "killed"
    kill_after(train_args(out, *args, "parallel.nproc=2", config=PHASES), out, 8, job=True)
    print("checkpoints after the kill:", sorted(q.name for q in (out / "checkpoints").glob("step-*")))
    p = run_train(out, *args, f"parallel.nproc={resume_nproc}", config=PHASES)
    assert "(resumed)" in p.stderr
    ma, mb = metrics(ref), metrics(out)
    assert [(r["step"], r["phase"], r["seq_len"]) for r in mb] == [(r["step"], r["phase"], r["seq_len"]) for r in ma]
    la, lb = np.array([r["loss"] for r in ma]), np.array([r["loss"] for r in mb])
    print("uninterrupted:", la.round(7), "\nresumed:      ", lb.round(7))
    assert np.abs(la - lb).max() / np.abs(la).max() <= 1e-6
    wa, wb = final_weights(ref, 10), final_weights(out, 10)
    worst = max(float(np.abs(wa[n] - wb[n]).max() / (np.abs(wa[n]).max() + 1e-30)) for n in wa)
    print("final weights max rel diff", worst)
    assert worst <= 1e-6


# ---------------------------------------------------------------------------------------------
# Earlier releases called phases stages: their config key, shipped config name, loader state and run folders


def _old_config(tmp_path: Path) -> tuple[Path, int]:
    """tiny_phases.yaml as an earlier release shipped it (`schedule.stages`), and the line of that key."""
    lines = PHASES.read_text().splitlines()
    line = lines.index("  phases:")
    lines[line] = "  stages:"
    path = tmp_path / "tiny_stages.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, line + 1


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "warning:" in line]


def test_the_old_key_is_read_as_the_new_with_one_warning_line(tmp_path, capsys):
    old, line = _old_config(tmp_path)
    assert load_train_config(old) == load_train_config(PHASES)
    (warning,) = _warnings(capsys.readouterr().err)
    assert warning == (f"anchor: warning: {old}:{line}: schedule.stages is the older name of schedule.phases, read as "
                       "schedule.phases for one release: rename the key")
    # an error about the key names the line of the old name
    with pytest.raises(InputError, match=rf"{old}:{line} \(schedule.phases\) and .*schedule.steps=11: the steps of "
                                         "schedule.phases sum to 12"):
        load_train_config(old, ["schedule.steps=11"])
    # as an override too
    cfg = load_train_config("tiny", ["schedule.steps=12", "data.seq_len=null",
                                     "schedule.stages=[{steps: 12, seq_len: 64}]"])
    assert [(p.steps, p.seq_len) for p in cfg.schedule.phases] == [(12, 64)]
    assert len(_warnings(capsys.readouterr().err)) == 2  # the earlier load's, and this one's


def test_the_old_key_on_the_command_line_warns_once_and_both_keys_are_one_error(tmp_path, capsys):
    from tests.cli.helpers import assert_usage_error, run_cli

    old, line = _old_config(tmp_path)
    code, out, err = run_cli(["plan", "--config", old, "--start", "1024", "--json"], capsys)
    assert code == 0 and [p["seq_len"] for p in json.loads(out)["phases"]] == [512, 1024]
    assert [w.split(": ", 1)[0] for w in _warnings(err)] == ["anchor plan"]
    assert f"{old}:{line}: schedule.stages is the older name of schedule.phases" in err
    code, _, err = run_cli(["plan", "--config", old, "schedule.phases=[{steps: 12, seq_len: 64}]"], capsys)
    assert_usage_error(code, err, "plan", f"{old}:{line} (schedule.stages)", "schedule.phases=",
                       "schedule.stages and schedule.phases are both given", "give schedule.phases only")
    with pytest.raises(InputError, match="both given"):  # both in the file
        load_train_config(old, ["schedule.phases=[]"])


def test_the_old_shipped_name_finds_the_new_config_with_one_warning_line(capsys):
    from tests.cli.helpers import run_cli

    code, out, err = run_cli(["plan", "--config", "tiny_stages", "--start", "1024", "--json"], capsys)
    assert code == 0 and [p["seq_len"] for p in json.loads(out)["phases"]] == [512, 1024]
    assert _warnings(err) == ["anchor plan: warning: --config: tiny_stages is the older name of the shipped train "
                              "config tiny_phases, read as tiny_phases for one release: give tiny_phases"]
    from anchor_core.shipped import names

    assert "tiny_stages" not in names("train") and "tiny_phases" in names("train")


class _Loader:
    """A stand-in for anchor_core.data.packed.Loader: a phase's batches, its position as Loader words it."""

    steps_per_epoch = 100

    def __init__(self, phase):
        self.phase, self.epoch, self.step = phase, 0, 0

    def __next__(self):
        self.step += 1
        return self.phase.index

    def state_dict(self):
        return {"epoch": self.epoch, "consumed": 4 * self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = state["epoch"], state["consumed"] // 4


def test_a_loader_state_of_an_earlier_release_resumes_in_its_phase():
    """A checkpoint's loader position names its phase (`phase`); one an earlier release wrote names it `stage`, and
    one from before length schedules names none (the first)."""
    from torchtrain.training.phases import PhasedLoader, run_phases

    phases = run_phases(load_train_config(PHASES))
    loader = PhasedLoader(phases, _Loader)
    assert [next(loader) for _ in range(8)] == [1] * 6 + [2] * 2
    assert loader.state_dict() == {"epoch": 0, "consumed": 8, "phase": 2}
    for state, phase, done in [({"epoch": 0, "consumed": 8, "stage": 2}, 2, 8),
                               ({"epoch": 0, "consumed": 8, "phase": 2}, 2, 8),
                               ({"epoch": 0, "consumed": 12}, 1, 3)]:
        resumed = PhasedLoader(phases, _Loader)
        resumed.load_state_dict(state)
        assert (resumed.phase.index, resumed.done, next(resumed)) == (phase, done, phase)
    with pytest.raises(InputError, match="loader state of phase 3, the run has 2 phase"):
        PhasedLoader(phases, _Loader).load_state_dict({"epoch": 0, "consumed": 0, "stage": 3})


def test_a_run_folder_of_an_earlier_release_resumes_bit_for_bit(tmp_path):
    """A run an earlier release wrote (`schedule.stages` in its config.yaml, `stage` in its metrics.jsonl lines
    and its checkpoints' loader position), stopped after step 7's checkpoint inside phase 2, resumed with its old
    config: phase 2 continues at the same window, and the losses and final weights equal an uninterrupted run's."""
    from torchtrain.training.checkpoint import write_manifest

    ref = tmp_path / "ref"
    run_train(ref, *ODD, config=PHASES)
    run = tmp_path / "old"
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "step-10")
    rows = metrics(run)[:7]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({("stage" if k == "phase" else k): v for k, v in r.items()}) + "\n" for r in rows))
    config = (run / "config.yaml").read_text()
    assert config.count("  phases:") == 1
    (run / "config.yaml").write_text(config.replace("  phases:", "  stages:"))
    for folder in (run / "checkpoints").glob("step-*"):
        state = json.loads((folder / "trainer.json").read_text())
        state["loader"]["stage"] = state["loader"].pop("phase")
        (folder / "trainer.json").write_text(json.dumps(state))
        manifest = json.loads((folder / "manifest.json").read_text())
        write_manifest(folder, manifest["step"], {k: v for k, v in manifest.items() if k not in ("step", "files")})
    old, _ = _old_config(tmp_path)
    p = run_train(run, *(o.replace("schedule.phases=", "schedule.stages=") for o in ODD), config=old)
    print(p.stderr[-1500:])
    assert "phase 2 of 2 (steps 6-10): 193 slots, RoPE base 50000, lr 0.0005 (resumed)" in p.stderr
    assert len(_warnings(p.stderr)) == 1 and "schedule.stages is the older name of schedule.phases" in p.stderr
    ma, mb = metrics(ref), metrics(run)
    assert [r["step"] for r in mb] == list(range(1, 11))
    assert [r.get("phase", r.get("stage")) for r in mb] == [r["phase"] for r in ma]
    for ra, rb in zip(ma, mb):
        assert {k: ra[k] for k in DETERMINISTIC} == {k: rb[k] for k in DETERMINISTIC}
    wa, wb = final_weights(ref, 10), final_weights(run, 10)
    assert all(np.array_equal(wa[n], wb[n]) for n in wa)
    assert "  phases:" in (run / "config.yaml").read_text()  # written again under the new name
