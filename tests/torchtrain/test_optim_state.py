"""torchtrain.training.optim.allocate_state: AdamW's moments held from the start, so the first step's peak is every
step's (torchtrain.training.memory.step_memory counts them), without changing one bit of the run."""

from __future__ import annotations

import json

import torch

from torchtrain.training import optim


def _model_and_adamw(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(97, 515), torch.nn.GELU(), torch.nn.Linear(515, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1, betas=(0.9, 0.95))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(n):
        x = torch.randn(31, 97, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_state_is_allocated_as_the_first_step_would_and_the_weights_are_untouched():
    model, opt = _model_and_adamw()
    before = [p.detach().clone() for p in model.parameters()]
    optim.allocate_state(opt)
    assert opt.param_groups[0]["lr"] == 2e-2  # put back
    for p, w in zip(model.parameters(), before):
        assert torch.equal(p, w) and p.grad is None  # the zero-gradient step at lr 0 moved nothing
        state = opt.state[p]
        assert state["step"].item() == 0
        assert state["exp_avg"].shape == p.shape and not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_a_run_with_the_state_allocated_is_the_lazy_run_bit_for_bit():
    lazy_model, lazy = _model_and_adamw()
    eager_model, eager = _model_and_adamw()
    optim.allocate_state(eager)
    assert _steps(eager_model, eager, 5) == _steps(lazy_model, lazy, 5)
    for a, b in zip(eager_model.parameters(), lazy_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(eager.state.values(), lazy.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_an_existing_state_is_left_alone():
    model, opt = _model_and_adamw()
    _steps(model, opt, 2)
    kept = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    optim.allocate_state(opt)
    assert all(torch.equal(kept[k], v) for k, v in opt.state[next(model.parameters())].items())


def test_anchor_train_holds_the_moments_from_the_start_and_trains_the_same(tmp_path, monkeypatch):
    """`anchor train` at ZeRO-0 allocates the state before its first step; three steps give the losses,
    gradient norms and final weights of a run that allocates it lazily, bit for bit."""
    from torchtrain.training import trainer
    from torchtrain.config import load_train_config

    seen = []
    monkeypatch.setattr(trainer, "allocate_state",
                        lambda opt: seen.append(sum(len(opt.state[p]) for g in opt.param_groups for p in g["params"]))
                        or optim.allocate_state(opt))
    runs = {}
    for eager in (True, False):
        if not eager:
            monkeypatch.setattr(trainer, "allocate_state", lambda opt: None)
        cfg = load_train_config("tiny", ["schedule.steps=3", "checkpoint.save_every=0", "data.seq_len=131"])
        trainer.train(cfg, tmp_path / f"run-{eager}", progress=False)
        rows = [json.loads(line) for line in (tmp_path / f"run-{eager}" / "metrics.jsonl").read_text().splitlines()]
        weights = {p.relative_to(tmp_path / f"run-{eager}").as_posix(): p.read_bytes()
                   for p in sorted((tmp_path / f"run-{eager}").rglob("*.safetensors"))}
        runs[eager] = ([(r["loss"], r["grad_norm"]) for r in rows if "loss" in r], weights)
    assert seen == [0]  # called once, on an optimizer with no state yet
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 3
    assert runs[True][1] and runs[True][1] == runs[False][1]
