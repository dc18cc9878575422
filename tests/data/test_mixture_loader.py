"""Mixtures keep domain shares and upsample long documents; the loader is deterministic, resumable, sharded."""

from __future__ import annotations

import json

import numpy as np
import pytest

from anchor_core.data.batch import make_batch
from anchor_core.data.mixture import MixtureSpec, mixture_table, select_documents
from anchor_core.data.packed import Loader, PackedData
from anchor_core.errors import InputError


def synthetic(seed=0):
    """Three domains with different length profiles; long = more than 800 tokens."""
    rng = np.random.default_rng(seed)
    lengths, domains = [], []
    for d, (n, p_long) in enumerate([(300, 0.1), (200, 0.4), (120, 0.7)]):
        long = rng.random(n) < p_long
        lengths.append(np.where(long, rng.integers(801, 3000, n), rng.integers(20, 400, n)))
        domains.append(np.full(n, d))
    return np.concatenate(lengths), np.concatenate(domains)


@pytest.mark.parametrize("factor", [2.0, 3.5])
def test_upsample_long_samples_without_repeats_and_moves_the_domains(factor):
    """Long documents kept, short ones with probability 1/factor within each domain, none
    repeated while the pool lasts; the long share rises as expected and the domains' shares move towards
    the domains richer in long documents (c: 70% long, a: 10%)."""
    length, domain = synthetic()
    spec = MixtureSpec("upsample_long", long_threshold=800, upsample_factor=factor, seed=3)
    sel = select_documents(length, domain, spec)
    table = mixture_table(length, domain, ["a", "b", "c"], sel, spec)
    assert np.bincount(sel, minlength=length.size).max() == 1
    assert set(np.flatnonzero(length > 800)) <= set(sel.tolist())
    for name, row in table.items():
        print(name, {k: round(v, 4) for k, v in row.items()})
        assert row["repeated_docs"] == 0
        assert row["long_share"] > row["source_long_share"]
        assert abs(row["long_share"] - row["expected_long_share"]) < 0.02
        short_kept = row["docs"] - int(((length > 800) & (domain == "abc".index(name))).sum())
        short_all = row["source_docs"] - int(((length > 800) & (domain == "abc".index(name))).sum())
        assert short_kept == round(short_all / factor)
    assert table["a"]["token_ratio"] < table["a"]["source_token_ratio"]
    assert table["c"]["token_ratio"] > table["c"]["source_token_ratio"]


def test_upsample_long_budget_uses_the_pool_before_repeating():
    length, domain = synthetic()
    total = int((length + 1).sum())
    spec = MixtureSpec("upsample_long", long_threshold=800, upsample_factor=3, seed=2, budget=total - 5000)
    copies = np.bincount(select_documents(length, domain, spec), minlength=length.size)
    assert copies.max() == 1 and copies.sum() > 0.9 * length.size  # the unsampled short ones came next
    spec = MixtureSpec("upsample_long", long_threshold=800, upsample_factor=3, seed=2, budget=total + 5000)
    copies = np.bincount(select_documents(length, domain, spec), minlength=length.size)
    assert copies.min() == 1 and 1 <= int((copies == 2).sum()) < 0.1 * length.size  # repeats only past the pool


@pytest.mark.parametrize("factor", [2.0, 3.5])
def test_upsample_repeat_keeps_domain_shares(factor):
    length, domain = synthetic()
    spec = MixtureSpec("upsample_repeat", long_threshold=800, upsample_factor=factor, seed=3)
    sel = select_documents(length, domain, spec)
    table = mixture_table(length, domain, ["a", "b", "c"], sel, spec)
    for name, row in table.items():
        print(name, {k: round(v, 4) for k, v in row.items()})
        assert abs(row["token_ratio"] - row["source_token_ratio"]) < 0.01
        assert row["long_share"] > row["source_long_share"]
        assert abs(row["long_share"] - row["expected_long_share"]) < 0.05


