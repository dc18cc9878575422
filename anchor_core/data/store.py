"""The token store: every document tokenized once, in a memory-mapped file.

Layout of a store folder:
  tokens.bin     uint32 [N]: the documents' tokens back to back (no EOS: it is added at packing)
  docs.npz       offset int64 [D], length int64 [D], domain int32 [D] (index into `domains`)
  store.json     tokenizer identity and name, special ids, domains, read/skip counts

    store = build_store(iter_documents(path), load_tokenizer("default"), out_dir)
    store = TokenStore.open(out_dir, expect_identity=tok.identity)
    store.doc(7)  # uint32 tokens of document 7 (a view into the memmap)

Writing streams: documents are tokenized in batches (the tokenizer uses both cores) and appended
to the file, so neither the corpus nor the token file has to fit in memory. The folder is written
under a temporary name and renamed when complete.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from anchor_core.data.readers import Document, ReadCounts
from anchor_core.atomic import publish, staging_dir
from anchor_core.errors import InputError, read_json_object
from anchor_core.tokenizer import Tok

STORE_FORMAT = 1
TOKEN_DTYPE = np.uint32
BATCH_CHARS = 4_000_000  # characters per tokenizer call: big enough to keep both cores busy


@dataclass
class TokenStore:
    """A read-only view of a store folder (or of in-memory arrays, for tests)."""

    tokens: np.ndarray  # uint32 [N]
    offset: np.ndarray  # int64 [D]
    length: np.ndarray  # int64 [D]
    domain: np.ndarray  # int32 [D]
    domains: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_docs(self) -> int:
        return int(self.length.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.length.sum())

    @property
    def identity(self) -> str | None:
        return self.meta.get("tokenizer", {}).get("identity")

    def doc(self, i: int) -> np.ndarray:
        o = int(self.offset[i])
        return self.tokens[o:o + int(self.length[i])]

    @classmethod
    def from_docs(cls, docs: list[list[int]] | list[np.ndarray], domains: list[int], domain_names: list[str],
                  meta: dict[str, Any] | None = None) -> "TokenStore":
        """An in-memory store of already tokenized documents (tests, benchmarks)."""
        length = np.array([len(d) for d in docs], dtype=np.int64)
        offset = np.zeros_like(length)
        if len(length):
            offset[1:] = np.cumsum(length)[:-1]
        flat = np.concatenate([np.asarray(d, dtype=TOKEN_DTYPE) for d in docs]) if docs else np.zeros(0, TOKEN_DTYPE)
        return cls(flat, offset, length, np.asarray(domains, dtype=np.int32), list(domain_names), meta or {})

    def max_token_id(self) -> int:
        """The largest token id in the store (-1 when empty); a pass over the token file in chunks."""
        top = -1
        step = 1 << 24
        for i in range(0, int(self.tokens.shape[0]), step):
            top = max(top, int(self.tokens[i:i + step].max()))
        return top

    @classmethod
    def open(cls, folder: str | Path, *, expect_identity: str | None = None) -> "TokenStore":
        """Open and validate a store folder: every file inside it, the index consistent with the token
        file (offsets monotone, documents within it, domains known); an InputError names the problem."""
        folder = Path(folder)
        meta_path = folder / "store.json"
        if not meta_path.is_file():
            raise InputError("not a token store (no store.json)", path=folder)
        _inside(folder, STORE_FILES)
        meta = read_json_object(meta_path, name=folder)
        if meta.get("format") != STORE_FORMAT:
            raise InputError(f"token store format {meta.get('format')!r} is not {STORE_FORMAT}", path=folder)
        tokenizer = meta.get("tokenizer")
        if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("identity"), str):
            raise InputError("`tokenizer.identity` is missing", path=meta_path)
        domains = meta.get("domains")
        if not isinstance(domains, list) or not all(isinstance(d, str) for d in domains):
            raise InputError("`domains` must be a list of names", path=meta_path)
        n = meta.get("num_tokens")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InputError(f"`num_tokens` must be a count, got {n!r}", path=meta_path)
        if expect_identity is not None and tokenizer["identity"] != expect_identity:
            raise InputError(
                f"this token store was built with another tokenizer ({tokenizer.get('name')}, "
                f"identity {tokenizer['identity'][:12]}) than the model's (identity {expect_identity[:12]})",
                path=folder,
            )
        docs = folder / "docs.npz"
        try:
            with np.load(docs, allow_pickle=False) as z:
                offset, length, domain = z["offset"], z["length"], z["domain"]
        except (OSError, ValueError, KeyError, EOFError) as e:
            raise InputError(f"unreadable document index: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                             path=docs) from None
        tokens_path = folder / "tokens.bin"
        try:
            size = tokens_path.stat().st_size
        except OSError as e:
            raise InputError(f"cannot read the token file: {e.strerror or e}", path=tokens_path) from None
        _check_index(offset, length, domain, n, len(domains), size, docs, tokens_path)
        tokens = (np.memmap(tokens_path, dtype=TOKEN_DTYPE, mode="r", shape=(n,)) if n
                  else np.zeros(0, TOKEN_DTYPE))
        return cls(tokens, offset.astype(np.int64), length.astype(np.int64), domain.astype(np.int32),
                   list(domains), meta)


STORE_FILES = ("store.json", "docs.npz", "tokens.bin")


def _inside(folder: Path, names: Iterable[str]) -> None:
    """Each file must resolve inside `folder` (no symbolic link out of it)."""
    root = folder.resolve()
    for name in names:
        p = (folder / name).resolve()
        if root not in p.parents:
            raise InputError(f"{name} points outside the folder (to {p})", path=folder)


def _check_index(offset: np.ndarray, length: np.ndarray, domain: np.ndarray, num_tokens: int, num_domains: int,
                 size: int, docs: Path, tokens_path: Path) -> None:
    for name, a in (("offset", offset), ("length", length), ("domain", domain)):
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise InputError(f"`{name}` must be a 1-D integer array, got {a.dtype} {a.shape}", path=docs)
    if not offset.shape == length.shape == domain.shape:
        raise InputError(f"offset, length and domain differ in size ({offset.size}, {length.size}, {domain.size})",
                         path=docs)
    if size != num_tokens * np.dtype(TOKEN_DTYPE).itemsize:
        raise InputError(f"the token file holds {size} bytes, store.json says {num_tokens} tokens "
                         f"({num_tokens * np.dtype(TOKEN_DTYPE).itemsize} bytes)", path=tokens_path)
    if offset.size == 0:
        return
    off, ln = offset.astype(np.int64), length.astype(np.int64)
    if (ln < 0).any() or (off < 0).any():
        raise InputError("negative document offsets or lengths", path=docs)
    if (np.diff(off) < ln[:-1]).any():
        i = int(np.flatnonzero(np.diff(off) < ln[:-1])[0])
        raise InputError(f"document offsets are not increasing (document {i + 1} starts at {off[i + 1]}, "
                         f"inside document {i})", path=docs)
    end = int(off[-1] + ln[-1])
    if end > num_tokens:
        raise InputError(f"documents run to token {end}, past the end of the token file ({num_tokens} tokens)",
                         path=docs)
    if num_domains == 0 or int(domain.min()) < 0 or int(domain.max()) >= num_domains:
        raise InputError(f"domain indices outside the {num_domains} domains of store.json", path=docs)


def is_store(path: str | Path) -> bool:
    return (Path(path) / "store.json").is_file()


def document_batches(docs: Iterable[Document], max_chars: int) -> Iterator[list[Document]]:
    """`docs` in consecutive lists, each closed once its texts reach `max_chars` characters (the last
    one may hold fewer): the unit `write_store` tokenizes at once."""
    batch: list[Document] = []
    chars = 0
    for d in docs:
        batch.append(d)
        chars += len(d.text)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def write_store(docs: Iterable[Document], tok: Tok, folder: Path, *, counts: ReadCounts | None = None,
                progress: bool = False, batch_chars: int = BATCH_CHARS, source: object = None) -> dict[str, Any]:
    """Tokenize `docs` into a store at `folder` (which must not exist yet); returns store.json's dict.

    Zero documents is an InputError (naming `source`, the corpus). Documents that tokenize to nothing
    are skipped and counted.
    """
    counts = counts if counts is not None else ReadCounts()
    domain_ids: dict[str, int] = {}
    offsets: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    doms: list[np.ndarray] = []
    total = 0
    folder.mkdir(parents=True)
    bar = _progress(progress)
    with open(folder / "tokens.bin", "wb") as f:
        for batch in document_batches(docs, batch_chars):
            ids = tok.encode_batch([d.text for d in batch])
            lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
            keep = lens > 0
            counts.skipped["no_tokens"] += int((~keep).sum())
            if not keep.all():
                ids = [x for x, k in zip(ids, keep) if k]
                batch = [d for d, k in zip(batch, keep) if k]
                lens = lens[keep]
            if not len(ids):
                continue
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=TOKEN_DTYPE, count=int(lens.sum()))
            f.write(flat.tobytes())
            starts = np.zeros_like(lens)
            starts[1:] = np.cumsum(lens)[:-1]
            offsets.append(starts + total)
            lengths.append(lens)
            doms.append(np.array([domain_ids.setdefault(d.domain, len(domain_ids)) for d in batch], dtype=np.int32))
            total += int(lens.sum())
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    if not lengths:
        skipped = ", ".join(f"{v} {k}" for k, v in sorted(counts.skipped.items()) if v) or "none skipped"
        raise InputError(f"no documents to tokenize ({skipped})", path=source)
    meta = {
        "format": STORE_FORMAT,
        "num_docs": int(sum(len(x) for x in lengths)),
        "num_tokens": total,
        "domains": list(domain_ids),
        "tokenizer": {"name": tok.name, "identity": tok.identity, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                      "vocab_size": tok.vocab_size},
        "read": counts.to_dict(),
    }
    np.savez(folder / "docs.npz", offset=np.concatenate(offsets), length=np.concatenate(lengths),
             domain=np.concatenate(doms))
    (folder / "store.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return meta


def build_store(docs: Iterable[Document], tok: Tok, out: str | Path, *, counts: ReadCounts | None = None,
                progress: bool = False) -> TokenStore:
    """`write_store` into a temporary sibling of `out`, renamed to `out` only when complete."""
    out = Path(out)
    with staging_dir(out, "store") as tmp:
        write_store(docs, tok, tmp / "store", counts=counts, progress=progress)
        publish(tmp / "store", out, "store")
    return TokenStore.open(out)


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit=" docs", desc="tokenizing", mininterval=0.5, leave=False)
