"""The mask predicate against docs/DESIGN.md §2 by brute force; varlen segments and the varlen emulation
against the dense mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anchor_core.errors import InputError
from tests.torchtrain.conftest import packed_batch
from torchtrain.attention import eager_attention, varlen_attention
from torchtrain.attention.variants import VARIANTS, check_doc_ids, dense_mask
from torchtrain.attention.varlen import segment_mask, varlen_segments
from torchtrain.attention.varlen_emulation import flash_attn_varlen_func

LAYOUTS = ("cut", "padded", "interleaved")


def contract_mask(doc: list[int], variant: str) -> torch.Tensor:
    """docs/DESIGN.md §2 spelled out slot by slot (bool [T, T])."""
    T = len(doc)
    out = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(i + 1):
            if doc[i] < 0 or doc[j] < 0:
                out[i, j] = i == j
            elif variant == "full":
                out[i, j] = True
            elif variant in ("intra_doc", "intra_doc_reset"):
                out[i, j] = doc[i] == doc[j]
            else:
                out[i, j] = doc[i] == doc[j] or j == 0
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_predicate_matches_contract(variant):
    batch = packed_batch(variant, 61, layouts=LAYOUTS, seed=3)
    mask = dense_mask(batch.doc_ids, variant)
    for b in range(batch.doc_ids.shape[0]):
        want = contract_mask(batch.doc_ids[b].tolist(), variant)
        print(variant, b, "allowed pairs", int(mask[b].sum()), "contract", int(want.sum()))
        assert torch.equal(mask[b], want)


def test_predicate_rows_subset():
    batch = packed_batch("anchor", 50, layouts=LAYOUTS)
    rows = torch.tensor([0, 7, 49])
    assert torch.equal(dense_mask(batch.doc_ids, "anchor", rows), dense_mask(batch.doc_ids, "anchor")[:, rows])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [97, 1025])
def test_segments_imply_the_dense_mask(variant, T):
    batch = packed_batch(variant, T, layouts=LAYOUTS, seed=T)
    seg = varlen_segments(batch.doc_ids, variant)
    implied = segment_mask(seg, *batch.doc_ids.shape)
    dense = dense_mask(batch.doc_ids, variant)
    print(variant, T, "segments", len(seg.cu_seqlens_q) - 1, "mismatching pairs", int((implied != dense).sum()))
    assert torch.equal(implied, dense)
    assert sorted(seg.q_index.tolist()) == list(range(batch.doc_ids.numel()))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,degree", [(194, 2), (1028, 4)])
def test_a_ranks_segments_imply_its_rows_of_the_dense_mask(variant, T, degree):
    """Context parallelism: each rank's segments (its balanced slots as queries, every slot as a key) imply
    exactly its rows of the dense mask, with documents cut by every rank boundary and interleaved chunks."""
    from torchtrain.parallel.context import balanced_slots

    batch = packed_batch(variant, T, layouts=LAYOUTS, seed=T + degree)
    B = batch.doc_ids.shape[0]
    for rank in range(degree):
        rows = torch.as_tensor(balanced_slots(T, degree, rank))
        seg = varlen_segments(batch.doc_ids, variant, rows)
        implied = segment_mask(seg, B, T, len(rows))
        assert torch.equal(implied, dense_mask(batch.doc_ids, variant, rows)), (variant, rank)
        assert sorted(seg.q_index.tolist()) == list(range(B * len(rows)))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [97, 1025])
def test_varlen_attention_equals_dense(variant, T):
    """The gathered segments through the emulation equal dense masked attention (fp32, GQA)."""
    batch = packed_batch(variant, T, layouts=LAYOUTS, seed=T + 1)
    B = batch.doc_ids.shape[0]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 6, T, 16, generator=g)
    k = torch.randn(B, 2, T, 16, generator=g)
    v = torch.randn(B, 2, T, 16, generator=g)
    scale = 16**-0.5
    dense = eager_attention(q, k, v, dense_mask(batch.doc_ids, variant)[:, None], scale)
    out = varlen_attention(q, k, v, varlen_segments(batch.doc_ids, variant), scale, flash_attn_varlen_func)
    err = float((out - dense).abs().max())
    print(f"{variant} T={T}: max |varlen - dense| = {err:.2e}")
    assert err <= 1e-6


def test_emulation_bottom_right_alignment():
    """More keys than queries: query i sees keys j <= i + Lk - Lq; more queries than keys: empty rows give 0."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 2, 8, generator=g)
    k = torch.randn(7, 1, 8, generator=g)
    v = torch.randn(7, 1, 8, generator=g)
    # segment 0: 2 queries, 4 keys; segment 1: 3 queries, 3 keys... built as 2q/4k then 3q/3k
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 7], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, softmax_scale=0.5, causal=True)
    for qi, (q0, k0, lq, lk) in enumerate([(0, 0, 2, 4), (2, 4, 3, 3)]):
        for i in range(lq):
            n_keys = i + lk - lq + 1
            s = torch.einsum("hd,jd->hj", q[q0 + i], k[k0 : k0 + n_keys, 0]) * 0.5
            want = torch.softmax(s, -1) @ v[k0 : k0 + n_keys, 0]
            torch.testing.assert_close(out[q0 + i], want, rtol=1e-6, atol=1e-6)
    short = flash_attn_varlen_func(q[:3], k[:1], v[:1], torch.tensor([0, 3], dtype=torch.int32),
                                   torch.tensor([0, 1], dtype=torch.int32), 3, 1, causal=True)
    assert torch.equal(short[:2], torch.zeros_like(short[:2]))  # rows 0, 1 see no key
    torch.testing.assert_close(short[2], v[0].expand(2, 8))


@pytest.mark.parametrize(
    "doc, variant",
    [
        ([[1, 1, 2]], "anchor"),  # no anchor at slot 0
        ([[0, 0, 1]], "anchor"),  # anchor twice
        ([[0, 1, 1]], "intra_doc"),  # anchor in a non-anchor variant
        ([[1, -2, 1]], "full"),  # below -1
    ],
)
def test_doc_ids_rejected(doc, variant):
    with pytest.raises(InputError) as e:
        check_doc_ids(torch.tensor(doc), variant)
    print(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("variant", VARIANTS)
def test_stand_in_agrees_with_the_batch_maker(variant):
    """The stand-in packs like anchor_core.data.make_batch (when that module is present)."""
    data = pytest.importorskip("anchor_core.data")
    ours = packed_batch(variant, 61, layouts=LAYOUTS, seed=4)
    seg = packed_batch("anchor", 61, layouts=LAYOUTS, seed=4).doc_ids.numpy()
    theirs = data.make_batch(ours.tokens.numpy(), seg, np.zeros_like(seg), variant)
    for name in ("doc_ids", "positions", "loss_mask"):
        same = np.array_equal(np.asarray(getattr(theirs, name)), getattr(ours, name).numpy())
        print(variant, name, "equal" if same else "DIFFERENT")
        assert same
