"""`anchor pack` as a function: read, tokenize, mix, pack, and report.

    stats = pack_corpus("default", "runs/corpus/corpus.jsonl", "runs/pack",
                        PackConfig(seq_len=4096, mixture=MixtureSpec("upsample_long", budget=2_000_000)))

Writes under `out` (via a temporary sibling folder renamed at the end, so an error leaves no
half-written output): the shards and `pack.json` (anchor_core.data.packed), the token store `store/`
(when `data` already is a token store, or a packed folder, its store is validated and hard-linked
(copied across file systems), so every packed folder is self-contained), `stats.json`, `stats.md`
and `doc_lengths.png`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from anchor_core.atomic import publish, staging_dir
from anchor_core.data.mixture import MixtureSpec, mixture_table, select_documents
from anchor_core.data.packed import PACK_FORMAT, SHARD_SLOTS, ShardWriter, is_pack_output, pack_store_path
from anchor_core.data.packing import Layout, Packer, tag_text, window_stats
from anchor_core.data.readers import ReadCounts, iter_documents
from anchor_core.data.store import STORE_FILES, TokenStore, is_store, write_store
from anchor_core.errors import InputError
from anchor_core.limits import check_disk, check_memory
from anchor_core.tokenizer import Tok, load_tokenizer
from anchor_core.weights import load_spec


@dataclass(frozen=True)
class PackConfig:
    seq_len: int
    mixture: MixtureSpec = field(default_factory=MixtureSpec)
    layout: Layout = field(default_factory=Layout)
    seed: int = 0  # interleaving; the mixture has its own seed
    text_field: str = "text"
    domain_field: str | None = None
    skip_bad: bool = False


def pack_corpus(model: str, data: str | Path, out: str | Path, cfg: PackConfig, *, progress: bool = False,
                tok: Tok | None = None, shard_slots: int = SHARD_SLOTS,
                names: dict[str, str] | None = None, data_name: str | None = None) -> dict[str, Any]:
    """Build the packed folder `out` from a corpus (or a token store) `data`; returns stats.json's dict.

    Steps: the token store (`_store_for`), the checks against the model's vocabulary and the disk,
    the mixture's selection, the windows written shard by shard (`_write_windows`), then pack.json
    (`_pack_meta`), stats.json (`_pack_stats`), stats.md and the figure. `shard_slots` bounds the
    slots per shard file. `names`: how errors name the options (default `anchor pack`'s flags; a train
    config passes its keys, `seq_len` and `pack.budget`). `data_name`: how stats.json names the data (default
    `data` itself; a caller that moves its input file after packing names where it will be).
    """
    names = {"seq_len": "--seq-len", "budget": "--budget", **(names or {})}
    t0 = time.perf_counter()
    check_pack_size(cfg.seq_len, names["seq_len"])
    tok = tok or load_tokenizer(model)
    vocab = _model_vocab(model, tok)
    out = Path(out)
    with staging_dir(out, "pack", inputs=(data, model)) as tmp:
        work = tmp / "pack"
        work.mkdir()
        store, counts_dict, source = _store_for(data, work / "store", tok, cfg, progress)
        check_vocab(store, tok, vocab, model, source)
        if cfg.mixture.budget is not None:
            check_disk(cfg.mixture.budget * 9 * cfg.seq_len / (cfg.seq_len - 1), tmp,
                       f"{names['budget']} {cfg.mixture.budget} (packed windows of {cfg.seq_len})", name=out)
        t_tok = time.perf_counter()
        selection = select_documents(store.length, store.domain, cfg.mixture)
        tag_tokens = _tag_tokens(store, tok, cfg, vocab, model)
        packer = Packer(store, selection, cfg.seq_len, first_token=tok.first_token_id, eos=tok.eos_id,
                        tag_tokens=tag_tokens, layout=cfg.layout, seed=cfg.seed)
        check_disk(packer.num_windows * cfg.seq_len * 9, tmp,
                   f"{packer.num_windows} windows of {cfg.seq_len} slots", name=out)
        writer = ShardWriter(work, cfg.seq_len, packer.num_windows, shard_slots)
        tally = _write_windows(packer, writer, progress)
        tally.chunks = packer.chunks.to_dict(cfg.layout) if cfg.layout.interleave else None
        t_pack = time.perf_counter()
        meta = _pack_meta(cfg, packer.num_windows, writer.shards, store, tok)
        stats = _pack_stats(model, data if data_name is None else data_name, cfg, meta, counts_dict, store,
                            selection, tally,
                            {"tokenize": round(t_tok - t0, 3), "pack": round(t_pack - t_tok, 3)})
        (work / "pack.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        (work / "stats.json").write_text(json.dumps(stats, indent=1), encoding="utf-8")
        (work / "stats.md").write_text(stats_markdown(stats), encoding="utf-8")
        plot_doc_lengths(store.length, selection, cfg, work / "doc_lengths.png")
        del store, packer, writer  # close the memmaps before the folder moves
        publish(work, out, "pack")
    return stats


def _store_for(data: str | Path, dest: Path, tok: Tok, cfg: PackConfig,
               progress: bool) -> tuple[TokenStore, dict[str, Any], Path]:
    """The token store of the packed folder, at `dest`: `data`'s own store when it is one (or a packed
    folder), validated against the tokenizer and hard-linked, else `data` read and tokenized.

    Returns (the store, opened; its read counts for stats.json; the source path `data` resolved to).
    """
    counts = ReadCounts()
    source = Path(data)
    if is_pack_output(source):  # an earlier `anchor pack` output: reuse its store
        source = pack_store_path(source)
    if is_store(source):
        TokenStore.open(source, expect_identity=tok.identity)  # validated before anything is linked
        link_store(source, dest)
        store = TokenStore.open(dest, expect_identity=tok.identity)
        return store, store.meta.get("read", {}), source
    docs = iter_documents(source, text_field=cfg.text_field, domain_field=cfg.domain_field,
                          skip_bad=cfg.skip_bad, counts=counts)
    write_store(docs, tok, dest, counts=counts, progress=progress, source=source)
    return TokenStore.open(dest), counts.to_dict(), source


def _tag_tokens(store: TokenStore, tok: Tok, cfg: PackConfig, vocab: int | None, model: str) -> list | None:
    """The token ids of each domain's tag (None when the layout has no tags), each within the model's
    vocabulary."""
    tag_tokens = tok.encode_batch([tag_text(d) for d in store.domains]) if cfg.layout.tags else None
    if tag_tokens is not None and vocab is not None:
        top = max((max(t) for t in tag_tokens if t), default=-1)
        if top >= vocab:
            raise InputError(f"a domain tag tokenizes to id {top}, beyond the vocabulary of the model "
                             f"({vocab} tokens)", path=model)
    return tag_tokens


@dataclass
class _WindowTally:
    """What the packed windows hold, summed while they are written."""

    docs_per_window: list[np.ndarray] = field(default_factory=list)  # per block: documents in each window
    cost: float = 0.0  # Σ over windows of the anchor variant's attention cost (packing.window_stats)
    tag_slots: int = 0
    pad_slots: int = 0
    chunks: dict[str, Any] | None = None  # with interleave: packing.ChunkTally.to_dict


def _write_windows(packer: Packer, writer: ShardWriter, progress: bool) -> _WindowTally:
    """Every block of windows `packer` makes, into the shards of `writer` (the last shard closed)."""
    tally = _WindowTally()
    bar = _bar(progress, packer.num_windows)
    for block in packer.blocks():
        writer.write(block.tokens, block.seg, block.tag)
        d, c = window_stats(block.seg)
        tally.docs_per_window.append(d)
        tally.cost += float(c.sum())
        tally.tag_slots += int(block.tag.sum())
        tally.pad_slots += int((block.seg < 0).sum())
        if bar is not None:
            bar.update(block.tokens.shape[0])
    if bar is not None:
        bar.close()
    writer.close_shard()
    return tally


def _pack_meta(cfg: PackConfig, num_windows: int, shards: list, store: TokenStore, tok: Tok) -> dict[str, Any]:
    """pack.json: what a reader of the packed folder needs (anchor_core.data.packed)."""
    return {
        "format": PACK_FORMAT,
        "seq_len": cfg.seq_len,
        "num_windows": num_windows,
        "shards": shards,
        "store": "store",
        "domains": store.domains,
        "tag_texts": [tag_text(d) for d in store.domains] if cfg.layout.tags else None,
        "first_token_id": tok.first_token_id,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "tokenizer": {"name": tok.name, "identity": tok.identity, "vocab_size": tok.vocab_size},
        "layout": asdict(cfg.layout),
        "mixture": asdict(cfg.mixture),
        "seed": cfg.seed,
    }


def _pack_stats(model: str, data: str | Path, cfg: PackConfig, meta: dict[str, Any], counts_dict: dict[str, Any],
                store: TokenStore, selection: np.ndarray, tally: _WindowTally,
                seconds: dict[str, float]) -> dict[str, Any]:
    """stats.json: the source, the mixture's selection per domain, the windows and the timings."""
    dpw = np.concatenate(tally.docs_per_window)
    T, W = cfg.seq_len, meta["num_windows"]
    return {
        "model": model,
        "data": str(data),
        "tokenizer": meta["tokenizer"],
        "read": counts_dict,
        "source": {"docs": store.num_docs, "tokens": store.num_tokens},
        "mixture": {**asdict(cfg.mixture), "selected_docs": int(selection.size),
                    "repeated_docs": int(selection.size - np.unique(selection).size),
                    "selected_tokens": int((store.length[selection] + 1).sum()), "tag_tokens": tally.tag_slots},
        "domains": mixture_table(store.length, store.domain, store.domains, selection, cfg.mixture),
        "layout": asdict(cfg.layout),
        "interleave": tally.chunks,
        "windows": {
            "seq_len": T,
            "count": W,
            "slots": W * T,
            "padding_slots": tally.pad_slots,
            "docs_per_window": {"mean": float(dpw.mean()), "median": float(np.median(dpw)),
                                "max": int(dpw.max())},
            "boundary_window_share": float((dpw >= 2).mean()),
        },
        "attention_compute_ratio_anchor_vs_full": tally.cost / (W * float(T) ** 2),
        "seconds": seconds,
    }


