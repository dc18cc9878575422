"""Learning-rate schedules, the paper's evaluation schedule, pruning, AdamW groups, manifests."""

from __future__ import annotations

import math

import pytest

from tests.train.conftest import TINY
from torchtrain.training import checkpoint as ckpt
from torchtrain.config import load_train_config, with_changes
from torchtrain.training.optim import lr_factor, param_groups


def test_lr_schedules():
    cfg = load_train_config(TINY, ["schedule.steps=11", "schedule.warmup_steps=3", "schedule.min_lr_ratio=0.1"])
    warm = [lr_factor(cfg, s) for s in range(3)]
    assert warm == [1 / 3, 2 / 3, 1.0]
    for schedule in ("constant", "cosine", "linear"):
        c = with_changes(cfg, {"schedule.kind": schedule})
        f = [lr_factor(c, s) for s in range(3, 11)]
        print(schedule, [round(x, 4) for x in f])
        assert f[0] == 1.0
        assert f[-1] == (1.0 if schedule == "constant" else pytest.approx(0.1))
        assert all(a >= b for a, b in zip(f, f[1:]))
    mid = lr_factor(with_changes(cfg, {"schedule.kind": "cosine"}), 3 + 7 // 2 + 0)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))


def _fake_checkpoint(run, step: int) -> None:
    """A published checkpoint's layout (ds/, hf/, trainer.json) with a manifest over it."""
    folder = ckpt.step_dir(run, step)
    for rel, size in (("ds/state/mp_rank_00_model_states.pt", 3000), ("hf/model.safetensors", 1000),
                      ("hf/config.json", 20), ("trainer.json", 10)):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(bytes([step % 251]) * size + rel.encode())
    ckpt.write_manifest(folder, step, {"config": "config.yaml"})


def test_paper_evaluation_schedule_and_pruning(tmp_path):
    cfg = load_train_config(TINY, ["schedule.steps=2000", "eval.every=10", "eval.window=50", "checkpoint.save_every=100"])
    evals = [s for s in range(1, 2001) if cfg.is_eval_step(s)]
    assert evals == [1960, 1970, 1980, 1990, 2000]  # the last five, every 10 steps
    saves = [s for s in range(1, 2001) if cfg.is_checkpoint_step(s)]
    assert saves[:2] == [100, 200] and saves[-5:] == evals
    whole = {}
    for s in saves:  # published one by one, pruned after each as Checkpointer.save does
        _fake_checkpoint(tmp_path, s)
        whole[s] = (ckpt.step_dir(tmp_path, s) / "hf" / "model.safetensors").read_bytes()
        ckpt.prune(tmp_path, keep_last=2, is_evaluation=set(evals).__contains__)
    left = sorted(ckpt.list_steps(tmp_path))
    slim = [s for s in left if ckpt.is_weights_only(ckpt.step_dir(tmp_path, s))]
    print("kept", left, "weights only", slim)
    assert left == evals and slim == [1960, 1970, 1980]
    for s in left:
        folder = ckpt.step_dir(tmp_path, s)
        assert ckpt.verify(folder) is None, s
        assert (folder / "ds").exists() == (s not in slim)
        assert (folder / "hf" / "model.safetensors").read_bytes() == whole[s]
    assert not [p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir() if p.name.startswith(".")]
    assert ckpt.newest_valid(tmp_path) == 2000
    assert ckpt.prune(tmp_path, keep_last=2, is_evaluation=set(evals).__contains__) == ([], [])  # slim ones stay as they are
    # resume never starts from a weights-only checkpoint: with both whole ones corrupt, from scratch
    for s in (1990, 2000):
        (ckpt.step_dir(tmp_path, s) / "ds" / "state" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    logs = []
    assert ckpt.newest_valid(tmp_path, log=logs.append) is None
    # one line naming every checkpoint it could not use
    assert len(logs) == 1 and "starting from scratch" in logs[0] and "step-2000" in logs[0] and "step-1990" in logs[0]


def test_keep_last_zero_keeps_every_checkpoint_whole(tmp_path):
    for s in (2, 4, 6):
        _fake_checkpoint(tmp_path, s)
    assert ckpt.prune(tmp_path, keep_last=0, is_evaluation=lambda step: True) == ([], [])
    assert not any(ckpt.is_weights_only(ckpt.step_dir(tmp_path, s)) for s in (2, 4, 6))


def test_a_checkpoint_killed_between_the_two_renames_is_put_back(tmp_path):
    """`_swap_in` moves the old folder aside, then the new one in: a kill between leaves only
    `.step-N.old`, which the next run's `clear_staging` restores (and a half-built slim copy is removed)."""
    _fake_checkpoint(tmp_path, 6)
    root = ckpt.checkpoints_dir(tmp_path)
    (root / "step-6").rename(root / ".step-6.old")
    (root / ".step-6.slim.tmp" / "hf").mkdir(parents=True)
    _fake_checkpoint(tmp_path, 8)  # a whole one beside it, with a stale copy aside to be deleted
    (root / ".step-8.old").mkdir()
    ckpt.clear_staging(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step-6", "step-8"]
    assert ckpt.verify(root / "step-6") is None and ckpt.verify(root / "step-8") is None


def test_no_decay_on_norms_and_biases():
    import torch

    from torchtrain.model import build_model

    model = build_model("random:qwen2", engine="sdpa")
    cfg = load_train_config(TINY)
    decay, no_decay = param_groups(model, cfg.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == cfg.optim.weight_decay and no_decay["weight_decay"] == 0.0
    off = sorted(names[id(p)] for p in no_decay["params"])
    print(off[:6])
    assert off and all("norm" in n or n.endswith(".bias") for n in off)
    assert all("norm" not in names[id(p)] and not names[id(p)].endswith(".bias") for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    everything = param_groups(model, with_changes(cfg, {"optim.no_decay": ()}).optim)
    assert len(everything) == 1 and isinstance(everything[0]["params"][0], torch.nn.Parameter)


def test_manifest_verifies_and_detects(tmp_path):
    folder = tmp_path / "step-1"
    (folder / "a").mkdir(parents=True)
    (folder / "a" / "x.bin").write_bytes(b"abc")
    (folder / "y.json").write_text("{}")
    ckpt.write_manifest(folder, 1)
    assert ckpt.verify(folder) is None
    (folder / "extra").write_text("")
    assert "unexpected file extra" in ckpt.verify(folder)
    (folder / "extra").unlink()
    (folder / "a" / "x.bin").write_bytes(b"abd")
    assert "checksum mismatch in a/x.bin" in ckpt.verify(folder)
    (folder / "manifest.json").write_text("{not json")
    assert "no readable manifest" in ckpt.verify(folder)
