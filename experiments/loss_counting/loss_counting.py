"""How many more predictions the authors' loss counts than ours, at the paper's window length (issue 32 item 14).

    .venv/bin/python experiments/loss_counting/loss_counting.py [--seq-len 65536] [--windows 64]

Ours (`anchor_core.data.batch.make_batch`, variant `anchor`): inside each document every next-token prediction
counts, the last token's prediction of the document's EOS included; the anchor's prediction of document 1's
first token and every prediction whose target lies in another document are masked. The authors' flash path
(AnchorContext, a BOS before each document) counts besides, per document, the BOS -> first token prediction
and, at a document's end, the prediction of the next document's BOS: two per document boundary, at most
`2 x documents` extra predictions a window. This script packs windows of `--seq-len` slots from two length
distributions, counts ours with `make_batch` and the authors' as ours + 2 x documents - 1 per window, and
writes results/loss_counting.json beside it (a count: the same on every machine):

- `slimpajama_like`: document lengths log-normal (median 500 tokens, sigma 1.2, clipped to 5..200K), an
  assumption standing for SlimPajama's mix;
- `embedded`: the embedded corpus tokenized by SmolLM2's tokenizer (`default`), upsample_long mixture.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def count(store, selection, T: int, windows: int) -> dict:
    from anchor_core.data.batch import make_batch
    from anchor_core.data.packing import Packer

    packer = Packer(store, selection, T, first_token=1, eos=2)
    ours = extra = docs = n = 0
    for block in packer.blocks():
        b = make_batch(block.tokens, block.seg, block.tag, "anchor")
        full = (block.seg >= 0).all(axis=1)  # full windows only: the padded last one is not typical
        ours += int(b.loss_mask[full].sum())
        d = block.seg[full].max(axis=1).astype(np.int64)
        docs += int(d.sum())
        extra += int((2 * d - 1).sum())
        n += int(full.sum())
        if n >= windows:
            break
    return {"windows": n, "docs_per_window": docs / max(1, n), "ours": ours, "authors": ours + extra,
            "extra_share_of_ours": extra / max(1, ours)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--windows", type=int, default=64)
    a = ap.parse_args()
    from anchor_core.data.mixture import MixtureSpec, select_documents
    from anchor_core.data.store import TokenStore
    from anchor_core.machine import machine

    T = a.seq_len
    rng = np.random.default_rng(0)
    n_docs = int(a.windows * T / 1000 * 1.2)
    lengths = np.clip(rng.lognormal(np.log(500), 1.2, n_docs), 5, 200_000).astype(np.int64)
    store = TokenStore.from_docs([np.full(int(n), 7, np.uint32) for n in lengths], [0] * n_docs, ["slimpajama_like"])
    results = {"slimpajama_like": count(store, np.arange(n_docs), T, a.windows)}

    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus
    from anchor_core.data.pipeline import PackConfig, pack_corpus

    with tempfile.TemporaryDirectory() as tmp:
        write_default_corpus(Path(tmp) / "c")
        pack_corpus("default", Path(tmp) / "c" / CORPUS_FILE, Path(tmp) / "p",
                    PackConfig(seq_len=T, mixture=MixtureSpec("upsample_long", long_threshold=16384)))
        st = TokenStore.open(Path(tmp) / "p" / "store")
        sel = select_documents(st.length, st.domain, MixtureSpec("upsample_long", long_threshold=16384))
        results["embedded"] = count(st, sel, T, a.windows)
        del st
    out = {"seq_len": T, "variant": "anchor", "machine": machine(), "results": results}
    path = HERE / "results" / "loss_counting.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    for k, r in results.items():
        print(f"{k}: {r['windows']} windows, {r['docs_per_window']:.1f} documents each, authors count "
              f"{100 * r['extra_share_of_ours']:.3f}% more predictions than ours")


if __name__ == "__main__":
    main()
