"""Perplexity per length on held-out packed windows, beside RULER.

    windows = heldout_windows(tok, seq_len=4096, n_windows=8)       # PackedData of 8 windows of 4096
    r = perplexity(model, windows, variant="full")                   # r.ppl, r.nll, r.tokens, r.buckets
    long = heldout_windows(tok, 16384, 8, whole_documents=True)      # one long held-out document per window

Legend: W windows, B windows per forward, T slots per window, H hidden size, V vocabulary.

Windows are packed exactly as training windows (docs/DESIGN.md §1, `anchor_core.data.packing.Packer`: documents
with their EOS back to back, the first token at slot 0, cut at T), and the loss of a window is the
trainer's (`anchor_core.data.batch.make_batch` for the variant, `torchtrain.next_token_loss`): the
prediction at slot t of token t+1 counts where `loss_mask[t]` is 1. Perplexity of a length is
`exp(mean NLL over every counted target of its windows)`: cross-entropy in float32 from the model's
logits (bf16 models included), sums accumulated in float64.

By position. `buckets` splits the same sums by the position id of the predicting slot: bucket k holds
the predictions made at positions [k b, (k + 1) b) (b = `bucket`, 2048 by default; the target sits one
position further), each with its counted targets and mean NLL, up to the window's length. The buckets'
NLLs weighted by their targets average back to `nll`. In packed windows under `full` a position is the
slot; with `whole_documents` (below) every window is one document, so a position is the position in
the document: the loss against context length.

Held-out text. The embedded default corpus (`anchor corpus`) has no held-out split: `anchor train
data=corpus` trains on all of it. What its builder leaves out on purpose are the standard library's
test suites (folders `test`, `tests`, `idle_test`; `anchor_core.data.corpus.SKIP_DIRS`), so their modules
are Python source of the corpus' `code` domain that a model trained on the default corpus has never
seen. `heldout_windows(data=None)` reads them in a fixed shuffled order (seed 0) until the windows are
full, so a shorter length packs a prefix of the same stream as a longer one. The perplexity is then
the code domain's; `data=` names held-out text of one's own instead (any corpus `anchor pack` reads,
a token store, or an `anchor pack` output, whose documents are repacked at the length asked for): all
of its documents count as held out. A Python built without its test suite (Debian's
`libpython3-testsuite` missing) gives a one-line InputError asking for `data=`.

Long documents. `heldout_windows(..., whole_documents=True)` packs nothing: each window is the first
token and the first T - 1 tokens of one held-out document at least that long (shorter documents are
skipped, in the same fixed order), so every slot's position is its position in a document that
continues past the window; too few such documents are a one-line InputError.
"""

from __future__ import annotations

import functools
import math
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from anchor_core.data.packed import PackedData, is_pack_output, pack_store_path
from anchor_core.data.packing import Packer
from anchor_core.data.readers import iter_documents
from anchor_core.data.store import TokenStore, is_store
from anchor_core.errors import InputError
from anchor_core.progress import ProgressBar
from anchor_core.tokenizer import Tok
from anchor_core.variants import Variant, check_variant
from torchtrain.attention.engines import engine_of
from torchtrain.model.loss import token_cross_entropy

HELDOUT_DIRS = ("test", "tests", "idle_test")  # left out of the default corpus (anchor_core.data.corpus.SKIP_DIRS)
HELDOUT_SEED = 0
LOGIT_CHUNK_ELEMENTS = 1 << 25  # float32 logits computed at once (128 MiB): bounds memory at long T
_READ_BATCH = 32  # held-out files tokenized per call


# ---------------------------------------------------------------------------------------------
# Held-out windows


