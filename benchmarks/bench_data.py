"""Data-pipeline throughput: tokenization against raw `tokenizers`, packing and batch making.

    .venv/bin/python benchmarks/bench_data.py [--name cpu] [--model default] [--tokens 32000000]

Writes results/data/data_<name>.json with the machine (platform, cores, versions; no torch).

- tokenization: the default corpus (the standard library, docs, prose), in the batches the token
  store writes. `raw` is `tokenizers.Tokenizer.encode_batch` on the same batches; `tok` is
  `Tok.encode_batch` (which calls `encode_batch_fast`, no offsets; `raw_fast` is that call on
  its own); `store` is the whole `write_store` (tokenize, flatten, append to the file,
  index). Ratios are throughput against raw (target >= 0.9). Each is the best of `--repeats`
  alternating runs, since the machine is shared.
- packing: a synthetic store (log-normal document lengths), `Packer.blocks()` into windows of T,
  with and without tags / interleaving, plus writing the shards; tokens (slots) per second.
- batches: `make_batch` for each variant over [B, T] windows; slots per second.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from anchor_core.data.batch import VARIANTS, make_batch  # noqa: E402
from anchor_core.data.corpus import default_corpus_documents  # noqa: E402
from anchor_core.data.packed import ShardWriter  # noqa: E402
from anchor_core.data.packing import Layout, Packer  # noqa: E402
from anchor_core.data.readers import Document  # noqa: E402
from anchor_core.data.store import BATCH_CHARS, TokenStore, document_batches, write_store  # noqa: E402
from anchor_core.machine import machine  # noqa: E402
from anchor_core.tokenizer import load_tokenizer  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_tokenization(model: str, max_chars: int, repeats: int) -> dict:
    tok = load_tokenizer(model)
    docs, chars = [], 0
    for r in default_corpus_documents():
        docs.append(Document(r["text"], r["domain"], r["source"]))
        chars += len(r["text"])
        if chars >= max_chars:
            break
    batches = [[d.text for d in b] for b in document_batches(docs, BATCH_CHARS)]
    raw = getattr(tok, "tokenizer", None)
    n_tokens = sum(len(x) for b in batches for x in tok.encode_batch(b))
    out = {"model": model, "docs": len(docs), "chars": chars, "tokens": n_tokens, "batches": len(batches)}

    def run_raw():
        for b in batches:
            raw.encode_batch(b, add_special_tokens=False)

    def run_raw_fast():
        for b in batches:
            raw.encode_batch_fast(b, add_special_tokens=False)

    def run_tok():
        for b in batches:
            tok.encode_batch(b)

    def run_store():
        with tempfile.TemporaryDirectory() as tmp:
            write_store(iter(docs), tok, Path(tmp) / "s")

    results: dict[str, list[float]] = {"raw": [], "raw_fast": [], "tok": [], "store": []}
    for _ in range(repeats):  # interleaved, so background load hits all alike
        if raw is not None:
            results["raw"].append(best(run_raw, 1))
            if hasattr(raw, "encode_batch_fast"):
                results["raw_fast"].append(best(run_raw_fast, 1))
        results["tok"].append(best(run_tok, 1))
        results["store"].append(best(run_store, 1))
    for k, v in results.items():
        if v:
            out[f"{k}_seconds"] = min(v)
            out[f"{k}_tokens_per_s"] = n_tokens / min(v)
    if raw is not None:
        out["tok_vs_raw"] = out["tok_tokens_per_s"] / out["raw_tokens_per_s"]
        out["store_vs_raw"] = out["store_tokens_per_s"] / out["raw_tokens_per_s"]
    if results["raw_fast"]:
        out["tok_vs_raw_fast"] = out["tok_tokens_per_s"] / out["raw_fast_tokens_per_s"]
        out["store_vs_raw_fast"] = out["store_tokens_per_s"] / out["raw_fast_tokens_per_s"]
    return out


def synthetic_store(n_tokens: int, seed: int = 0) -> TokenStore:
    rng = np.random.default_rng(seed)
    lengths = []
    total = 0
    while total < n_tokens:
        chunk = np.maximum(1, rng.lognormal(6.5, 1.3, 100_000).astype(np.int64))
        lengths.append(chunk)
        total += int(chunk.sum())
    length = np.concatenate(lengths)
    length = length[: int(np.searchsorted(np.cumsum(length), n_tokens)) + 1]
    offset = np.zeros_like(length)
    offset[1:] = np.cumsum(length)[:-1]
    tokens = rng.integers(3, 49152, int(length.sum()), dtype=np.uint32)
    domain = rng.integers(0, 4, length.size).astype(np.int32)
    return TokenStore(tokens, offset, length, domain, ["a", "b", "c", "d"])


def bench_packing(store: TokenStore, T: int, repeats: int, tags: bool, interleave: bool) -> dict:
    selection = np.random.default_rng(1).permutation(store.num_docs)
    tag_tokens = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]] if tags else None

    def run():
        p = Packer(store, selection, T, first_token=1, eos=2, tag_tokens=tag_tokens, layout=Layout(interleave=interleave))
        for _ in p.blocks():
            pass
        return p

    p = run()
    secs = best(run, repeats)
    slots = p.num_windows * T
    return {"seq_len": T, "tags": tags, "interleave": interleave, "windows": p.num_windows, "slots": slots,
            "seconds": secs, "tokens_per_s": slots / secs}


def bench_pack_and_write(store: TokenStore, T: int, repeats: int) -> dict:
    selection = np.random.default_rng(1).permutation(store.num_docs)

    def run():
        p = Packer(store, selection, T, first_token=1, eos=2)
        with tempfile.TemporaryDirectory() as tmp:
            w = ShardWriter(Path(tmp), T, p.num_windows)
            for b in p.blocks():
                w.write(b.tokens, b.seg, b.tag)
            w.close_shard()
        return p

    p = run()
    secs = best(run, repeats)
    return {"seq_len": T, "windows": p.num_windows, "slots": p.num_windows * T, "seconds": secs,
            "tokens_per_s": p.num_windows * T / secs}


def bench_batches(store: TokenStore, T: int, B: int, repeats: int, interleave: bool) -> dict:
    p = Packer(store, np.arange(store.num_docs), T, first_token=1, eos=2, tag_tokens=None, layout=Layout(interleave=interleave))
    block = next(p.blocks(B * (T - 1)))
    tokens, seg, tag = block.tokens[:B], block.seg[:B], block.tag[:B]
    out = {"seq_len": T, "batch": tokens.shape[0], "interleave": interleave}
    for variant in VARIANTS:
        secs = best(lambda: make_batch(tokens, seg, tag, variant), repeats)
        out[variant] = {"seconds": secs, "tokens_per_s": tokens.size / secs}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--name", default="cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokenize-chars", type=int, default=4_000_000)
    ap.add_argument("--tokens", type=int, default=32_000_000, help="synthetic store size for packing")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    result = {"name": args.name, "machine": machine(rayon_threads=os.environ.get("RAYON_NUM_THREADS")), "targets": {"tok_vs_raw": 0.9, "pack_tokens_per_s": 20e6}}
    print("tokenization ...", flush=True)
    result["tokenization"] = bench_tokenization(args.model, args.tokenize_chars, args.repeats)
    print(json.dumps(result["tokenization"], indent=1), flush=True)
    store = synthetic_store(args.tokens)
    result["synthetic_store"] = {"docs": store.num_docs, "tokens": store.num_tokens,
                                 "mean_doc_tokens": store.num_tokens / store.num_docs}
    result["packing"] = []
    for T, tags, inter in [(4096, False, False), (65536, False, False), (131072, False, False),
                           (65536, True, False), (65536, False, True)]:
        print(f"packing T={T} tags={tags} interleave={inter} ...", flush=True)
        result["packing"].append(bench_packing(store, T, args.repeats, tags, inter))
        print(json.dumps(result["packing"][-1]), flush=True)
    print("packing + writing shards ...", flush=True)
    result["pack_and_write"] = bench_pack_and_write(store, 65536, args.repeats)
    print(json.dumps(result["pack_and_write"]), flush=True)
    result["batches"] = []
    for T, B, inter in [(4096, 64, False), (65536, 8, False), (65536, 8, True)]:
        print(f"batches T={T} B={B} interleave={inter} ...", flush=True)
        result["batches"].append(bench_batches(store, T, B, args.repeats, inter))
        print(json.dumps(result["batches"][-1]), flush=True)
    out = ROOT / "results" / "data" / f"data_{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
