"""The lm-head fused with the cross-entropy (`torchtrain.model.loss.linear_cross_entropy`) against the
unfused path (`token_cross_entropy(hidden @ weightᵀ, targets)`): fp32 forward within 1e-6 and
gradients within 1e-5 (relative to the reference's largest magnitude), bf16 within twice the unfused
bf16 path's own error against fp32, at odd sizes (N=515 rows, V=1031, H=84) and with chunks that
do not divide the rows; then whole models, tied (qwen2, smollm2) and untied (llama), through
`final_hidden_states`, and the sequence-parallel shard loss. No [N, V] tensor may be saved."""

from __future__ import annotations

import functools

import pytest
import torch

from anchor_core.weights import load_weights
from tests.torchtrain.conftest import packed_batch, rel_l2
from torchtrain.model import loss as L
from torchtrain import next_token_loss
from torchtrain.model import model_from_weights
from torchtrain.parallel.ulysses import next_token_loss_shard

N, V, H = 515, 1031, 84
FWD_TOL, GRAD_TOL = 1e-6, 1e-5


def max_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|, in float64."""
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).abs().max() / ref.abs().max())


def _inputs(dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * H ** -0.5 * 3).to(dtype)  # logits of a few units, as a trained head
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    grad_out = torch.rand(N, generator=g)  # a mask-like weighting of the rows
    return hidden, weight, b, targets, grad_out


def _run(fused: bool, hidden, weight, bias, targets, grad_out):
    """(loss [N], grad hidden, grad weight, grad bias) of the fused or the unfused path."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    h, w, b = leaves
    if fused:
        ce = L.linear_cross_entropy(h, w, targets, b)
    else:
        logits = torch.nn.functional.linear(h, w, b)
        ce = L.token_cross_entropy(logits[None], targets[None])[0]
    ce.backward(grad_out)
    return ce.detach(), h.grad, w.grad, None if b is None else b.grad


@pytest.fixture(params=["one_chunk", "97_rows"])
def chunk_rows(request, monkeypatch):
    """The default chunking (all 515 rows in one chunk at V=1031) and at most 97 rows (6 chunks of 86 and 85)."""
    rows = {"one_chunk": L._rows_per_chunk(V), "97_rows": 97}[request.param]
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", rows * V)
    assert L._rows_per_chunk(V) == rows
    return rows


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fp32_matches_unfused(chunk_rows, bias):
    args = _inputs(torch.float32, bias)
    got, want = _run(True, *args), _run(False, *args)
    names = ["loss", "grad_hidden", "grad_weight", "grad_bias"]
    errs = {n: max_rel(a, b) for n, a, b in zip(names, got, want) if b is not None}
    bitwise = {n: bool(torch.equal(a, b)) for n, a, b in zip(names, got, want) if b is not None}
    print(f"{chunk_rows} rows/chunk, bias={bias}: max rel {errs}; bitwise {bitwise}")
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    assert errs["loss"] <= FWD_TOL
    assert all(errs[n] <= GRAD_TOL for n in errs if n != "loss")


def test_bf16_within_twice_the_unfused_error(chunk_rows):
    """Baseline: the unfused bf16 path against fp32 on the same (bf16-representable) values."""
    hidden, weight, bias, targets, grad_out = _inputs(torch.bfloat16, True)
    truth = _run(False, hidden.float(), weight.float(), bias.float(), targets, grad_out)
    unfused = _run(False, hidden, weight, bias, targets, grad_out)
    fused = _run(True, hidden, weight, bias, targets, grad_out)
    assert fused[0].dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in fused[1:])
    for name, f, u, t in zip(["loss", "grad_hidden", "grad_weight", "grad_bias"], fused, unfused, truth):
        base, err = rel_l2(u, t), rel_l2(f, t)
        print(f"{chunk_rows} rows/chunk, bf16 {name}: fused rel L2 {err:.3e}, unfused (baseline) {base:.3e}; "
              f"max rel fused {max_rel(f, t):.3e} unfused {max_rel(u, t):.3e}")
        assert base > 0 and err <= 2 * base


