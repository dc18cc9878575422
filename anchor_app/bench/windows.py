"""Document layouts to time: windows packed from a corpus, and synthetic length distributions.

A layout is `seg` int [n, T] as `anchor pack` writes it (0 at slot 0, documents 1, 2, … by first
appearance, -1 padding); `anchor.data.make_batch` turns it into each variant's doc_ids.

Corpus windows: the default corpus (or `--data`: a corpus file/folder or an `anchor pack` output)
packed with the model's tokenizer at each length, the original mixture; `n` windows evenly spread
over the pack. Tokenizing is done once: later lengths are packed from the first pack's token store.
Packs are cached under `cache_dir()/bench/` by source, model and length.

Synthetic distributions (document lengths in tokens, documents concatenated and cut at window
ends, the rest of a cut document opening the next window, as the packer does):
  slimpajama      log-normal, median 300 and sigma 1.3 (mean about 700): the short web-heavy mix
                  SlimPajama's token counts suggest (most documents far below 4K); an assumption,
                  stated in bench.json.
  long_upsampled  the same, with 1 document in 10 drawn log-uniform from 4K (T/2 if less) to 4T: a
                  mix upsampled towards long documents as the paper's training data (Fu et al. 2024).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from anchor.errors import InputError

SYNTHETIC = ("slimpajama", "long_upsampled")
DISTRIBUTIONS = ("corpus", *SYNTHETIC)
SLIMPAJAMA_MEDIAN, SLIMPAJAMA_SIGMA = 300.0, 1.3
LONG_SHARE, LONG_MIN = 0.1, 4096


def describe(dist: str) -> str:
    return {
        "corpus": "windows packed from the corpus (original mixture)",
        "slimpajama": f"log-normal document lengths, median {SLIMPAJAMA_MEDIAN:.0f}, sigma {SLIMPAJAMA_SIGMA}",
        "long_upsampled": f"as slimpajama, {LONG_SHARE:.0%} of documents log-uniform in [min({LONG_MIN}, T/2), 4T]",
    }[dist]


def _lengths(dist: str, T: int, rng: np.random.Generator, size: int) -> np.ndarray:
    L = np.exp(rng.normal(np.log(SLIMPAJAMA_MEDIAN), SLIMPAJAMA_SIGMA, size))
    if dist == "long_upsampled":
        long = rng.random(size) < LONG_SHARE
        L[long] = np.exp(rng.uniform(np.log(min(LONG_MIN, T / 2)), np.log(4 * T), int(long.sum())))
    return np.maximum(1, np.round(L)).astype(np.int64)


def synthetic_seg(dist: str, T: int, n: int, seed: int = 0) -> np.ndarray:
    """n windows of T slots from a synthetic length distribution: seg int32 [n, T]."""
    if dist not in SYNTHETIC:
        raise InputError(f"unknown distribution {dist!r} (known: {', '.join(DISTRIBUTIONS)})")
    rng = np.random.default_rng([seed, T])
    seg = np.zeros((n, T), dtype=np.int32)
    left = 0  # tokens of the current document not yet placed
    for w in range(n):
        slot, doc = 1, 0
        while slot < T:
            if left == 0:
                left = int(_lengths(dist, T, rng, 1)[0])
            take = min(left, T - slot)
            doc += 1
            seg[w, slot:slot + take] = doc
            slot += take
            left -= take
    return seg


def _pack_key(source: str, model: str) -> str:
    return hashlib.sha256(f"{Path(source).resolve() if Path(source).exists() else source}|{model}".encode()).hexdigest()[:16]


def corpus_source(data: str | None = None, progress: bool = False) -> str:
    """`data`, or the default corpus's JSONL (written under the cache once)."""
    from anchor.data.corpus import write_default_corpus
    from anchor.paths import cache_dir

    if data is None:
        corpus = cache_dir() / "bench" / "corpus"
        if not (corpus / "corpus.jsonl").is_file():
            write_default_corpus(corpus, progress=progress)
        return str(corpus / "corpus.jsonl")
    if not Path(data).exists():
        raise InputError("no such file or folder", path=data)
    return str(data)


def corpus_pack(T: int, *, model: str = "default", data: str | None = None, progress: bool = False) -> Path:
    """The `anchor pack` folder of `data` (None: the default corpus) at T slots, cached."""
    from anchor.data.packed import is_pack_output
    from anchor.data.pipeline import PackConfig, pack_corpus
    from anchor.paths import cache_dir

    source = corpus_source(data, progress)
    root = cache_dir() / "bench"
    key = _pack_key(source, model)
    out = root / f"pack-{key}-{T}"
    if not is_pack_output(out):
        earlier = sorted(p for p in root.glob(f"pack-{key}-*") if is_pack_output(p))
        pack_corpus(model, earlier[0] if earlier else source, out, PackConfig(seq_len=T), progress=progress)
    return out


def corpus_seg(T: int, n: int, *, model: str = "default", data: str | None = None, progress: bool = False) -> np.ndarray:
    """n windows of T slots packed from `data` (None: the default corpus), evenly spread over the
    pack's windows without padding: seg int32 [n', T], n' = min(n, such windows)."""
    from anchor.data.packed import PackedData

    packed = PackedData.open(corpus_pack(T, model=model, data=data, progress=progress))
    if packed.num_windows == 0:
        raise InputError(f"the corpus holds less than one window of {T} tokens", path=data or "the default corpus")
    # Windows without padding (a pack's last window is usually part padding, which no step trains on
    # at full length); all windows where none is complete.
    full = np.flatnonzero(np.concatenate([(np.asarray(s) >= 0).all(axis=1) for s in packed.seg]))
    pool = full if full.size else np.arange(packed.num_windows)
    idx = pool[np.unique(np.linspace(0, pool.size - 1, min(n, pool.size)).round().astype(np.int64))]
    return packed.windows(idx)[1].astype(np.int32)


def layout_seg(dist: str, T: int, n: int, *, model: str = "default", data: str | None = None, seed: int = 0,
               progress: bool = False) -> np.ndarray:
    """The windows of one distribution (DISTRIBUTIONS)."""
    if dist == "corpus":
        return corpus_seg(T, n, model=model, data=data, progress=progress)
    return synthetic_seg(dist, T, n, seed)


def doc_lengths(seg: np.ndarray) -> list[list[int]]:
    """Per window, its documents' lengths in slots (anchor and padding excluded)."""
    out = []
    for row in np.asarray(seg):
        c = np.bincount(row[row > 0])
        out.append([int(x) for x in c[c > 0]])
    return out
