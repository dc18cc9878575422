"""Tokenizers for every way a model can be named (docs/DESIGN.md §6), without torch.

    tok = load_tokenizer("default")            # the cached SmolLM2 GGUF
    ids = tok.encode_batch(["a text", "another"])   # list[list[int]], no special tokens added
    tok.bos_id, tok.eos_id, tok.first_token_id, tok.vocab_size, tok.identity

Model names:
  DIR               a local Hugging Face directory with `tokenizer.json` (BOS/EOS from
                    `tokenizer_config.json`, else `config.json`)
  FILE.gguf         a GGUF file: a `tokenizers.Tokenizer` is built from its `tokenizer.ggml.*`
                    metadata exactly as transformers' `AutoTokenizer.from_pretrained(dir,
                    gguf_file=...)` builds it (gpt2-style byte-level BPE); the result is cached
                    under `cache_dir()/tokenizers/<sha256 of the file>.json`
  random:<preset>   a byte-level tokenizer: 0 unk, 1 bos, 2 eos, 3 + byte (259 ids, which fit the
                    presets' vocabulary of 331); no BOS where the preset has none (qwen2, qwen3)
  default, smollm2  the embedded default model (`anchor_core.paths.resolve_model_name`)

`identity` is a sha256 over the vocabulary, the merges and the special tokens: a token store
records it, and a store built with another tokenizer is rejected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from anchor_core.atomic import sha256_file
from anchor_core.errors import InputError
from anchor_core.gguf_file import read_gguf_file
from anchor_core.paths import cache_dir, resolve_model_name
from anchor_core.spec import random_preset

BYTE_OFFSET = 3  # random:<preset> tokenizers: id = BYTE_OFFSET + byte
BYTE_UNK, BYTE_BOS, BYTE_EOS = 0, 1, 2

# Pre-tokenizer splits transformers applies for these `tokenizer.ggml.pre` values
# (transformers/integrations/gguf/gguf_tokenizer_mapping.py); any other value keeps GPT-2's
# ByteLevel regex, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
}
_GGUF_CACHE_VERSION = 1  # bump when the GGUF -> tokenizer.json construction changes


class Tok(Protocol):
    """What the data pipeline needs from a tokenizer."""

    bos_id: int | None
    eos_id: int
    vocab_size: int
    identity: str
    name: str

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added; batched over all cores."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def first_token_id(self) -> int:
        """The token at slot 0 of every window (docs/DESIGN.md §1): BOS, else EOS."""
        ...


@dataclass(frozen=True)
class HFTok:
    """A `tokenizers.Tokenizer` with the special ids the data pipeline needs."""

    tokenizer: Any  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int
    identity: str
    name: str

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def first_token_id(self) -> int:
        return self.eos_id if self.bos_id is None else self.bos_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        fast = getattr(self.tokenizer, "encode_batch_fast", None)  # no offsets: faster
        encs = (fast or self.tokenizer.encode_batch)(texts, add_special_tokens=False)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


@dataclass(frozen=True)
class ByteTok:
    """Byte-level tokenizer of the `random:<preset>` models: 0 unk, 1 bos, 2 eos, 3 + byte."""

    bos_id: int | None
    eos_id: int
    name: str

    vocab_size: int = BYTE_OFFSET + 256

    @property
    def identity(self) -> str:
        special = {"unk": BYTE_UNK, "bos": self.bos_id, "eos": self.eos_id}
        return _sha256_json({"kind": "bytes", "offset": BYTE_OFFSET, "special": special})

    @property
    def first_token_id(self) -> int:
        return self.eos_id if self.bos_id is None else self.bos_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # `bytes` -> list of ints is C speed; adding the offset via numpy keeps it vectorised.
        out = []
        for t in texts:
            b = np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64)
            out.append((b + BYTE_OFFSET).tolist())
        return out

    def decode(self, ids: Sequence[int]) -> str:
        parts = []
        for i in ids:
            i = int(i)
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                parts.append(bytes([i - BYTE_OFFSET]))
            else:  # a special id, or one of a random preset's ids beyond the 259 it encodes to
                parts.append({BYTE_BOS: b"<s>", BYTE_EOS: b"</s>"}.get(i, b"<unk>"))
        return b"".join(parts).decode("utf-8", errors="replace")


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_identity(tokenizer: Any) -> str:
    """sha256 of a `tokenizers.Tokenizer`'s vocabulary, merges and special (added) tokens."""
    d = json.loads(tokenizer.to_str())
    model = d.get("model", {})
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        vocab = sorted(vocab.items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    added = sorted(
        (a["id"], a["content"], bool(a.get("special"))) for a in d.get("added_tokens") or []
    )
    return _sha256_json({"type": model.get("type"), "vocab": vocab, "merges": merges, "added": added})


def load_tokenizer(model: str) -> Tok:
    """The tokenizer of a model named as in docs/DESIGN.md §6; unknown names and formats are InputErrors."""
    name = resolve_model_name(model)
    if name.startswith("random:"):
        spec = random_preset(name.split(":", 1)[1])
        return ByteTok(bos_id=spec.bos_token_id, eos_id=spec.eos_token_id, name=model)
    path = Path(name)
    if path.is_dir():
        return _load_hf_dir(path, model)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, model)
    if path.is_file():
        raise InputError("unsupported model format (expected a Hugging Face directory, a .gguf file "
                         "or random:<preset>)", path=path)
    raise InputError("no such model (expected a Hugging Face directory, a .gguf file, "
                     "random:<preset> or `default`)", path=model)


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def _token_id(tokenizer: Any, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        return None
    return tokenizer.token_to_id(value)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"unreadable JSON: {e}", path=path) from None
    if not isinstance(d, dict):
        raise InputError(f"expected a JSON object, got {type(d).__name__}", path=path)
    return d