@pytest.mark.parametrize("n,rows", [(515, 257), (515, 97), (342, 341), (97, 341), (1, 1), (0, 5)])
def test_chunks_are_equal_and_cover_the_rows(n, rows, monkeypatch):
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", rows * V)
    chunks = L._chunks(n, V)
    sizes = [e - s for s, e in chunks]
    print(f"{n} rows, at most {rows} per chunk: {sizes}")
    assert [r for s, e in chunks for r in range(s, e)] == list(range(n))
    assert len(chunks) == -(-n // rows) and all(0 < k <= rows for k in sizes)
    assert not sizes or max(sizes) - min(sizes) <= 1  # 515 by 257 is 172+172+171, never 257+257+1


@pytest.mark.parametrize("shift", [-1, 1], ids=["overlap", "gap"])
def test_a_planted_chunk_overlap_or_gap_is_caught(shift, monkeypatch):
    """The loss is computed in tiles (chunks) over the sequence; a chunk that starts one row early (that row
    twice: its weight gradient counted twice) or one row late (a row never computed) fails the rule of
    test_fp32_matches_unfused."""
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 97 * V)
    chunks = L._chunks

    def planted(n, v):
        out = chunks(n, v)
        s, e = out[1]
        out[1] = (s + shift, e)
        return out

    monkeypatch.setattr(L, "_chunks", planted)
    got, want = _run(True, *_inputs(torch.float32, False)), _run(False, *_inputs(torch.float32, False))
    errs = [max_rel(a, b) for a, b in zip(got[:3], want[:3])]
    print(f"planted {'overlap' if shift < 0 else 'gap'}: loss {errs[0]:.2e}, grad hidden {errs[1]:.2e}, "
          f"grad weight {errs[2]:.2e}")
    assert errs[2] > GRAD_TOL  # the weight gradient sums every row's contribution once


def test_rows_do_not_depend_on_their_chunk(monkeypatch):
    """A row's loss and hidden gradient are its own (rows never mix, chunks are never small): chunkings
    of at most 20, 97 and 257 rows give the one-chunk results, bitwise where the BLAS multiplies
    a row the same inside any product of 12 rows or more (probed here first)."""
    hidden, weight, _, targets, grad_out = _inputs(torch.float32, False, seed=3)
    full = torch.nn.functional.linear(hidden, weight)
    blas_rows_exact = all(torch.equal(torch.nn.functional.linear(hidden[:k], weight), full[:k]) for k in (12, 19, 86, 171))
    runs = {}
    for rows in (20, 97, 257, N):
        monkeypatch.setattr(L, "_CHUNK_ELEMENTS", rows * V)
        runs[rows] = _run(True, hidden, weight, None, targets, grad_out)
    print(f"the BLAS gives a row the same bits in any product of >= 12 rows: {blas_rows_exact}")
    for rows in (20, 97, 257):
        (loss, gh, gw), (loss1, gh1, gw1) = runs[rows][:3], runs[N][:3]
        print(f"at most {rows} rows/chunk vs one chunk: loss bitwise {torch.equal(loss, loss1)} "
              f"(max rel {max_rel(loss, loss1):.1e}), grad_hidden bitwise {torch.equal(gh, gh1)} "
              f"(max rel {max_rel(gh, gh1):.1e}), grad_weight max rel {max_rel(gw, gw1):.1e}")
        if blas_rows_exact:
            assert torch.equal(loss, loss1) and torch.equal(gh, gh1)
        assert max_rel(loss, loss1) <= FWD_TOL and max_rel(gh, gh1) <= GRAD_TOL and max_rel(gw, gw1) <= GRAD_TOL


