"""The MLP computed in tiles over the sequence (`torchtrain.model.tiling`) against the untiled step: a whole model's
loss and every parameter's gradient, with and without activation checkpointing, at T = 515 slots in tiles of
64 rows (the last one ragged) and of one row.

The rule: the loss and, per gradient, the tiled fp32 step's relative distance to the untiled fp64 step is at most
twice the untiled fp32 step's own distance to it (the loss: plus one fp32 epsilon, as the untiled loss can round
to the fp64 one exactly). Each slot's forward is the same arithmetic tiled or not, but a matmul over fewer rows
may block them differently, and the weights' gradients sum the tiles in another order: the same arithmetic,
another rounding. A tile overlap or gap is refused by the cover check and, with the check
switched off, breaks the comparison.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.torchtrain.conftest import rel_l2
from torchtrain.model import tiling

T, V = 515, 97


def _model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype)


def _step(dtype: torch.dtype, *, rows: int | None, checkpointing: bool = False) -> tuple[torch.Tensor, dict]:
    model = _model(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    if rows is not None:
        assert tiling.tile_mlps(model, rows) == 2
    tokens = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def truth():
    return _step(torch.float64, rows=None)


@pytest.fixture(scope="module")
def untiled():
    return _step(torch.float32, rows=None)


def _holds(tiled, untiled, truth) -> list[str]:
    """The names whose gradient breaks the rule (module docstring), and 'loss' if the loss differs."""
    (loss, grads), (loss0, grads0), (loss64, ref) = tiled, untiled, truth
    eps = torch.finfo(torch.float32).eps * abs(float(loss64))
    bad = [] if abs(float(loss) - float(loss64)) <= 2 * abs(float(loss0) - float(loss64)) + eps else ["loss"]
    return bad + [name for name, g in grads.items() if rel_l2(g, ref[name]) > 2 * rel_l2(grads0[name], ref[name])]


@pytest.mark.parametrize("rows", [64, 1])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_tiled_mlp_leaves_the_step_unchanged(rows, checkpointing, untiled, truth):
    tiled = _step(torch.float32, rows=rows, checkpointing=checkpointing)
    reference = _step(torch.float32, rows=None, checkpointing=True) if checkpointing else untiled
    assert _holds(tiled, reference, truth) == []
    assert any(".mlp." in n for n in tiled[1])


def test_tile_ranges_cover_the_rows_once():
    assert tiling.tile_ranges(515, 64)[-1] == (512, 515) and len(tiling.tile_ranges(515, 64)) == 9
    assert tiling.tile_ranges(515, 1000) == [(0, 515)]
    with pytest.raises(AssertionError, match="gap or overlap"):
        tiling._check_cover([(0, 64), (60, 515)], 515)
    with pytest.raises(AssertionError, match="gap or overlap"):
        tiling._check_cover([(0, 64), (65, 515)], 515)
    with pytest.raises(AssertionError, match="end at"):
        tiling._check_cover([(0, 64), (64, 514)], 515)


@pytest.mark.parametrize("shift", [-1, 1], ids=["overlap_before", "overlap_after"])
def test_a_planted_tile_error_is_caught(shift, monkeypatch, untiled, truth):
    """The fourth tile moved by one row: it overlaps a neighbour and leaves a gap, with the row count intact."""
    good = tiling.tile_ranges

    def broken(rows, tile):
        ranges = good(rows, tile)
        s, e = ranges[3]
        ranges[3] = (s + shift, e + shift)
        return ranges

    monkeypatch.setattr(tiling, "tile_ranges", broken)
    with pytest.raises(AssertionError, match="gap or overlap"):
        _step(torch.float32, rows=64)
    # the cover check off: the comparison itself catches the broken step
    monkeypatch.setattr(tiling, "_check_cover", lambda ranges, rows: None)
    bad = _holds(_step(torch.float32, rows=64), untiled, truth)
    assert "loss" in bad and any(".mlp." in n for n in bad)


def test_inference_runs_the_mlp_untiled():
    model = _model(torch.float32)
    tiling.tile_mlps(model, 64)
    tokens = torch.randint(0, V, (1, 97), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        tiled = model(input_ids=tokens).logits
    assert torch.equal(tiled, _model(torch.float32)(input_ids=tokens).logits.detach())


def test_anchor_train_tiles_the_mlp_when_asked(tmp_path, monkeypatch):
    """`model.tiled_mlp: true` reaches every layer of the trained model: the tiled function ran with the hidden
    size as its rows per tile, and the first step's loss and gradient norm are the untiled run's to within fp32
    rounding (8 units in the last place; the rule against fp64 is the tests above, on the same function)."""
    from torchtrain.config import load_train_config
    from torchtrain.training.trainer import train

    calls = []
    apply = tiling._TiledMLP.apply
    monkeypatch.setattr(tiling._TiledMLP, "apply", lambda *a: calls.append(a[2]) or apply(*a))
    rows = {}
    for tiled in (False, True):
        cfg = load_train_config("tiny", ["schedule.steps=1", "checkpoint.save_every=0", "data.seq_len=131",
                                         f"model.tiled_mlp={str(tiled).lower()}"])
        train(cfg, tmp_path / f"run-{tiled}", progress=False)
        rows[tiled] = json.loads((tmp_path / f"run-{tiled}" / "metrics.jsonl").read_text().splitlines()[0])
    ulps = 8 * torch.finfo(torch.float32).eps
    assert abs(rows[True]["loss"] - rows[False]["loss"]) <= ulps * rows[False]["loss"]
    assert abs(rows[True]["grad_norm"] - rows[False]["grad_norm"]) <= ulps * rows[False]["grad_norm"]
    assert calls and set(calls) == {84}  # tiny's hidden size: the rows per tile


def test_checkpoints_in_host_memory_leave_the_step_unchanged():
    """`model.offload_checkpoints` runs the forward under torch.autograd.graph.save_on_cpu: the saved tensors are
    copied out and back, the arithmetic is the same, so the loss and every gradient are equal bit for bit (here
    on the CPU, where the copies are host to host; the trainer refuses the option without CUDA)."""
    def step(offload: bool):
        model = _model(torch.float32)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        tiling.tile_mlps(model, 64)
        tokens = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
        saved = torch.autograd.graph.save_on_cpu() if offload else contextlib.nullcontext()
        with saved:
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    (loss, grads), (loss0, grads0) = step(True), step(False)
    assert torch.equal(loss, loss0) and all(torch.equal(g, grads0[n]) for n, g in grads.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_anchor_train_offloads_checkpoints_on_cuda(tmp_path):
    """On CUDA, the trainer's step with offloaded checkpoints is the step without, bit for bit."""
    from torchtrain.config import load_train_config
    from torchtrain.training.trainer import train

    rows = {}
    for offload in (False, True):
        cfg = load_train_config("tiny", ["schedule.steps=2", "checkpoint.save_every=0", "data.seq_len=131",
                                         "model.activation_checkpointing=true",
                                         f"model.offload_checkpoints={str(offload).lower()}"])
        train(cfg, tmp_path / f"run-{offload}", progress=False)
        rows[offload] = [json.loads(line) for line in (tmp_path / f"run-{offload}" / "metrics.jsonl").read_text()
                         .splitlines()]
    assert [(r["loss"], r["grad_norm"]) for r in rows[True]] == [(r["loss"], r["grad_norm"]) for r in rows[False]]


def test_checkpoints_are_kept_in_the_compute_dtype():
    """In bf16 what activation checkpointing keeps of each layer, its input, is bf16 (2 bytes a value: the plan's
    e = 2), not an fp32 copy, and the checkpointed step is the plain one bit for bit (the recomputed forward is
    the same arithmetic)."""
    def step(checkpointing: bool):
        model = _model(torch.bfloat16)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        kept = []
        hooks = [layer.register_forward_pre_hook(lambda m, args, kwargs: kept.append(
            (kwargs.get("hidden_states", args[0] if args else None)).dtype), with_kwargs=True)
            for layer in model.model.layers]
        tokens = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        for h in hooks:
            h.remove()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kept

    (loss, grads, kept), (loss0, grads0, _) = step(True), step(False)
    assert len(kept) >= 2 and set(kept) == {torch.bfloat16}
    assert torch.equal(loss, loss0) and all(torch.equal(g, grads0[n]) for n, g in grads.items())