def _load_hf_dir(path: Path, name: str) -> HFTok:
    from tokenizers import Tokenizer

    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise InputError("this model directory has no tokenizer.json", path=path)
    try:
        tokenizer = Tokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise InputError(f"unreadable tokenizer: {str(e).splitlines()[0] if str(e) else e}", path=tj) from None
    tcfg = _read_json(path / "tokenizer_config.json")
    cfg = _read_json(path / "config.json")
    bos = (_token_id(tokenizer, tcfg.get("bos_token")) if "bos_token" in tcfg
           else _config_token_id(cfg, "bos_token_id", path / "config.json"))
    eos = _token_id(tokenizer, tcfg.get("eos_token")) if tcfg.get("eos_token") is not None else None
    if eos is None:
        eos = _config_token_id(cfg, "eos_token_id", path / "config.json")
    if cfg.get("model_type") in ("qwen2", "qwen3"):
        bos = None  # Qwen has no BOS: slot 0 holds EOS (anchor_core.spec.from_hf_config)
    if eos is None:
        raise InputError("cannot tell the EOS token (no eos_token in tokenizer_config.json or "
                         "eos_token_id in config.json)", path=path)
    size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    for what, i in (("BOS", bos), ("EOS", eos)):
        if i is not None and not 0 <= i < size:
            raise InputError(f"the {what} token id {i} is outside the tokenizer's {size} tokens", path=path)
    return HFTok(tokenizer=tokenizer, bos_id=bos, eos_id=eos,
                 identity=tokenizer_identity(tokenizer), name=name)


def _config_token_id(cfg: dict[str, Any], key: str, path: Path) -> int | None:
    """A `config.json` token id as transformers reads it: null or an integer; `eos_token_id` also a list
    (the first counts; [] is null)."""
    v = cfg.get(key)
    if isinstance(v, list) and key != "eos_token_id":
        raise InputError(f"{key}: expected null or an integer, got {v!r}", path=path)
    if isinstance(v, list):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise InputError(f"{key}: expected null, an integer or a list of integers, got {v!r}", path=path)
        v = v[0] if v else None
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise InputError(f"{key}: expected null, an integer or a list of integers, got {v!r}", path=path)
    return v