def _saved_sizes(fn) -> list[int]:
    """Element counts of every tensor autograd saves while `fn()` runs."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_saves_no_logits(monkeypatch):
    """The fused path keeps hidden, weight, targets and one lse per row; the unfused one keeps [N, V]."""
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 97 * V)
    hidden, weight, _, targets, _ = _inputs(torch.float32, False)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    fused = _saved_sizes(lambda: L.linear_cross_entropy(h, w, targets))
    unfused = _saved_sizes(lambda: L.token_cross_entropy((h @ w.T)[None], targets[None]))
    print(f"saved elements: fused {fused}, unfused {unfused} (N*V = {N * V})")
    assert max(unfused) >= N * V  # the hook sees what the unfused path keeps
    assert sorted(fused) == sorted([N * H, V * H, N, N])


def test_bad_inputs_are_one_line_errors():
    hidden, weight, _, targets, _ = _inputs(torch.float32, False)
    with pytest.raises(ValueError, match=r"targets outside the vocabulary \[0, 1031\)"):
        L.linear_cross_entropy(hidden, weight, torch.full_like(targets, V))
    with pytest.raises(ValueError, match="are not"):
        L.linear_cross_entropy(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="514 targets for 515 rows"):
        L.linear_cross_entropy(hidden, weight, targets[:-1])


# ---------------------------------------------------------------------------------------------
# Whole models: the final norm's output through the (tied) lm-head


@functools.cache
def _weights(name: str):
    return load_weights(name)


def _model_grads(name: str, fused: bool, checkpointing: bool = False):
    model = model_from_weights(*_weights(name), engine="sdpa", dtype="float32")
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    batch = packed_batch("anchor", 97, seed=7, vocab=model.config.vocab_size)
    targets = torch.roll(batch.tokens, -1, dims=1)
    mask = batch.loss_mask.clone()
    mask[:, -1] = 0
    if fused:
        hidden = L.final_hidden_states(model, model, **batch.model_inputs())
        ce = L.head_cross_entropy(model, hidden, targets)
    else:
        ce = L.token_cross_entropy(model(**batch.model_inputs()).logits, targets)
    loss = (ce * mask).sum() / mask.sum()
    loss.backward()
    return model, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,tied", [("random:llama", False), ("random:qwen2", True), ("random:smollm2", True)])
def test_models_fused_equals_unfused(name, tied, monkeypatch):
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 13 * _weights(name)[0].vocab_size)  # 2 x 97 rows in 15 chunks
    model, loss, got = _model_grads(name, fused=True)
    _, ref_loss, ref = _model_grads(name, fused=False)
    errs = {n: max_rel(got[n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    print(f"{name} (tied={tied}): loss {float(loss):.7f} vs {float(ref_loss):.7f}; worst grad max rel "
          f"{errs[worst]:.2e} ({worst}); embedding {errs['model.embed_tokens.weight']:.2e}")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert ("lm_head.weight" in got) == (not tied)  # tied: one parameter, its gradient sums both uses
    assert abs(float(loss) - float(ref_loss)) <= FWD_TOL * abs(float(ref_loss))
    assert errs[worst] <= GRAD_TOL


def test_final_hidden_states_projects_nothing_under_checkpointing():
    """The lm-head runs on no slot; the norm fires once even when decoder layers are recomputed."""
    model = model_from_weights(*_weights("random:smollm2"), engine="sdpa", dtype="float32")
    seen = []
    model.lm_head.register_forward_hook(lambda _m, _a, out: seen.append(tuple(out.shape)))
    batch = packed_batch("anchor", 97, seed=7, vocab=model.config.vocab_size)
    hidden = L.final_hidden_states(model, model, **batch.model_inputs())
    print("hidden", tuple(hidden.shape), "lm-head output", seen)
    assert hidden.shape == (2, 97, model.config.hidden_size) and seen == [(2, 0, model.config.vocab_size)]
    _, _, ref = _model_grads("random:smollm2", fused=False)
    _, _, got = _model_grads("random:smollm2", fused=True, checkpointing=True)
    worst = max(max_rel(got[n], ref[n]) for n in ref)
    print(f"checkpointed fused vs unfused: worst grad max rel {worst:.2e}")
    assert worst <= GRAD_TOL


@pytest.mark.parametrize("degree", [2, 5])
def test_sequence_parallel_shards_sum_to_the_window(degree, monkeypatch):
    """`next_token_loss_shard` with the lm-head: the shards' ce sums and gradients add up to the
    whole window's (T = 2 x 97 or 5 x 97 slots), and each shard equals its logits path."""
    monkeypatch.setattr(L, "_CHUNK_ELEMENTS", 13 * 331)
    model = model_from_weights(*_weights("random:qwen2"), engine="sdpa", dtype="float32")
    head = model.get_output_embeddings()
    batch = packed_batch("anchor", 97 * degree, seed=11, vocab=model.config.vocab_size)
    hidden = L.final_hidden_states(model, model, **batch.model_inputs()).detach().requires_grad_()
    logits = head(hidden).detach().requires_grad_()
    whole, count = next_token_loss(logits, batch.tokens, batch.loss_mask)
    whole.backward()
    whole = whole.detach()
    total = torch.zeros(())
    for rank in range(degree):
        s = slice(rank * 97, (rank + 1) * 97)
        ce_sum, n = next_token_loss_shard(hidden[:, s], batch.tokens, batch.loss_mask, rank, degree, lm_head=head)
        ref_sum, _ = next_token_loss_shard(logits.detach()[:, s], batch.tokens, batch.loss_mask, rank, degree)
        assert int(n) == int(count) and max_rel(ce_sum, ref_sum) <= FWD_TOL
        (ce_sum / n).backward()
        total += ce_sum.detach()
    # the hidden gradient of the whole window's loss, through the lm-head: d(logits) @ W
    want_hidden = logits.grad @ head.weight.detach()
    want_weight = logits.grad.flatten(0, 1).T @ hidden.detach().flatten(0, 1)  # tied: only the head's use here
    print(f"P={degree}: loss {float(total / count):.7f} vs {float(whole):.7f}; "
          f"hidden grad max rel {max_rel(hidden.grad, want_hidden):.2e}, "
          f"weight grad max rel {max_rel(head.weight.grad, want_weight):.2e}")
    assert abs(float(total / count) - float(whole)) <= FWD_TOL * float(whole)
    assert max_rel(hidden.grad, want_hidden) <= GRAD_TOL and max_rel(head.weight.grad, want_weight) <= GRAD_TOL
