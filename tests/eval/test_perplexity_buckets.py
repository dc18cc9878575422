"""Held-out NLL by position bucket (anchor.eval.perplexity): on a tiny model the buckets' means, weighted by
their counted targets, average back to the overall NLL; each bucket's mean equals the per-target cross-entropy
at those positions computed by hand; whole-document windows are one long document each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anchor_core.errors import InputError
from anchor_core.tokenizer import load_tokenizer
from anchor.eval import perplexity as ppl
from anchor.eval.generate import load_eval_model
from anchor.eval.perplexity import heldout_files, heldout_windows, perplexity
from torchtrain.model.loss import token_cross_entropy

torch.set_num_threads(1)  # shared cores

NAME = "random:qwen2"


@pytest.fixture(scope="module")
def model():
    return load_eval_model(NAME, engine="sdpa", dtype="float32")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of uneven lengths, some longer than a window."""
    import json

    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "anchor", "attention", "rope", "window"]
    path = tmp_path_factory.mktemp("heldout") / "docs.jsonl"
    with open(path, "w") as f:
        for n in rng.integers(2, 60, size=40).tolist() + [80, 90, 120]:
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=n))}) + "\n")
    return path


@pytest.mark.parametrize("variant", ["full", "intra_doc_reset"])
def test_buckets_average_back_to_the_nll(model, corpus, variant, monkeypatch):
    tok = load_tokenizer(NAME)
    windows = heldout_windows(tok, 100, 4, data=corpus)
    monkeypatch.setattr(ppl, "LOGIT_CHUNK_ELEMENTS", 2 * 331 * 13)  # buckets cut across lm-head chunks
    r = perplexity(model, windows, variant, batch_size=2, bucket=32)
    print(r.nll, [(b["start"], b["tokens"], round(b["nll"], 4)) for b in r.buckets])
    assert [(b["start"], b["end"]) for b in r.buckets] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert sum(b["tokens"] for b in r.buckets) == r.tokens
    assert sum(b["nll"] * b["tokens"] for b in r.buckets) / r.tokens == pytest.approx(r.nll, rel=1e-12)
    # by hand: the cross-entropy of every counted target, grouped by the predicting slot's position id
    b = windows.batch(np.arange(4), variant)
    tokens = torch.as_tensor(b.tokens).long()
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=torch.as_tensor(b.positions).long(),
                       doc_ids=torch.as_tensor(b.doc_ids), variant=variant).logits
    ce = token_cross_entropy(logits[:, :-1].float(), tokens[:, 1:]).double().numpy()
    counted = b.loss_mask[:, :-1].astype(bool)
    where = b.positions[:, :-1][counted] // 32
    for k, got in enumerate(r.buckets):
        assert got["tokens"] == int((where == k).sum())
        assert got["nll"] == pytest.approx(float(ce[counted][where == k].mean()), rel=1e-6)
    assert r.as_dict()["buckets"][0] == dict(r.buckets[0])
    with pytest.raises(InputError, match="bucket must be an integer >= 1"):
        perplexity(model, windows, variant, bucket=0)


def test_whole_document_windows(corpus):
    tok = load_tokenizer(NAME)
    w = heldout_windows(tok, 64, 3, data=corpus, whole_documents=True)
    tokens, seg, tag = w.windows(np.arange(3))
    assert tokens.shape == (3, 64) and (tokens[:, 0] == tok.first_token_id).all()
    assert (seg[:, 0] == 0).all() and (seg[:, 1:] == 1).all() and not tag.any()  # one document per window
    docs = [ids for ids in tok.encode_batch([line for line in _texts(corpus)]) if len(ids) >= 63]
    assert [tokens[i, 1:].tolist() for i in range(3)] == [d[:63] for d in docs[:3]]  # the first long ones, in order
    with pytest.raises(InputError, match="documents of at least 999 tokens"):
        heldout_windows(tok, 1000, 2, data=corpus, whole_documents=True)
    if heldout_files():  # the standard library's test suites hold long modules
        long = heldout_windows(tok, 2048, 2, whole_documents=True)
        assert long.num_windows == 2 and (long.windows(np.arange(2))[1][:, 1:] == 1).all()


def _texts(path):
    import json

    return [json.loads(x)["text"] for x in path.read_text().splitlines()]
