"""`anchor pack --config FILE`: the YAML schema of a data configuration (configs/data/*.yaml).

Every key is optional and mirrors an `anchor pack` option of the same name (dashes become
underscores); an option given on the command line wins over the file. Unknown keys and wrong
types are InputErrors naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anchor_core.data.mixture import MIXTURES
from anchor_core.data.packing import Layout
from anchor_core.errors import InputError
from anchor_core.limits import check_float, check_int, check_seed, option_name
from anchor_core.shipped import resolve
from anchor_core.yamlfile import read_yaml_mapping

# key -> (accepted types, what it is)
PACK_SCHEMA: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "HF folder, .gguf file, random:<preset> or default"),
    "data": ((str,), "corpus file or folder, or a token store"),
    "seq_len": ((int,), "slots per window T"),
    "mixture": ((str,), f"one of {', '.join(MIXTURES)}"),
    "budget": ((int, type(None)), "tokens to select (documents with their EOS); null: the whole source"),
    "long_threshold": ((int,), "documents longer than this many tokens are long"),
    "upsample_factor": ((int, float), "upsample_long: short documents kept with 1 / factor; upsample_repeat: copies of each long one per pass"),
    "tags": ((bool,), "precede each document by its domain tag"),
    "interleave": ((bool,), "interleave document chunks inside windows"),
    "chunk_doc_min": ((int,), "interleave: documents of at least this many slots in a window are cut"),
    "chunk_doc_max": ((int,), "interleave: and of at most this many"),
    "chunks_max": ((int,), "interleave: into 2 to this many chunks"),
    "chunk_cut_lo": ((int, float), "interleave: cuts at or after this fraction of the document's length"),
    "chunk_cut_hi": ((int, float), "interleave: cuts at or before this fraction of the document's length"),
    "mean_chunk": ((int,), "interleave: > 0 cuts every document before each slot with probability 1/mean_chunk instead (0: the chunk_* keys)"),
    "seed": ((int,), "seed of the mixture and the interleaving"),
    "skip_bad": ((bool,), "skip and count bad records"),
    "text_field": ((str,), "dotted path of the text"),
    "domain_field": ((str, type(None)), "dotted path of the domain; null: auto"),
}


# key -> its `anchor pack` flag
PACK_FLAGS: dict[str, str] = {key: "--" + key.replace("_", "-") for key in PACK_SCHEMA}

MAX_UPSAMPLE_FACTOR = 1000.0  # copies of a long document per pass: beyond this one pass outgrows memory
MAX_SEQ_LEN = 1 << 31  # slots per window: int32 positions


def check_pack_options(opts: dict[str, Any], origin: dict[str, str] | None = None, *,
                       names: dict[str, str] | None = None) -> None:
    """Ranges of the size and seed options (from the command line or, per `origin`, a config file);
    InputError naming the flag, or the file and key, or `names[key]` (a train config's `pack.budget`)."""
    origin = origin or {}

    def name(key: str) -> str:
        if names is not None:
            return names.get(key, key)
        return option_name(key, PACK_FLAGS[key], origin.get(key))

    if "seq_len" in opts:
        check_int(opts["seq_len"], name("seq_len"), lo=2, hi=MAX_SEQ_LEN)
    if opts.get("budget") is not None:
        check_int(opts["budget"], name("budget"), lo=1)
    check_int(opts.get("long_threshold", 4096), name("long_threshold"), lo=1)
    check_float(opts.get("upsample_factor", 4.0), name("upsample_factor"), lo=1.0, hi=MAX_UPSAMPLE_FACTOR)
    check_int(opts.get("mean_chunk", 0), name("mean_chunk"), lo=0, hi=MAX_SEQ_LEN)
    for key in ("chunk_doc_min", "chunk_doc_max", "chunks_max"):
        if key in opts:
            check_int(opts[key], name(key), lo=2, hi=MAX_SEQ_LEN)
    for key in ("chunk_cut_lo", "chunk_cut_hi"):
        if key in opts:
            check_float(opts[key], name(key), lo=0.0, hi=1.0)
    try:
        layout_of(opts).check()
    except InputError as e:
        where = sorted({origin[k] for k in LAYOUT_CHUNK_KEYS if k in origin})
        raise InputError(str(e), path=where[0] if where else None) from None
    check_seed(opts.get("seed", 0), name("seed"))
    if opts.get("mixture", "original") not in MIXTURES:
        raise InputError(f"{name('mixture')}: unknown mixture {opts['mixture']!r} (known: {', '.join(MIXTURES)})")
    for key in ("text_field",):
        if not str(opts.get(key, "text")).strip():
            raise InputError(f"{name(key)}: empty")


LAYOUT_CHUNK_KEYS = ("chunk_doc_min", "chunk_doc_max", "chunks_max", "chunk_cut_lo", "chunk_cut_hi", "mean_chunk")


def layout_of(opts: dict[str, Any], *, tags: bool | None = None, interleave: bool | None = None):
    """The packing Layout of pack options (`anchor pack`'s, or a train config's `data.pack:` mapping, whose
    `tags`/`interleave` come from its `data` section)."""
    chunking = {k: opts[k] for k in LAYOUT_CHUNK_KEYS if opts.get(k) is not None}
    for k in ("chunk_cut_lo", "chunk_cut_hi"):
        if k in chunking:
            chunking[k] = float(chunking[k])
    return Layout(tags=bool(opts.get("tags", False) if tags is None else tags),
                  interleave=bool(opts.get("interleave", False) if interleave is None else interleave), **chunking)


def validate_pack_config(d: Any, *, source: str = "config") -> dict[str, Any]:
    """Check a mapping against PACK_SCHEMA; returns it as a plain dict."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise InputError("a data config must be a mapping of option names to values", path=source)
    out = {}
    for key, value in d.items():
        if key not in PACK_SCHEMA:
            raise InputError(f"unknown key {key!r} (known: {', '.join(PACK_SCHEMA)})", path=source)
        types, what = PACK_SCHEMA[key]
        if isinstance(value, bool) and bool not in types:
            raise InputError(f"{key}: expected {what}, got {value!r}", path=source)
        if not isinstance(value, types):
            raise InputError(f"{key}: expected {what}, got {value!r}", path=source)
        out[key] = value
    return out


def load_pack_config(path: str | Path) -> dict[str, Any]:
    """Read and validate a data config YAML file, or a shipped one by name (`demo`, `slimpajama_64k`)."""
    path = resolve("data", path)
    return validate_pack_config(read_yaml_mapping(path, what="data config"), source=str(path))
