"""fp32 gradients of the trainable engines against `eager`, and the masked loss."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from anchor_core.weights import load_weights
from tests.torchtrain.conftest import packed_batch, rel_l2
from torchtrain import next_token_loss
from torchtrain.model import model_from_weights
from torchtrain.attention.variants import VARIANTS


@functools.cache
def _weights(name: str):
    return load_weights(name)


def _grads(name: str, engine: str, variant: str, T: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = model_from_weights(*_weights(name), engine=engine, dtype="float32")
    batch = packed_batch(variant, T, seed=5)
    loss, count = next_token_loss(model(**batch.model_inputs()).logits, batch.tokens, batch.loss_mask)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("engine", ["sdpa", "flash_varlen_emulated"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["random:llama", "random:qwen2", "random:mistral"])
def test_gradients_match_eager(name, variant, engine):
    ref_loss, ref = _grads(name, "eager", variant, 97)
    loss, got = _grads(name, engine, variant, 97)
    errs = {n: rel_l2(got[n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    print(f"{name} {variant} {engine}: loss {loss:.6f} vs {ref_loss:.6f}; worst grad rel L2 {errs[worst]:.2e} ({worst})")
    assert set(got) == set(ref)
    assert errs[worst] <= 1e-5


def test_loss_counts_only_masked_targets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g)
    tokens = torch.randint(0, 11, (2, 6), generator=g)
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 1]])  # the last slot never counts
    loss, count = next_token_loss(logits, tokens, mask)
    want = [F.cross_entropy(logits[b, t], tokens[b, t + 1]) for b in range(2) for t in range(5) if mask[b, t]]
    print("loss", float(loss), "count", int(count), "by hand", float(sum(want) / len(want)))
    assert int(count) == 4
    torch.testing.assert_close(loss, sum(want) / len(want))


def test_loss_with_nothing_counted_is_zero_with_a_graph():
    logits = torch.randn(1, 4, 5, requires_grad=True)
    loss, count = next_token_loss(logits, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    loss.backward()
    assert int(count) == 0 and float(loss.detach()) == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_loss_in_bf16_is_computed_in_fp32():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 9, 17, generator=g).bfloat16()
    tokens = torch.randint(0, 17, (1, 9), generator=g)
    mask = torch.ones(1, 9, dtype=torch.long)
    loss, _ = next_token_loss(logits, tokens, mask)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:]))


def test_gradient_checkpointing_reuses_the_step_metadata(monkeypatch):
    """Recomputed layers get the same `attn_meta`: one build per step, gradients unchanged."""
    from torchtrain.attention import engines

    _, ref = _grads("random:llama", "sdpa", "anchor", 97)
    model = model_from_weights(*_weights("random:llama"), engine="sdpa", dtype="float32")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    built, called = [], []
    prepare, attend = engines.prepare_meta, engines.attend
    monkeypatch.setattr(engines, "prepare_meta", lambda *a: built.append(a) or prepare(*a))
    monkeypatch.setattr(engines, "attend", lambda *a: called.append(a[4]) or attend(*a))
    batch = packed_batch("anchor", 97, seed=5)
    loss, _ = next_token_loss(model(**batch.model_inputs()).logits, batch.tokens, batch.loss_mask)
    loss.backward()
    worst = max(rel_l2(p.grad, ref[n]) for n, p in model.named_parameters())
    print(f"metadata built {len(built)}x for {len(called)} attention calls (forward + recomputation); "
          f"worst grad rel L2 {worst:.2e}")
    assert len(built) == 1 and len(called) == 2 * model.config.num_hidden_layers
    assert all(meta is called[0] for meta in called) and worst <= 1e-6
