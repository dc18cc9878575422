"""Keys a hostile user gave `anchor train` (docs/DESIGN.md §8): each is refused in one line naming the key, exit 2,
before any work (no run folder made; an existing run folder byte for byte as it was), or, where the run itself
goes wrong (a loss that is not finite), stopped in one line with its last good checkpoint kept. Also: a resume
that lengthens `schedule.steps` follows the new schedule from its first step, and `eval.heldout_data` is held to
its place and content across a resume as the training data is."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.cli.helpers import assert_usage_error, run_cli, tree_hash
from tests.train.conftest import TINY, metrics, run_train

ARGS = ("checkpoint.save_every=2", "checkpoint.keep_last=0", "eval.window=0", "logging.report_to=[]")


@pytest.fixture(scope="module")
def trained(packed, tmp_path_factory) -> Path:
    """A tiny run trained 2 steps on the packed corpus (checkpoint at step 2): what the resume refusals leave alone."""
    run = tmp_path_factory.mktemp("hostile") / "run"
    run_train(run, "schedule.steps=2", *ARGS, f"data.path={packed}")
    return run


def _train(out: Path, *overrides: str, capsys) -> tuple[int, str]:
    code, _, err = run_cli(["train", "--config", TINY, "--out", out, "--no-progress", *overrides], capsys)
    return code, err


def _refused_fresh(tmp_path: Path, capsys, *overrides: str, needle: str) -> str:
    out = tmp_path / "run"
    code, err = _train(out, *overrides, capsys=capsys)
    line = assert_usage_error(code, err, "train", needle)
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    return line


def _refused_resume(run: Path, capsys, *overrides: str, needle: str) -> str:
    before = tree_hash(run)
    code, err = _train(run, "schedule.steps=4", *ARGS, *overrides, capsys=capsys)
    line = assert_usage_error(code, err, "train", needle)
    assert tree_hash(run) == before
    return line


# ---------------------------------------------------------------------------------------------
# Keys refused before any work, on a fresh run and on a resume

FRESH = {
    # the trainer sets it itself on a resume with another process count; given, every resume died in DeepSpeed
    "load_universal": (["deepspeed.checkpoint.load_universal=true"], "deepspeed.checkpoint.load_universal"),
    # past what torch.distributed's timeout holds: an OverflowError in init_world, after the run folder existed
    "timeout_1e15": (["parallel.timeout_s=1000000000000000"], "parallel.timeout_s"),
    "timeout_2**63": ([f"parallel.timeout_s={2**63}"], "parallel.timeout_s"),
    # one slot range per bucket: 1e9 buckets were an 8 GB array at the first held-out pass (the kernel's OOM kill)
    "heldout_buckets": (["eval.heldout_buckets=1000000000"], "eval.heldout_buckets"),
    # a number that is not finite in the free-form deepspeed: section (DeepSpeed's validation lets it through):
    # NaN losses and a deepspeed.json that is not JSON
    "nan_deepspeed": (["deepspeed.gradient_predivide_factor=.nan"], "deepspeed.gradient_predivide_factor"),
    "inf_deepspeed": (["deepspeed.gradient_predivide_factor=1e400"], "deepspeed.gradient_predivide_factor"),
}


@pytest.mark.parametrize("case", FRESH)
def test_a_hostile_key_is_refused_in_one_line_and_no_run_folder_is_made(case, packed, tmp_path, capsys):
    overrides, needle = FRESH[case]
    _refused_fresh(tmp_path, capsys, f"data.path={packed}", *overrides, needle=needle)


RESUMED = {
    "timeout_1e30": (["parallel.timeout_s=1000000000000000000000000000000"], "parallel.timeout_s"),
    # data.seq_len left to the packed data: the bucket bound is then checked against the pack's length
    "heldout_buckets": (["eval.heldout_buckets=1000000000", "data.seq_len=null"], "eval.heldout_buckets"),
}


@pytest.mark.parametrize("case", RESUMED)
def test_a_hostile_resumable_key_leaves_the_run_folder_as_it_was(case, trained, packed, capsys):
    overrides, needle = RESUMED[case]
    _refused_resume(trained, capsys, f"data.path={packed}", *overrides, needle=needle)


def test_more_heldout_windows_than_heldout_data_holds_is_refused(packed, tmp_path, capsys):
    from anchor_core.data.packed import PackedData

    n = PackedData.open(packed).num_windows
    line = _refused_fresh(tmp_path, capsys, f"data.path={packed}", f"eval.heldout_data={packed}",
                          f"eval.heldout_windows={n + 1}", needle="eval.heldout_windows")
    assert f"the {n} windows of eval.heldout_data" in line


def test_more_heldout_windows_than_the_data_holds_says_so_without_a_negative_count(packed, tmp_path, capsys):
    from anchor_core.data.packed import PackedData

    n = PackedData.open(packed).num_windows
    line = _refused_fresh(tmp_path, capsys, f"data.path={packed}", "eval.heldout_windows=100000",
                          needle="eval.heldout_windows 100000")
    assert f"the {n} windows of the packed data" in line and "-" not in line.split("error:", 1)[1].split("/")[0]
    assert "windows left" not in line


# ---------------------------------------------------------------------------------------------
# eval.heldout_data: recorded absolute and fingerprinted

def test_heldout_data_is_recorded_absolute_and_held_to_its_content(corpus, packed, tmp_path, capsys, monkeypatch):
    from anchor_core.data.mixture import MixtureSpec
    from anchor_core.data.pipeline import PackConfig, pack_corpus
    from tests import forked
    from tests.train.conftest import ENV, train_args

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    for d in (here, elsewhere):
        shutil.copytree(packed, d / "held")
    run = tmp_path / "run"
    base = (*ARGS, f"data.path={packed}", "eval.heldout_windows=3", "eval.every=2", "eval.heldout_data=held")
    p = forked.run(train_args(run, "schedule.steps=2", *base), ENV, cwd=here)
    assert p.returncode == 0, p.stderr[-3000:]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["eval"]["heldout_data"] == str((here / "held").resolve())
    source = json.loads((run / "data_source.json").read_text())
    assert source["heldout"]["data"] == str((here / "held").resolve()) and source["heldout"]["fingerprint"]

    # the same relative name from another working directory is another folder: refused, not read
    monkeypatch.chdir(elsewhere)
    before = tree_hash(run)
    code, err = _train(run, "schedule.steps=4", *base, capsys=capsys)
    assert_usage_error(code, err, "train", "eval.heldout_data", str((elsewhere / "held").resolve()))
    assert tree_hash(run) == before

    # the folder it names repacked (other windows): refused naming the key, the run folder unchanged
    shutil.rmtree(here / "held")
    pack_corpus("random:llama", corpus, here / "held", PackConfig(seq_len=128, mixture=MixtureSpec(budget=30000)))
    monkeypatch.chdir(here)
    code, err = _train(run, "schedule.steps=4", *base, capsys=capsys)
    assert_usage_error(code, err, "train", "eval.heldout_data", "content changed")
    assert tree_hash(run) == before


# ---------------------------------------------------------------------------------------------
# Non-finite weights and losses

def test_a_users_model_with_a_nan_weight_is_refused_naming_file_and_tensor(tmp_path, capsys):
    from anchor_core.export import export_hf
    from anchor_core.spec import random_preset
    from anchor_core.weights import random_state

    spec = random_preset("llama")
    state = random_state(spec, seed=0)
    tensor = "model.layers.0.mlp.up_proj.weight"
    state[tensor] = state[tensor].copy()
    state[tensor][3, 5] = np.nan
    model = export_hf(spec, state, tmp_path / "model", tokenizer_of="random:llama")
    out = tmp_path / "run"
    code, err = _train(out, f"model.name={model}", "schedule.steps=2", capsys=capsys)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert tensor in errors[0] and "model.safetensors" in errors[0] and "not finite" in errors[0]
    assert not out.exists()


def test_a_loss_or_gradient_that_is_not_finite_stops_the_run_keeping_its_last_good_checkpoint(packed, tmp_path):
    """optim.lr=1e30: the first update makes weights near 1e30, the second step's gradient norm is not finite, and
    an update with it would write NaN into the weights (and into a checkpoint of that step)."""
    from anchor_core.weights import read_safetensors
    from torchtrain.training import checkpoint as ckpt

    run = tmp_path / "run"
    p = run_train(run, "schedule.steps=6", "checkpoint.save_every=1", "checkpoint.keep_last=0", "eval.window=0",
                  "optim.lr=1e30", f"data.path={packed}", check=False)
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    print(p.stderr[-2000:])
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(errors) == 1
    bad = int(errors[0].split("step ", 1)[1].split(":", 1)[0])
    assert errors[0].startswith(f"anchor train: error: step {bad}: the ") and "not a finite number" in errors[0]
    assert f"step-{bad - 1}, is kept" in errors[0]
    assert ckpt.list_steps(run) == list(range(bad - 1, 0, -1))  # none at or after the bad step
    for step in ckpt.list_steps(run):
        weights = read_safetensors(ckpt.step_dir(run, step) / "hf" / "model.safetensors")
        assert all(np.isfinite(w).all() for w in weights.values()), step
    text = (run / "metrics.jsonl").read_text()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for line in
            text.splitlines()]
    assert [r["step"] for r in rows] == list(range(1, bad))
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_a_loss_that_is_not_finite_at_the_first_step_stops_the_run_with_nothing_checkpointed(tmp_path):
    """Finite weights whose logits overflow (an lm-head of 1e38s): the first step's loss is NaN."""
    from anchor_core.export import export_hf
    from anchor_core.spec import random_preset
    from anchor_core.weights import random_state

    spec = random_preset("llama")
    state = random_state(spec, seed=0)
    state["lm_head.weight"] = np.full_like(state["lm_head.weight"], 1e38)
    model = export_hf(spec, state, tmp_path / "model", tokenizer_of="random:llama")
    run = tmp_path / "run"
    p = run_train(run, f"model.name={model}", "schedule.steps=3", "checkpoint.save_every=1", "logging.report_to=[]",
                  check=False)
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    print(p.stderr[-2000:])
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(errors) == 1
    assert errors[0].startswith("anchor train: error: step 1: the training loss is nan, not a finite number")
    assert "no checkpoint was written" in errors[0]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert (run / "metrics.jsonl").read_text() == ""