PACK_BYTES_PER_SLOT = 100  # packer memory per slot of a block (anchor_core.data.packing.BLOCK_SLOTS)


def check_pack_size(seq_len: int, name: str = "--seq-len") -> None:
    """Refuse a window length of which one window (the smallest packing block) cannot fit in memory."""
    check_memory(PACK_BYTES_PER_SLOT * seq_len, f"{name} {seq_len} (packing a window)")


def _model_vocab(model: str, tok: Tok) -> int | None:
    """The model's vocabulary size (its embedding rows), where the model can be read."""
    if model is None:
        return None
    return int(load_spec(model).vocab_size)


def check_vocab(store: TokenStore, tok: Tok, vocab: int | None, model: str, source: object) -> None:
    """Every token id the windows will hold must index the model's embedding."""
    if vocab is None:
        return
    for what, i in (("the first token", tok.first_token_id), ("EOS", tok.eos_id)):
        if not 0 <= int(i) < vocab:
            raise InputError(f"{what} id {i} is beyond the model's vocabulary ({vocab} tokens)", path=model)
    top = store.max_token_id()
    if top >= vocab:
        raise InputError(f"token id {top} is beyond the model's vocabulary ({vocab} tokens; the tokenizer has "
                         f"{tok.vocab_size}): the tokenizer and the model do not match", path=source)