# ---------------------------------------------------------------------------------------------
# GGUF files


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def gguf_tokenizer_json(path: Path) -> tuple[str, dict[str, Any]]:
    """`(tokenizer.json text, {"bos_id", "eos_id", "architecture"})` built from a GGUF's metadata.

    Mirrors transformers' `byte_level_tokenizer` + `add_gguf_special_tokens` + `set_split_regex`
    (integrations/gguf/gguf_tokenizer_mapping.py): BPE over the byte-level alphabet, no unk, tokens
    of type 3 (control) added as special tokens and type 4 (user-defined) as plain added tokens.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers


    try:
        reader = read_gguf_file(path)
    except (ValueError, OSError) as e:
        raise InputError(f"not a readable GGUF file: {e}", path=path) from None

    def field(key: str, default: Any = None) -> Any:
        return reader.fields.get(key, default)

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InputError(f"unsupported GGUF tokenizer {kind!r} (supported: gpt2-style byte-level BPE)", path=path)
    tokens: list[str] = field("tokenizer.ggml.tokens") or []
    merges: list[str] = field("tokenizer.ggml.merges") or []
    types: list[int] = field("tokenizer.ggml.token_type") or []
    if not tokens or not merges:
        raise InputError("the GGUF file has no tokenizer vocabulary or merges", path=path)

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab[key] = i  # a later duplicate wins, as in transformers' dict comprehension
    pairs = [tuple(m.split(" ")) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, unk_token=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    split = _GGUF_SPLITS.get(field("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet]
    if control:
        tokenizer.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == 4 and t in vocab]
    if user:
        tokenizer.add_tokens(user)

    arch = field("general.architecture")
    bos = field("tokenizer.ggml.bos_token_id")
    eos = field("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise InputError("the GGUF file names no EOS token (tokenizer.ggml.eos_token_id)", path=path)
    if arch in ("qwen2", "qwen3"):
        bos = None  # Qwen has no BOS: slot 0 holds EOS (anchor_core.spec.from_hf_config)
    meta = {"bos_id": None if bos is None else int(bos), "eos_id": int(eos), "architecture": arch}
    return tokenizer.to_str(), meta


def gguf_tokenizer_cached(path: Path) -> tuple[str, dict[str, Any]]:
    """`gguf_tokenizer_json`, cached on disk by the file's sha256 (reading a GGUF takes seconds)."""
    digest = sha256_file(path)
    folder = cache_dir() / "tokenizers"
    cached = folder / f"gguf-{digest[:32]}-v{_GGUF_CACHE_VERSION}.json"
    if cached.is_file():
        try:
            d = json.loads(cached.read_text(encoding="utf-8"))
            return d["tokenizer"], d["meta"]
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is rebuilt below
    text, meta = gguf_tokenizer_json(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"tokenizer": text, "meta": meta}), encoding="utf-8")
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only cache only costs speed
    return text, meta


def _load_gguf(path: Path, name: str) -> HFTok:
    st = path.stat()
    tok = _gguf_tok(str(path.resolve()), st.st_mtime_ns, st.st_size)
    return tok if tok.name == name else dataclasses.replace(tok, name=name)


@lru_cache(maxsize=8)
def _gguf_tok(path_str: str, mtime_ns: int, size: int) -> HFTok:
    from tokenizers import Tokenizer

    text, meta = gguf_tokenizer_cached(Path(path_str))
    tokenizer = Tokenizer.from_str(text)
    return HFTok(tokenizer=tokenizer, bos_id=meta["bos_id"], eos_id=meta["eos_id"],
                 identity=tokenizer_identity(tokenizer), name=path_str)