def test_metrics_never_hold_a_bare_nan(tmp_path):
    from torchtrain.training.metrics import MetricsLog

    log = MetricsLog(tmp_path, 0, True)
    log.write({"step": 1, "loss": 1.0, "grad_norm": float("nan"), "heldout_loss_by_position": [1.0, float("inf")]})
    log.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert row == {"step": 1, "loss": 1.0, "grad_norm": None, "heldout_loss_by_position": [1.0, None]}


# ---------------------------------------------------------------------------------------------
# A longer schedule on resume

@pytest.mark.parametrize("zero", [0, pytest.param(1, marks=pytest.mark.slow)])  # ZeRO-1's optimizer state: make test-all
def test_a_resume_with_more_steps_follows_the_new_schedule_from_its_first_step(zero, packed, tmp_path):
    from torchtrain.config import load_train_config
    from torchtrain.training.optim import lr_factor

    args = ("checkpoint.save_every=4", "checkpoint.keep_last=0", "eval.window=0", "logging.report_to=[]",
            f"parallel.zero_stage={zero}", f"data.path={packed}")
    run, ref = tmp_path / "run", tmp_path / "ref"
    run_train(run, "schedule.steps=4", *args)
    run_train(run, "schedule.steps=8", *args)
    run_train(ref, "schedule.steps=8", *args)
    cfg = load_train_config(TINY, ["schedule.steps=8", *args])
    resumed, whole = metrics(run), metrics(ref)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for r, w in zip(resumed[4:], whole[4:]):
        want = cfg.optim.lr * lr_factor(cfg, r["step"] - 1)
        print(f"step {r['step']}: resumed lr {r['lr']!r}, uninterrupted {w['lr']!r}, schedule {want!r}")
        assert r["lr"] == pytest.approx(want, rel=1e-12) and w["lr"] == pytest.approx(want, rel=1e-12)