@functools.cache
def heldout_files(seed: int = HELDOUT_SEED) -> tuple[Path, ...]:
    """The standard library's test-suite modules (held out from the default corpus), in a fixed
    shuffled order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        folders = set(p.relative_to(root).parts[:-1])
        if folders & set(HELDOUT_DIRS) and not folders & {"site-packages", "dist-packages"}:
            files.append(p)
    files.sort()
    order = np.random.default_rng(seed).permutation(len(files))
    return tuple(files[i] for i in order)


def _read_text(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):  # the test suite keeps deliberately mis-encoded files
        return None
    return text if text.strip() else None


def _stdlib_texts(seed: int) -> Iterator[list[str]]:
    files = heldout_files(seed)
    if not files:
        root = sysconfig.get_paths()["stdlib"]
        raise InputError(f"no held-out text: this Python has no test suite under {root} (the default corpus' "
                         "held-out part); pass held-out documents with data=")
    for i in range(0, len(files), _READ_BATCH):
        yield [t for p in files[i:i + _READ_BATCH] if (t := _read_text(p))]


def _data_texts(data: Path) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in iter_documents(data):
        batch.append(doc.text)
        if len(batch) == _READ_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def heldout_windows(tok: Tok, seq_len: int, n_windows: int, data: str | Path | None = None, *,
                    seed: int = HELDOUT_SEED, whole_documents: bool = False) -> PackedData:
    """`n_windows` full windows of `seq_len` slots packed from held-out documents (module docstring).

    Args:
      tok: the model's tokenizer (anchor_core.tokenizer.load_tokenizer).
      seq_len: T, slots per window (>= 2).
      n_windows: W >= 1.
      data: held-out documents (a corpus, a token store or an `anchor pack` output); None: the
        standard library's test suites.
      seed: the order of the standard library's files.
      whole_documents: one document per window, each at least T - 1 tokens long, cut to the window
        (no packing): positions are positions in the document.
    Returns:
      PackedData of W windows (tokens uint32, seg int32, tag uint8, each [W, T]; no tags, no padding);
      meta holds `seq_len`, `source` and the tokenizer's identity.
    """
    if seq_len < 2 or n_windows < 1:
        raise InputError(f"held-out windows need seq_len >= 2 and n_windows >= 1, got {seq_len} and {n_windows}")
    need = n_windows * (seq_len - 1)  # stream slots: every window but its slot 0
    source = "stdlib test suites" if data is None else str(data)
    if whole_documents:
        return _long_document_windows(tok, seq_len, n_windows, data, seed, source)
    store = _store_of(Path(data), tok) if data is not None and (is_store(data) or is_pack_output(data)) else None
    if store is not None:
        cum = np.cumsum(store.length + 1)
        selection = np.arange(min(store.num_docs, int(np.searchsorted(cum, need)) + 1))
        have = int(cum[-1]) if store.num_docs else 0
    else:
        docs: list[list[int]] = []
        have = 0
        for texts in _stdlib_texts(seed) if data is None else _data_texts(Path(data)):
            for ids in tok.encode_batch(texts) if texts else []:
                if ids:
                    docs.append(ids)
                    have += len(ids) + 1
            if have >= need:
                break
        store = TokenStore.from_docs(docs, [0] * len(docs), ["heldout"])
        selection = np.arange(len(docs))
    if have < need:
        raise InputError(f"the held-out text holds {have} tokens; {n_windows} windows of {seq_len} need {need}",
                         path=source)
    packer = Packer(store, selection, seq_len, first_token=tok.first_token_id, eos=tok.eos_id)
    block = packer.block(0, n_windows)
    return PackedData.from_arrays(block.tokens, block.seg, block.tag, source=source, tokenizer=tok.identity)


def _long_document_windows(tok: Tok, seq_len: int, n_windows: int, data: str | Path | None, seed: int,
                           source: str) -> PackedData:
    """`heldout_windows(whole_documents=True)`: the first `n_windows` held-out documents of at least T - 1
    tokens, in the stream's order, each cut to one window (first token, then the document's first T - 1)."""
    T = seq_len
    docs: list[np.ndarray] = []
    seen = 0
    if data is not None and (is_store(data) or is_pack_output(data)):
        store = _store_of(Path(data), tok)
        for i in range(store.num_docs):
            seen += 1
            if store.length[i] >= T - 1:
                docs.append(np.asarray(store.doc(i)[:T - 1]))
                if len(docs) == n_windows:
                    break
    else:
        for texts in _stdlib_texts(seed) if data is None else _data_texts(Path(data)):
            for ids in tok.encode_batch(texts) if texts else []:
                seen += 1
                if len(ids) >= T - 1:
                    docs.append(np.asarray(ids[:T - 1]))
            if len(docs) >= n_windows:
                break
    if len(docs) < n_windows:
        raise InputError(f"the held-out text holds {len(docs)} documents of at least {T - 1} tokens (of {seen}); "
                         f"{n_windows} windows of {T} from whole documents need {n_windows}", path=source)
    W = n_windows
    tokens = np.empty((W, T), dtype=np.uint32)
    tokens[:, 0] = tok.first_token_id
    tokens[:, 1:] = np.stack(docs[:W])
    seg = np.ones((W, T), dtype=np.int32)
    seg[:, 0] = 0
    return PackedData.from_arrays(tokens, seg, np.zeros((W, T), dtype=np.uint8), source=source,
                                  tokenizer=tok.identity, whole_documents=True)


def _store_of(data: Path, tok: Tok) -> TokenStore:
    path = pack_store_path(data) if is_pack_output(data) else data
    return TokenStore.open(path, expect_identity=tok.identity)


# ---------------------------------------------------------------------------------------------
# Perplexity


DEFAULT_BUCKET = 2048  # positions per bucket of `Perplexity.buckets`


@dataclass(frozen=True)
class Perplexity:
    """Perplexity of one length: `ppl = exp(nll)`, `nll` the mean over `tokens` counted targets;
    `buckets` the same by position of the predicting slot (module docstring): one dict per bucket of
    `bucket` positions with counted targets, `start`, `end` (exclusive), `tokens` and `nll`."""

    seq_len: int
    variant: str
    windows: int
    tokens: int
    nll: float
    ppl: float
    bucket: int = DEFAULT_BUCKET
    buckets: tuple[dict[str, float | int], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["buckets"] = [dict(b) for b in self.buckets]
        return d


def perplexity(model: nn.Module, windows: PackedData, variant: Variant = "full", *, batch_size: int = 1,
               mask_cross_doc_loss: bool = False, bucket: int = DEFAULT_BUCKET, progress: bool = False) -> Perplexity:
    """Perplexity of `model` over every window of `windows` under `variant` (module docstring).

    The decoder runs once per batch through the model's torchtrain engine; the lm-head and the
    cross-entropy run in chunks of slots, so the [B, T, V] logits never exist at once.

    Args:
      model: a torchtrain model (`anchor.eval.generate.load_eval_model`, `torchtrain.build_model`).
      windows: packed windows of one length (`heldout_windows`, or an `anchor pack` output).
      variant: the attention variant and loss masking (docs/DESIGN.md §1-§2).
      batch_size: windows per forward.
      mask_cross_doc_loss: in `full`, also leave out predictions whose target is in another document.
      bucket: positions per bucket of `buckets` (module docstring).
      progress: a progress bar over the windows.
    """
    variant = check_variant(variant)
    if engine_of(model) is None:
        raise InputError("perplexity needs a torchtrain model "
                         "(anchor.eval.generate.load_eval_model or torchtrain.build_model)")
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise InputError(f"bucket must be an integer >= 1, got {bucket!r}")
    W, T = windows.num_windows, windows.seq_len
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    device = head.weight.device
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // (batch_size * head.weight.shape[0]))
    total, count = 0.0, 0
    n_buckets = -(-T // bucket)
    bucket_nll = torch.zeros(n_buckets, dtype=torch.float64, device=device)  # sums of NLL per bucket
    bucket_count = torch.zeros(n_buckets, dtype=torch.float64, device=device)
    bar = ProgressBar(f"perplexity T={T}", W, progress, unit="windows")
    try:
        with torch.inference_mode():
            for w0 in range(0, W, batch_size):
                batch = windows.batch(np.arange(w0, min(W, w0 + batch_size)), variant,
                                      mask_cross_doc_loss=mask_cross_doc_loss)
                tokens_BT = torch.as_tensor(batch.tokens, dtype=torch.long, device=device)
                counted_BT = torch.as_tensor(batch.loss_mask, device=device)[:, :-1].bool()  # slot t predicts t+1
                positions_BT = torch.as_tensor(batch.positions, dtype=torch.long, device=device)
                hidden_BTH = decoder(input_ids=tokens_BT, position_ids=positions_BT, variant=variant,
                                     doc_ids=torch.as_tensor(batch.doc_ids, device=device),
                                     use_cache=False).last_hidden_state
                for s in range(0, T - 1, chunk):
                    e = min(T - 1, s + chunk)
                    logits = head(hidden_BTH[:, s:e]).float()  # [B, e-s, V]
                    ce = token_cross_entropy(logits, tokens_BT[:, s + 1:e + 1])
                    counted = counted_BT[:, s:e]
                    ce_counted = ce[counted].double()
                    total += float(ce_counted.sum())
                    where = (positions_BT[:, s:e][counted] // bucket).clamp_(0, n_buckets - 1)
                    bucket_nll += torch.bincount(where, weights=ce_counted, minlength=n_buckets)
                    bucket_count += torch.bincount(where, minlength=n_buckets).double()
                count += int(counted_BT.sum())
                bar.advance(tokens_BT.shape[0])
    finally:
        bar.close()
    if count == 0:
        raise InputError(f"no counted targets in {W} windows of {T} (variant {variant})")
    nll = total / count
    sums, counts = bucket_nll.cpu().tolist(), bucket_count.cpu().tolist()
    buckets = tuple({"start": k * bucket, "end": min(T, (k + 1) * bucket), "tokens": int(c), "nll": x / c}
                    for k, (x, c) in enumerate(zip(sums, counts)) if c > 0)
    return Perplexity(seq_len=T, variant=variant, windows=W, tokens=count, nll=nll, ppl=math.exp(nll),
                      bucket=bucket, buckets=buckets)
