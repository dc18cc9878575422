"""Offload and DeepSpeed's own keys (docs/verbs/train.md, "Offload and further DeepSpeed keys").

- `parallel.offload_optimizer` at ZeRO-3 on 2 gloo processes (the optimizer states in host memory, stepped by
  DeepSpeed's CPU Adam) gives each step's loss of the same run without offload, within the fp32 rule.
- The `deepspeed:` section: a key the trainer sets is refused naming the config key that sets it, an unknown key
  by DeepSpeed's own validation; each one line, exit 2, nothing written. A valid key lands in RUN/deepspeed.json.
- The offload keys need their ZeRO stage; a machine that cannot build CPU Adam refuses the run in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from anchor_core.errors import InputError, UnavailableError
from tests.cli.helpers import assert_usage_error, run_cli
from tests.train.conftest import TINY, metrics, run_train
from torchtrain.config import load_train_config
from torchtrain.config.deepspeed_json import SET_BY, SIZED_BY_MODEL, generated
from torchtrain.config.deepspeed_json import deepspeed_config
from torchtrain.training.optim import load_cpu_adam

STEPS = 4
ZERO3_X2 = (f"schedule.steps={STEPS}", "schedule.warmup_steps=0", "data.global_batch=4", "data.micro_batch=1",
            "eval.window=0", "checkpoint.save_every=0", "parallel.nproc=2", "parallel.zero_stage=3",
            "deepspeed.zero_optimization.stage3_prefetch_bucket_size=1e7")  # a key passed through, in both runs
# The fp32 rule for a step's loss under another order of the same fp32 arithmetic: tests/train/test_zero.py holds
# these tiny runs split over 2 processes to 1e-6 of one process. CPU Adam steps AdamW in another order than
# torch's (fused SIMD loops); measured here: 2e-8 at most over the 4 steps, where running the plain run's 4 windows
# 2 per forward instead of 1 (a summation order alone) moves the losses by up to 6e-8.
RTOL = 1e-6


@pytest.mark.slow  # CPU Adam compiled on a fresh machine (minutes; make test-all builds it ahead)
def test_optimizer_offload_gives_the_losses_of_the_run_without(packed, tmp_path):
    """ZeRO-3 on 2 processes, with and without `parallel.offload_optimizer` and nothing else different: each
    step's loss within the fp32 rule. Both record the passed-through DeepSpeed key, only one the offload. Skipped
    where CPU Adam cannot be built (no C++ compiler: the refusal is tested below)."""
    try:
        load_cpu_adam()  # built once into TORCH_EXTENSIONS_DIR (`make test-all` builds it ahead)
    except UnavailableError as e:
        pytest.skip(str(e))
    runs = {name: tmp_path / name for name in ("plain", "offload")}
    run_train(runs["plain"], *ZERO3_X2, f"data.path={packed}")
    run_train(runs["offload"], *ZERO3_X2, "parallel.offload_optimizer=true", f"data.path={packed}")
    plain, offload = (np.array([r["loss"] for r in metrics(runs[n])]) for n in ("plain", "offload"))
    rel = np.abs(offload - plain) / np.abs(plain)
    print(f"plain   {plain.round(8)}\noffload {offload.round(8)}\nrel difference {rel} (rule {RTOL})")
    recorded = {n: json.loads((run / "deepspeed.json").read_text())["zero_optimization"] for n, run in runs.items()}
    print(recorded)
    assert all(z["stage3_prefetch_bucket_size"] == 10_000_000 for z in recorded.values())
    assert recorded["offload"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert "offload_optimizer" not in recorded["plain"]
    groups = {n: _saved_optimizer_groups(run) for n, run in runs.items()}
    print(groups)
    assert all("bias_correction" in g and "foreach" not in g for g in groups["offload"])  # DeepSpeed's CPU Adam
    assert all("foreach" in g for g in groups["plain"])  # torch's AdamW
    assert [g["weight_decay"] for g in groups["offload"]] == [g["weight_decay"] for g in groups["plain"]] == [0.1, 0.0]
    assert [g["betas"] for g in groups["offload"]] == [g["betas"] for g in groups["plain"]]
    assert len(plain) == len(offload) == STEPS
    assert rel.max() <= RTOL


def _saved_optimizer_groups(run) -> list[dict]:
    """The parameter groups of the optimizer ZeRO stepped, as rank 0's checkpoint of the last step saved them
    (their keys tell DeepSpeed's CPU Adam from torch's AdamW), without the parameters."""
    import torch

    path = run / "checkpoints" / f"step-{STEPS}" / "ds" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    saved = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]
    return [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]


@pytest.mark.parametrize("override,needles", [
    ("deepspeed.train_batch_size=4", ["deepspeed.train_batch_size: set by data.global_batch"]),
    ("deepspeed.zero_optimization.stage=1", ["deepspeed.zero_optimization.stage: set by parallel.zero_stage"]),
    ("deepspeed.zero_optimization.no_such_key=1",
     ["deepspeed.zero_optimization.no_such_key: refused by DeepSpeed", "unknown key"]),
    ("deepspeed.zero_optimisation={stage: 2}", ["deepspeed.zero_optimisation: not a key DeepSpeed"]),
    ("parallel.offload_params=true", ["parallel.offload_params needs parallel.zero_stage 3"]),
    ("parallel.offload_optimizer=true", ["parallel.offload_optimizer needs parallel.zero_stage 1 to 3"]),
], ids=["owned", "owned-nested", "unknown", "unknown-top", "params-not-zero3", "optimizer-at-zero0"])
def test_refused_in_one_line_before_anything_is_written(tmp_path, capsys, override, needles):
    """tiny.yaml runs at ZeRO-0 (parallel.offload_params at ZeRO-2 below): each refusal one line naming the keys and
    the override, exit 2, no run folder."""
    stage = ["parallel.zero_stage=2"] if override.startswith("parallel.offload_params") else []
    code, _, err = run_cli(["train", "--config", TINY, "--out", tmp_path / "run", "--no-progress", *stage, override],
                           capsys)
    line = assert_usage_error(code, err, "train", f"command-line override {override}", *needles)
    if override.startswith("parallel."):
        assert "parallel.zero_stage" in line  # both keys named, with where each came from
    assert list(tmp_path.iterdir()) == []


def test_cpu_adam_that_cannot_be_built_is_one_line(tmp_path, capsys, monkeypatch):
    """No compiler (CXX=/bin/false), nothing built yet: the run is refused in one line, exit 2, before any work."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})  # as a fresh process: nothing loaded yet
    code, _, err = run_cli(["train", "--config", TINY, "--out", tmp_path / "run", "--no-progress",
                            "parallel.zero_stage=1", "parallel.offload_optimizer=true"], capsys)
    assert_usage_error(code, err, "train", "parallel.offload_optimizer needs DeepSpeed's CPU Adam, which cannot be "
                       "built here", "parallel.offload_optimizer: false")
    assert not (tmp_path / "run").exists()


