"""Property tests of packing and batches against slot-by-slot references written from docs/DESIGN.md §1-§2."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anchor_core.data.batch import VARIANTS, make_batch
from anchor_core.data.mixture import MixtureSpec, select_documents
from anchor_core.data.packing import Layout, Packer, window_stats
from anchor_core.data.store import TokenStore
from anchor_core.errors import InputError

FIRST, EOS = 1, 2
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def corpora(draw):
    ndom = draw(st.integers(1, 3))
    ndocs = draw(st.integers(1, 25))
    docs = [draw(st.lists(st.integers(3, 300), min_size=1, max_size=40)) for _ in range(ndocs)]
    domains = [draw(st.integers(0, ndom - 1)) for _ in range(ndocs)]
    tags = [draw(st.lists(st.integers(3, 300), min_size=1, max_size=4)) for _ in range(ndom)]
    return docs, domains, ndom, tags


def ref_windows(docs, domains, selection, T, tags):
    """Slot by slot: BOS at slot 0, stream of (tag + doc + EOS) pieces, cut documents continue
    as new documents, padding -1 at the end of the last window."""
    stream = []
    for k, d in enumerate(selection):
        stream += [(t, k, 1) for t in (tags[domains[d]] if tags else [])]
        stream += [(t, k, 0) for t in docs[d]]
        stream.append((EOS, k, 0))
    C = T - 1
    W = -(-len(stream) // C)
    tok, seg, tag = (np.zeros((W, T), np.int64) for _ in range(3))
    for w in range(W):
        tok[w, 0], seg[w, 0] = FIRST, 0
        k0 = stream[w * C][1]
        for i in range(C):
            idx = w * C + i
            if idx < len(stream):
                t, k, g = stream[idx]
                tok[w, i + 1], seg[w, i + 1], tag[w, i + 1] = t, k - k0 + 1, g
            else:
                seg[w, i + 1] = -1
    return tok, seg, tag


def pack_all(store, selection, T, tags, interleave=False, mean_chunk=0, seed=0, block_slots=1 << 20, layout=None):
    packer = Packer(store, selection, T, first_token=FIRST, eos=EOS, tag_tokens=tags,
                    layout=layout or Layout(interleave=interleave, mean_chunk=mean_chunk), seed=seed)
    blocks = list(packer.blocks(block_slots))
    return tuple(np.concatenate([getattr(b, k) for b in blocks]) for k in ("tokens", "seg", "tag"))


def ref_batch(tokens, seg, tag, variant, mask_cross_doc_loss):
    """docs/DESIGN.md §1-§2 for one window, written slot by slot."""
    T = len(seg)
    doc = [int(s) for s in seg]
    if variant != "anchor":
        doc[0] = 1  # the BOS belongs to document 1
    pos = list(range(T))
    if variant == "intra_doc_reset":
        pos = [i if doc[i] < 0 else i - doc.index(doc[i]) for i in range(T)]
    loss = []
    for i in range(T):
        if i == T - 1:
            loss.append(0)
            continue
        trained = doc[i] >= 0 and doc[i + 1] >= 0 and not tag[i] and not tag[i + 1]
        if doc[i] != doc[i + 1] and (variant != "full" or mask_cross_doc_loss):
            trained = False
        loss.append(int(trained))
    return list(map(int, tokens)), doc, pos, loss


def doc_sequences(tokens, seg, tag):
    """Per document of one window (slots 1..T-1): its (token, tag) sequence in slot order."""
    out = {}
    for t, s, g in zip(tokens[1:], seg[1:], tag[1:]):
        if s >= 0:
            out.setdefault(int(s), []).append((int(t), int(g)))
    return out


@SETTINGS
@given(corpus=corpora(), T=st.integers(2, 48), use_tags=st.booleans(), block=st.integers(1, 300),
       mixture=st.sampled_from(["identity", "original", "upsample_long"]), seed=st.integers(0, 3))
def test_windows_match_reference(corpus, T, use_tags, block, mixture, seed):
    docs, domains, ndom, tags = corpus
    store = TokenStore.from_docs(docs, domains, [f"d{i}" for i in range(ndom)])
    if mixture == "identity":
        selection = np.arange(len(docs))
    else:
        spec = MixtureSpec(mixture, long_threshold=10, upsample_factor=2.5, seed=seed)
        if mixture == "upsample_long" and max(map(len, docs)) <= 10 and all(
                round(np.sum(np.asarray(domains) == d) / 2.5) == 0 for d in set(domains)):
            with pytest.raises(InputError, match="upsample_long selects no documents"):
                select_documents(store.length, store.domain, spec)
            return
        selection = select_documents(store.length, store.domain, spec)
    tags = tags if use_tags else None
    tok, seg, tag = pack_all(store, selection, T, tags, block_slots=block)
    rtok, rseg, rtag = ref_windows(docs, domains, selection, T, tags)
    print(f"T={T} docs={len(docs)} selected={len(selection)} windows={len(tok)} block={block}")
    np.testing.assert_array_equal(tok, rtok)
    np.testing.assert_array_equal(seg, rseg)
    np.testing.assert_array_equal(tag, rtag)
    assert (tok[:, 0] == FIRST).all() and (seg[:, 0] == 0).all()
    # every token of every selected document (with copies) appears once and in order
    real = seg[:, 1:] >= 0
    stream = tok[:, 1:][real & (tag[:, 1:] == 0)]
    want = np.concatenate([np.append(np.asarray(docs[d]), EOS) for d in selection])
    np.testing.assert_array_equal(stream, want)
    # a window ending inside a document: the next window starts with its remainder as document 1
    for w in range(len(tok) - 1):
        if tok[w, -1] != EOS or tag[w, -1]:
            assert seg[w + 1, 1] == 1


@SETTINGS
@given(corpus=corpora(), T=st.integers(2, 48), use_tags=st.booleans(), mean_chunk=st.integers(1, 8),
       seed=st.integers(0, 1000), block=st.integers(1, 300))
def test_interleave_keeps_chunk_order(corpus, T, use_tags, mean_chunk, seed, block):
    docs, domains, ndom, tags = corpus
    store = TokenStore.from_docs(docs, domains, [f"d{i}" for i in range(ndom)])
    selection = np.arange(len(docs))
    tags = tags if use_tags else None
    plain = pack_all(store, selection, T, tags, block_slots=block)
    mixed = pack_all(store, selection, T, tags, interleave=True, mean_chunk=mean_chunk, seed=seed,
                     block_slots=block)
    for w in range(len(plain[0])):
        p = [a[w] for a in plain]
        m = [a[w] for a in mixed]
        assert m[0][0] == FIRST and m[1][0] == 0
        np.testing.assert_array_equal(m[1] < 0, p[1] < 0)  # padding stays where it was
        # each document's (token, tag) sequence is intact: chunks keep their order
        assert sorted(doc_sequences(*m).values()) == sorted(doc_sequences(*p).values())
        # documents are numbered 1, 2, ... by first appearance
        firsts = [int(s) for i, s in enumerate(m[1]) if s > 0 and s not in m[1][:i]]
        assert firsts == list(range(1, len(firsts) + 1))


@SETTINGS
@given(corpus=corpora(), T=st.integers(2, 48), use_tags=st.booleans(), chunks_max=st.integers(2, 4),
       seed=st.integers(0, 1000), block=st.integers(1, 300))
def test_interleave_by_chunking_keeps_chunk_order(corpus, T, use_tags, chunks_max, seed, block):
    """The authors' chunking (documents of a length range cut into 2..chunks_max chunks) at the sizes of
    the generated corpora: chunk order, padding and numbering as with the per-slot scheme."""
    docs, domains, ndom, tags = corpus
    store = TokenStore.from_docs(docs, domains, [f"d{i}" for i in range(ndom)])
    tags = tags if use_tags else None
    layout = Layout(interleave=True, chunk_doc_min=4, chunk_doc_max=20, chunks_max=chunks_max)
    plain = pack_all(store, np.arange(len(docs)), T, tags, block_slots=block)
    mixed = pack_all(store, np.arange(len(docs)), T, tags, seed=seed, block_slots=block, layout=layout)
    for w in range(len(plain[0])):
        p = [a[w] for a in plain]
        m = [a[w] for a in mixed]
        np.testing.assert_array_equal(m[1] < 0, p[1] < 0)
        assert sorted(doc_sequences(*m).values()) == sorted(doc_sequences(*p).values())
        firsts = [int(s) for i, s in enumerate(m[1]) if s > 0 and s not in m[1][:i]]
        assert firsts == list(range(1, len(firsts) + 1))


@pytest.mark.parametrize("chunks_max,cut", [(3, (0.2, 0.8)), (5, (0.1, 0.5))])
def test_chunk_cuts_follow_the_authors_rule(chunks_max, cut):
    """Every document of chunk_doc_min..chunk_doc_max slots is cut into k chunks, k uniform in
    2..chunks_max, at distinct points inside [cut_lo, cut_hi] of its length; other documents stay whole;
    the tally counts the same."""
    from anchor_core.data.packing import ChunkTally, chunk_cuts

    rng = np.random.default_rng(7)
    C = 9001
    lengths = np.concatenate([rng.integers(1, 3000, 3000), [63, 64, 2048, 2049]])
    seg, starts, w, used = [], [], 0, 0
    for n in lengths:  # documents inside windows of C slots; a window's rest is padding
        if used + n > C:
            seg.append(np.full(C - used, -1, np.int32))
            used = 0
        starts.append(sum(map(len, seg)) + 0)
        seg.append(np.full(n, len(starts), np.int32))
        used += n
    seg.append(np.full((C - used) % C, -1, np.int32))
    seg = np.concatenate(seg)
    new_doc = np.ones(seg.size, dtype=bool)
    np.not_equal(seg[1:], seg[:-1], out=new_doc[1:])
    new_doc[::C] = True
    layout = Layout(interleave=True, chunks_max=chunks_max, chunk_cut_lo=cut[0], chunk_cut_hi=cut[1])
    tally = ChunkTally()
    cuts = chunk_cuts(new_doc, seg, layout, np.random.default_rng(1), tally)
    ks = []
    for s0, n in zip(starts, lengths):
        inner = np.flatnonzero(cuts[s0 + 1:s0 + n]) + 1  # cut offsets inside the document
        assert cuts[s0]
        if 64 <= n <= 2048:
            assert 1 <= inner.size <= chunks_max - 1, (n, inner)
            assert inner.min() >= np.ceil(cut[0] * n - 1e-9) and inner.max() <= np.floor(cut[1] * n + 1e-9), (n, inner)
            ks.append(inner.size + 1)
        else:
            assert inner.size == 0, (n, inner)
    counts = np.bincount(ks, minlength=chunks_max + 1)[2:]
    print("documents per chunk count 2..", chunks_max, counts.tolist())
    share = counts / counts.sum()
    assert np.all(np.abs(share - 1 / (chunks_max - 1)) < 0.06)  # uniform over 2..chunks_max (~1300 draws)
    assert tally.docs_in_range == len(ks) and tally.docs == len(lengths)
    assert tally.cut_in_range == {k: int(c) for k, c in zip(range(2, chunks_max + 1), counts) if c}


def test_chunking_refuses_a_range_without_room():
    with pytest.raises(InputError, match="chunks_max - 1 = 4"):
        Layout(interleave=True, chunk_doc_min=4, chunks_max=5).check()
    with pytest.raises(InputError, match="chunk_cut_lo"):
        Layout(interleave=True, chunk_cut_lo=0.9, chunk_cut_hi=0.1).check()


def test_interleave_does_interleave():
    docs = [[10 + i] * 30 for i in range(4)]
    store = TokenStore.from_docs(docs, [0] * 4, ["d"])
    tok, seg, _ = pack_all(store, np.arange(4), 128, None, interleave=True, mean_chunk=4, seed=1)
    changes = int((seg[0, 2:] != seg[0, 1:-1]).sum())
    print("document changes in the window:", changes)
    assert changes > 3  # more runs than documents: chunks of different documents alternate


@SETTINGS
@given(corpus=corpora(), T=st.integers(2, 40), use_tags=st.booleans(), interleave=st.booleans(),
       seed=st.integers(0, 50), variant=st.sampled_from(VARIANTS), mcl=st.booleans())
def test_batches_follow_contract(corpus, T, use_tags, interleave, seed, variant, mcl):
    docs, domains, ndom, tags = corpus
    store = TokenStore.from_docs(docs, domains, [f"d{i}" for i in range(ndom)])
    tok, seg, tag = pack_all(store, np.arange(len(docs)), T, tags if use_tags else None, interleave=interleave,
                             mean_chunk=3, seed=seed)
    b = make_batch(tok, seg, tag, variant, mask_cross_doc_loss=mcl)
    for arr in (b.tokens, b.doc_ids, b.positions, b.loss_mask):
        assert arr.dtype == np.int32 and arr.shape == tok.shape
    for w in range(len(tok)):
        rt, rd, rp, rl = ref_batch(tok[w], seg[w], tag[w], variant, mcl)
        assert b.tokens[w].tolist() == rt
        assert b.doc_ids[w].tolist() == rd
        assert b.positions[w].tolist() == rp
        assert b.loss_mask[w].tolist() == rl
    # the contract's invariants, stated directly
    assert (b.loss_mask[:, -1] == 0).all()
    assert (b.loss_mask[tag.astype(bool)] == 0).all()  # tag slots are never trained on
    assert (b.loss_mask[b.doc_ids < 0] == 0).all()
    if variant == "anchor":
        assert (b.doc_ids[:, 0] == 0).all() and (b.doc_ids[:, 1:] != 0).all()
        assert (b.loss_mask[:, 0] == 0).all()
    else:
        assert (b.doc_ids[:, 0] == 1).all() and (b.doc_ids != 0).all()
    if variant == "intra_doc_reset":
        for w in range(len(tok)):
            d = b.doc_ids[w]
            for k in set(d[d > 0].tolist()):
                assert b.positions[w][np.flatnonzero(d == k)[0]] == 0
    else:
        assert (b.positions == np.arange(T)).all()


@SETTINGS
@given(corpus=corpora(), T=st.integers(2, 40), variant=st.sampled_from(VARIANTS))
def test_positions_and_masks_agree_with_jaxref(corpus, T, variant):
    jv = pytest.importorskip("jaxref.variants")
    docs, domains, ndom, _ = corpus
    store = TokenStore.from_docs(docs, domains, [f"d{i}" for i in range(ndom)])
    tok, seg, tag = pack_all(store, np.arange(len(docs)), T, None, interleave=True, mean_chunk=3)
    b = make_batch(tok, seg, tag, variant)
    np.testing.assert_array_equal(b.positions, jv.positions(b.doc_ids, variant))


def test_variant_names_are_the_oracles():
    jv = pytest.importorskip("jaxref.variants")
    assert tuple(VARIANTS) == tuple(jv.VARIANTS)


def test_window_stats_reference():
    seg = np.array([[0, 1, 1, 2, 2, 2, -1, -1], [0, 1, 1, 1, 1, 1, 1, 1]])
    docs, cost = window_stats(seg)
    assert docs.tolist() == [2, 1]
    assert cost.tolist() == [(2 + 1) ** 2 + (3 + 1) ** 2, (7 + 1) ** 2]