def link_store(src: Path, dst: Path) -> None:
    """`dst` as a copy of the token store `src` (hard links where the file system allows)."""
    import os
    import shutil

    dst.mkdir()
    for name in STORE_FILES:
        try:
            os.link(src / name, dst / name)
        except OSError:
            shutil.copyfile(src / name, dst / name)


def _bar(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit=" windows", desc="packing", mininterval=0.5, leave=False)


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _upsampling(m: dict[str, Any]) -> str:
    if m["kind"] == "upsample_long":
        return f", short documents kept with probability 1/{m['upsample_factor']}"
    if m["kind"] == "upsample_repeat":
        return f", long documents copied x{m['upsample_factor']}"
    return ""


def _chunking(stats: dict[str, Any]) -> str:
    c, lay = stats.get("interleave"), stats["layout"]
    if not c:
        return ""
    rule = (f"cuts before each slot with probability 1/{lay['mean_chunk']}" if c["scheme"] == "mean_chunk" else
            f"documents of {lay['chunk_doc_min']}-{lay['chunk_doc_max']} slots cut into 2-{lay['chunks_max']} "
            f"chunks at {lay['chunk_cut_lo']:g}-{lay['chunk_cut_hi']:g} of their length")
    split = ", ".join(f"{n} into {k}" for k, n in c["chunks_in_range"].items()) or "none"
    return (f" ({rule}): {c['docs_in_range_cut']} of the {c['docs_in_range']} documents of "
            f"{lay['chunk_doc_min']}-{lay['chunk_doc_max']} slots cut ({split}), {c['docs_cut']} of all "
            f"{c['docs']}")


