"""Document layouts to time: windows packed from a corpus, and synthetic length distributions.

A layout is `seg` int [n, T] as `anchor pack` writes it (0 at slot 0, documents 1, 2, … by first
appearance, -1 padding); `anchor_core.data.make_batch` turns it into each variant's doc_ids.

Corpus windows: the default corpus (or `--data`: a corpus file/folder or an `anchor pack` output)
packed with the model's tokenizer at each length, the original mixture; `n` windows evenly spread
over the pack. Tokenizing is done once: later lengths are packed from the first pack's token store.
Packs are cached under `cache_dir()/bench/` by source, model and length (`pack-<key>-<T>/`), the default
corpus under `cache_dir()/bench/corpus/`.

The cache is shared by every bench on the machine, running or killed (`cached_entry`): an entry is
built in a temporary sibling `.<entry>.tmp-<pid>-<random>/` and renamed into place whole; a process
that finishes second uses the first one's entry. An entry is used only when complete (its marker and
its main file: `pack.json`, `corpus.jsonl`); anything else at its path (a leftover of an older version
or of a copy cut short) is set aside and rebuilt. Temporary siblings whose process is gone are
removed by the next bench.

Synthetic distributions (document lengths in tokens, documents concatenated and cut at window
ends, the rest of a cut document opening the next window, as the packer does):
  slimpajama      log-normal, median 300 and sigma 1.3 (mean about 700): the short web-heavy mix
                  SlimPajama's token counts suggest (most documents far below 4K); an assumption,
                  stated in bench.json.
  long_upsampled  the same, with 1 document in 10 sampled log-uniform from 4K (T/2 if less) to 4T: a
                  mix upsampled towards long documents as the paper's training data (Fu et al. 2024).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from anchor_core.data.corpus import write_default_corpus
from anchor_core.data.packed import PackedData
from anchor_core.data.pipeline import PackConfig, pack_corpus
from anchor_core.errors import InputError
from anchor_core.outdir import pid_alive, read_marker, rmtree, staging_prefix
from anchor_core.paths import cache_dir

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


_TMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[^/]*$")


def remove_stale_temporaries(root: Path) -> None:
    """Remove the temporary siblings `.<entry>.tmp-<pid>-*` in `root` whose process is gone (a bench
    killed while building a cache entry)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = _TMP_RE.match(name)
        if m and not pid_alive(int(m.group("pid"))):
            rmtree(root / name)


def _locked(path: Path):
    """An exclusive flock on `path` (created if missing; never removed, so every process locks the same
    file), held until the returned file is closed; the kernel drops it when the process dies."""
    import fcntl

    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    except BaseException:
        f.close()
        raise
    return f


def cached_entry(entry: Path, complete: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """`entry`, a folder of the shared cache, built by `build(folder)` if it is not complete yet.

    The build goes to a temporary sibling `.<entry>.tmp-<pid>-<random>/` (other processes may build
    the same entry at the same time, each in its own), then is renamed into place under a lock held
    only for the rename: if another process's complete entry is there by then, it is used and this one
    dropped; an incomplete one (no marker or main file) is set aside and removed first. A complete
    entry is never replaced, so a process reading one is never disturbed.
    """
    if complete(entry):
        return entry
    root = entry.parent
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(root)
    tmp = Path(tempfile.mkdtemp(prefix=staging_prefix(entry), dir=root))
    try:
        built = tmp / entry.name
        build(built)
        with _locked(root / f".{entry.name}.cache-lock"):
            if complete(entry):  # another process finished first: use its entry
                return entry
            if entry.exists() or entry.is_symlink():  # incomplete: set aside (a tmp name: removed if we die)
                aside = root / f"{staging_prefix(entry)}incomplete-{secrets.token_hex(4)}"
                os.replace(entry, aside)
                rmtree(aside)
            os.replace(built, entry)
        return entry
    finally:
        rmtree(tmp)


def _complete(main_file: str, verb: str) -> Callable[[Path], bool]:
    def complete(folder: Path) -> bool:
        marker = read_marker(folder)
        return (folder / main_file).is_file() and marker is not None and marker["verb"] == verb
    return complete


pack_complete = _complete("pack.json", "pack")  # as `anchor pack` publishes it: the marker, then one rename
corpus_complete = _complete("corpus.jsonl", "corpus")


def corpus_source(data: str | None = None, progress: bool = False) -> str:
    """`data`, or the default corpus's JSONL (written under the cache once)."""
    if data is None:
        corpus = cached_entry(cache_dir() / "bench" / "corpus", corpus_complete,
                              lambda folder: write_default_corpus(folder, progress=progress))
        return str(corpus / "corpus.jsonl")
    if not Path(data).exists():
        raise InputError("no such file or folder", path=data)
    return str(data)


def corpus_pack(T: int, *, model: str = "default", data: str | None = None, progress: bool = False) -> Path:
    """The `anchor pack` folder of `data` (None: the default corpus) at T slots, cached."""
    source = corpus_source(data, progress)
    root = cache_dir() / "bench"
    key = _pack_key(source, model)

    def build(folder: Path) -> None:
        earlier = sorted(p for p in root.glob(f"pack-{key}-*") if pack_complete(p))  # its token store: no tokenizing
        pack_corpus(model, earlier[0] if earlier else source, folder, PackConfig(seq_len=T), progress=progress)

    return cached_entry(root / f"pack-{key}-{T}", pack_complete, build)


def corpus_seg(T: int, n: int, *, model: str = "default", data: str | None = None, progress: bool = False) -> np.ndarray:
    """n windows of T slots packed from `data` (None: the default corpus), evenly spread over the
    pack's windows without padding: seg int32 [n', T], n' = min(n, such windows)."""
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