def test_the_trainer_keys_are_all_owned_and_the_rest_deep_merges():
    """Every key `generated` sets (every option on) is in SET_BY or sized from the model (SIZED_BY_MODEL, which a
    `deepspeed:` value overrides); the section deep-merges below them (a further offload key beside the trainer's
    `device`), exponent numbers as numbers; config.yaml's copy round-trips."""
    cfg = load_train_config(TINY, ["parallel.zero_stage=3", "parallel.offload_optimizer=true",
                                   "parallel.offload_params=true", "model.dtype=bfloat16",
                                   "deepspeed.zero_optimization.offload_param.buffer_count=8",
                                   "deepspeed.zero_optimization.stage3_max_live_parameters=5e8",
                                   "deepspeed.zero_optimization.reduce_bucket_size=123457",
                                   "deepspeed.communication_data_type=fp32"])

    def leaves(d, prefix=""):
        for k, v in d.items():
            yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]

    unowned = [k for k in leaves(generated(cfg, 2)) if not any(k == o or k.startswith(o + ".") for o in SET_BY)]
    assert sorted(unowned) == sorted(k for k in SIZED_BY_MODEL if "allgather" not in k)  # ZeRO-3's
    hidden = 84  # random:llama, the tiny config's model
    assert generated(cfg, 2)["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)
    ds = deepspeed_config(cfg, 2)
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False, "buffer_count": 8}
    assert ds["zero_optimization"]["stage3_max_live_parameters"] == 500_000_000
    assert ds["zero_optimization"]["reduce_bucket_size"] == 123457  # the user's value over the model's size
    assert ds["communication_data_type"] == "fp32" and ds["bf16"] == {"enabled": True}
    assert ds["train_batch_size"] == 4 and ds["gradient_accumulation_steps"] == 1
    assert cfg.to_dict()["deepspeed"] == {"zero_optimization": {"offload_param": {"buffer_count": 8},
                                                                "stage3_max_live_parameters": 500_000_000,
                                                                "reduce_bucket_size": 123457},
                                          "communication_data_type": "fp32"}
    assert load_train_config(None, [f"{s}={json.dumps(v)}" for s, v in cfg.to_dict().items()]) == cfg