def stats_markdown(stats: dict[str, Any]) -> str:
    """The human report of `anchor pack` (stats.md)."""
    m, w = stats["mixture"], stats["windows"]
    lines = [
        "# Packed data",
        "",
        f"- model / tokenizer: `{stats['model']}` (identity `{stats['tokenizer']['identity'][:16]}`)",
        f"- data: `{stats['data']}`: {stats['source']['docs']} documents, {stats['source']['tokens']} tokens",
        f"- read: {stats['read'].get('read', '?')} documents; skipped: "
        + (", ".join(f"{v} {k}" for k, v in stats["read"].get("skipped", {}).items() if v) or "none"),
        f"- mixture: `{m['kind']}`, budget {m['budget'] or 'the source size'}, long = more than "
        f"{m['long_threshold']} tokens" + _upsampling(m)
        + f", seed {m['seed']}: {m['selected_docs']} documents ({m.get('repeated_docs', 0)} repeated), "
          f"{m['selected_tokens']} tokens"
        + (f" (+{m['tag_tokens']} tag tokens)" if m["tag_tokens"] else ""),
        f"- layout: tags {stats['layout']['tags']}, interleave {stats['layout']['interleave']}" + _chunking(stats),
        "",
        "## Domains",
        "",
        "Mixture ratio: share of documents; token ratio: share of tokens (each document with its EOS).",
        "Long share: the long documents' share of the domain's tokens.",
        "",
        "| domain | docs | mixture ratio | token ratio | source token ratio | long share (source → packed, expected) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, d in stats["domains"].items():
        lines.append(
            f"| {name} | {d['docs']} | {_pct(d['mixture_ratio'])} | {_pct(d['token_ratio'])} | "
            f"{_pct(d['source_token_ratio'])} | {_pct(d['source_long_share'])} → {_pct(d['long_share'])} "
            f"({_pct(d['expected_long_share'])}) |"
        )
    lines += [
        "",
        "## Windows",
        "",
        f"- {w['count']} windows of {w['seq_len']} slots ({w['padding_slots']} padding slots)",
        f"- documents per window: mean {w['docs_per_window']['mean']:.2f}, median "
        f"{w['docs_per_window']['median']:.0f}, max {w['docs_per_window']['max']}",
        f"- windows holding a document boundary: {_pct(w['boundary_window_share'])}",
        f"- attention compute of `anchor` relative to `full` (Σ (len+1)² / T² per window): "
        f"{stats['attention_compute_ratio_anchor_vs_full']:.4f}",
        "",
        "![document lengths](doc_lengths.png)",
        "",
    ]
    return "\n".join(lines)


def plot_doc_lengths(length: np.ndarray, selection: np.ndarray, cfg: PackConfig, path: Path) -> None:
    """Histogram of document lengths (tokens), source and packed selection, log-spaced bins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = np.asarray(length, dtype=np.int64) + 1
    sel = src[selection]
    hi = max(2.0, float(src.max()))
    bins = np.unique(np.geomspace(1, hi * 1.01, 50).astype(np.int64))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(src, bins=bins, weights=src, alpha=0.6, label="source")
    ax.hist(sel, bins=bins, weights=sel, alpha=0.6, label=f"packed ({cfg.mixture.kind})")
    ax.axvline(cfg.mixture.long_threshold, color="k", ls="--", lw=1, label="long threshold")
    ax.axvline(cfg.seq_len, color="r", ls=":", lw=1, label=f"T = {cfg.seq_len}")
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens, with EOS)")
    ax.set_ylabel("tokens in documents of this length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