def test_original_budget_multiples_take_whole_passes():
    length, domain = synthetic()
    total = int((length + 1).sum())
    for k in (1, 3):
        sel = select_documents(length, domain, MixtureSpec("original", budget=k * total, seed=k))
        assert (np.bincount(sel, minlength=length.size) == k).all()
    sel = select_documents(length, domain, MixtureSpec("original", budget=total // 10, seed=0))
    assert abs(int((length[sel] + 1).sum()) - total // 10) < 3 * 3000


def test_upsample_one_pass_counts_copies():
    length = np.array([10, 900, 50, 1000, 5])
    domain = np.zeros(5, dtype=int)
    long = length > 800
    one_pass = int(((length + 1) * np.where(long, 3, 1)).sum())
    sel = select_documents(length, domain, MixtureSpec("upsample_repeat", budget=one_pass, long_threshold=800,
                                                         upsample_factor=3))
    assert np.bincount(sel, minlength=5).tolist() == [1, 3, 1, 3, 1]


def test_selection_is_deterministic_per_seed():
    length, domain = synthetic()
    a = select_documents(length, domain, MixtureSpec("upsample_long", seed=5, long_threshold=800))
    b = select_documents(length, domain, MixtureSpec("upsample_long", seed=5, long_threshold=800))
    c = select_documents(length, domain, MixtureSpec("upsample_long", seed=6, long_threshold=800))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_bad_mixture_specs():
    with pytest.raises(InputError, match="unknown mixture"):
        MixtureSpec("longest")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="upsample factor"):
        MixtureSpec("upsample_long", upsample_factor=0.5)


def tiny_packed(W=23, T=8):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 100, (W, T)).astype(np.uint32)
    seg = np.tile(np.array([0, 1, 1, 1, 2, 2, 2, 2][:T], dtype=np.int32), (W, 1))
    tag = np.zeros((W, T), np.uint8)
    return PackedData.from_arrays(tokens, seg, tag)


def take(loader, n):
    return [loader.indices().tolist() for _ in range(n) if next(loader) is not None]


def test_loader_determinism_and_sharding():
    data = tiny_packed()
    ranks = [Loader(data, 2, "anchor", seed=7, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].steps_per_epoch == 5
    seen = []
    for _ in range(5):
        idx = [lo.indices().tolist() for lo in ranks]
        assert not set(idx[0]) & set(idx[1])
        seen += idx[0] + idx[1]
        for lo in ranks:
            next(lo)
    assert len(set(seen)) == 20
    again = Loader(data, 2, "anchor", seed=7, rank=0, world_size=2)
    first = [again.indices().tolist()]
    assert first[0] == seen[:2]
    other = Loader(data, 2, "anchor", seed=8, rank=0, world_size=2)
    assert other.indices().tolist() != first[0]


def test_loader_resume_exactly():
    data = tiny_packed()
    a = Loader(data, 3, "intra_doc_reset", seed=1)
    for _ in range(9):  # crosses the epoch boundary (7 steps per epoch)
        next(a)
    state = json.loads(json.dumps(a.state_dict()))
    b = Loader(data, 3, "intra_doc_reset", seed=1)
    b.load_state_dict(state)
    for _ in range(10):
        x, y = next(a), next(b)
        for k in ("tokens", "doc_ids", "positions", "loss_mask"):
            assert np.array_equal(getattr(x, k), getattr(y, k))
    # the same position seen by a different world size with the same global batch
    c = Loader(data, 2, "anchor", seed=1, rank=0, world_size=2)
    d = Loader(data, 4, "anchor", seed=1)
    for _ in range(2):
        next(c)
    d.load_state_dict(c.state_dict())
    assert d.indices()[:2].tolist() == c.indices().tolist()
    with pytest.raises(InputError, match="seed"):
        Loader(data, 3, "anchor", seed=2).load_state_dict(state)


def test_loader_batches_equal_make_batch():
    data = tiny_packed()
    lo = Loader(data, 4, "anchor", seed=0, mask_cross_doc_loss=True)
    idx = lo.indices()
    b = next(lo)
    t, s, g = data.windows(idx)
    ref = make_batch(t, s, g, "anchor")
    for k in ("tokens", "doc_ids", "positions", "loss_mask"):
        assert np.array_equal(getattr(b, k), getattr(ref, k))
    with pytest.raises(InputError, match="fewer than one global batch"):
        Loader(data, 16, "anchor", world_size=2)
    with pytest.raises(InputError, match="unknown attention variant"):
        Loader(data, 1, "sliding")  # type: ignore[arg-type]