@pytest.mark.parametrize("override,message", [
    ("deepspeed.zero_optimization.cpu_offload=true",
     "deepspeed.zero_optimization.cpu_offload: set by parallel.offload_optimizer"),  # an alias of offload_optimizer
    ("deepspeed.zero_optimization=1",
     "deepspeed.zero_optimization.stage (given as deepspeed.zero_optimization): set by parallel.zero_stage"),
    ("deepspeed.bf16={enabled: true}", "deepspeed.bf16: set by model.dtype"),
    ("deepspeed.zero_optimization.offload_param.device=nvme", "set by parallel.offload_params"),
    ("deepspeed.zero_optimization.stage3_prefetch_bucket_size=abc",
     "deepspeed.zero_optimization.stage3_prefetch_bucket_size: refused by DeepSpeed"),
    ("deepspeed.comms_logger={enabled: true, colour: 1}", "deepspeed.comms_logger.colour: refused by DeepSpeed"),
    ("deepspeed.zero_optimization.offload_param.buffer_count=8",
     "deepspeed.zero_optimization.offload_param needs parallel.offload_params: true"),
])
def test_deepspeed_section_errors_name_the_key(override, message):
    with pytest.raises(InputError) as e:
        load_train_config(TINY, [override])
    print(e.value)
    assert str(e.value).startswith(f"command-line override {override}: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_file_names_the_line_of_the_refused_key(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text(TINY.read_text() + "deepspeed:\n  zero_optimization:\n    no_such_key: 1\n")
    with pytest.raises(InputError) as e:
        load_train_config(path)
    line = len(TINY.read_text().splitlines()) + 3
    assert str(e.value).startswith(f"{path}:{line}: deepspeed.zero_optimization.no_such_key: refused by DeepSpeed")


def test_a_run_from_before_the_offload_keys_resumes_as_without_offload(tmp_path):
    """A run folder whose config.yaml predates the new keys was started with what their defaults do: it resumes
    with them off (a missing key compared as its default) and is refused with optimizer offload on."""
    from torchtrain.training.resume import check_resume_config
    saved = load_train_config(TINY, ["parallel.zero_stage=1"]).to_dict()
    for key in ("offload_optimizer", "offload_params"):
        del saved["parallel"][key]
    del saved["deepspeed"]
    check_resume_config(load_train_config(TINY, ["parallel.zero_stage=1"]), saved, tmp_path)
    with pytest.raises(InputError, match="parallel.offload_optimizer is True but the run was started with False"):
        check_resume_config(load_train_config(TINY, ["parallel.zero_stage=1", "parallel.offload_optimizer=true"]),
                             saved, tmp_path)


def test_offload_with_accumulation_needs_every_gradient_in_one_bucket():
    """ZeRO-3 with the optimizer offloaded and micro-steps accumulating: DeepSpeed's offload path is right only where
    one reduce bucket holds every gradient (torchtrain.config.deepspeed_json.check_offload_buckets, measured), so a
    model larger than the bucket is refused in one line naming the two ways out; the bucket sizes are DeepSpeed's
    own there, the model's where nothing accumulates."""
    from anchor_core.errors import InputError
    from torchtrain.config.deepspeed_json import check_offload_buckets

    base = ["parallel.zero_stage=3", "parallel.offload_optimizer=true", "parallel.nproc=2", "data.micro_batch=1"]
    accumulating = load_train_config(TINY, [*base, "data.global_batch=4"])  # 2 micro-steps per rank
    assert accumulating.grad_accum(2) == 2
    check_offload_buckets(accumulating, 2, 214_200)  # random:llama: one 5e8 bucket holds it
    assert "reduce_bucket_size" not in generated(accumulating, 2)["zero_optimization"]  # DeepSpeed's own
    small = load_train_config(TINY, [*base, "data.global_batch=4", "deepspeed.zero_optimization.reduce_bucket_size=1000"])
    with pytest.raises(InputError) as e:
        check_offload_buckets(small, 2, 214_200)
    line = str(e.value)
    assert "\n" not in line and "214,200 parameters > reduce_bucket_size 1,000" in line
    assert "deepspeed.zero_optimization.reduce_bucket_size" in line and "data.micro_batch" in line
    with pytest.raises(InputError):
        check_offload_buckets(accumulating, 2, 600_000_000)  # past DeepSpeed's 5e8 default
    single = load_train_config(TINY, [*base, "data.global_batch=2", "deepspeed.zero_optimization.reduce_bucket_size=1000"])
    check_offload_buckets(single, 2, 214_200)  # nothing accumulates: any bucket serves
    assert generated(load_train_config(TINY, [*base, "data.global_batch=2"]), 2)["zero_optimization"][
        "reduce_bucket_size"] == 84 * 84
