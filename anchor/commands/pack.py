"""`anchor pack`: tokenize, mix and pack a corpus into windows of `--seq-len` slots."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from anchor.cli import app


SUMMARY = "Tokenize, mix and pack documents into windows of T slots."


@app.command(short_help=SUMMARY)
def pack(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", help="Output folder (replaced when complete).")],
    model: Annotated[Optional[str], typer.Option(
        "--model", help="HF folder, .gguf file, random:<preset> or default.")] = None,
    data: Annotated[Optional[str], typer.Option(
        "--data", help="Corpus: .jsonl[.zst|.gz], .parquet, a folder written by `anchor corpus`, a saved `datasets` "
                       "folder, a folder of those or of text files; or a token store folder made by an earlier "
                       "`anchor pack` (its store/).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Slots per window (T), at least 2.")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="YAML with any of these options, or a shipped one by name (demo, slimpajama_64k, "
                         "slimpajama_128k_tags: configs/data/); command-line options win.")] = None,
    mixture: Annotated[str, typer.Option("--mixture", help="original | upsample_long (long documents kept, short ones sampled down) | upsample_repeat (long ones copied)")] = "original",
    budget: Annotated[Optional[int], typer.Option(
        "--budget", help="Tokens to select (documents with their EOS); default: the whole source.")] = None,
    long_threshold: Annotated[int, typer.Option(
        "--long-threshold", help="Documents longer than this many tokens are long.")] = 4096,
    upsample_factor: Annotated[float, typer.Option(
        "--upsample-factor", help="upsample_long: short documents kept with probability 1 / factor; upsample_repeat: copies of each long document per pass (1 to 1000).")] = 4.0,
    tags: Annotated[bool, typer.Option("--tags", help="Precede each document by its domain tag.")] = False,
    interleave: Annotated[bool, typer.Option("--interleave", help="Interleave document chunks in windows.")] = False,
    chunk_doc_min: Annotated[int, typer.Option(
        "--chunk-doc-min", help="--interleave: documents of at least this many slots in a window are cut.")] = 64,
    chunk_doc_max: Annotated[int, typer.Option(
        "--chunk-doc-max", help="--interleave: and of at most this many.")] = 2048,
    chunks_max: Annotated[int, typer.Option(
        "--chunks-max", help="--interleave: into 2 to this many chunks.")] = 3,
    chunk_cut_lo: Annotated[float, typer.Option(
        "--chunk-cut-lo", help="--interleave: cuts at or after this fraction of a document's length.")] = 0.2,
    chunk_cut_hi: Annotated[float, typer.Option(
        "--chunk-cut-hi", help="--interleave: cuts at or before this fraction of a document's length.")] = 0.8,
    mean_chunk: Annotated[int, typer.Option(
        "--mean-chunk", help="--interleave: > 0 cuts every document before each slot with probability "
                             "1/mean-chunk instead (the per-slot scheme); 0: the --chunk-* options.")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the mixture and of the interleaving.")] = 0,
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="Skip and count bad records instead of failing.")] = False,
    text_field: Annotated[str, typer.Option("--text-field", help="Dotted path of the text in each record.")] = "text",
    domain_field: Annotated[Optional[str], typer.Option(
        "--domain-field", help="Dotted path of the domain (default: domain, else meta.redpajama_set_name).")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
) -> None:
    """Tokenize (EOS per document), mix (original or long documents upsampled per domain) and pack into
    windows of T slots (docs/DESIGN.md §1); writes shards, pack.json, stats.json, stats.md, doc_lengths.png."""
    from anchor_core.data.config import PACK_FLAGS, check_pack_options, layout_of, load_pack_config
    from anchor_core.data.mixture import MixtureSpec
    from anchor_core.data.pipeline import PackConfig, pack_corpus
    from anchor_core.errors import InputError
    from anchor_core.outdir import guard_out, out_lock

    opts = dict(ctx.params)
    origin: dict[str, str] = {}  # key -> the config file it came from
    if config is not None:
        for key, value in load_pack_config(config).items():
            source = ctx.get_parameter_source(key)
            if source is None or source.name in ("DEFAULT", "DEFAULT_MAP"):
                opts[key] = value
                origin[key] = str(config)
    for key in ("model", "data", "seq_len"):
        if opts.get(key) is None:
            raise InputError(f"missing option {PACK_FLAGS[key]} (give it, or set `{key}` in --config)")
    check_pack_options(opts, origin)
    out = guard_out(out, "pack", inputs=(opts["data"], opts["model"], config))
    cfg = PackConfig(
        seq_len=opts["seq_len"],
        mixture=MixtureSpec(kind=opts["mixture"], budget=opts["budget"], long_threshold=opts["long_threshold"],
                            upsample_factor=float(opts["upsample_factor"]), seed=opts["seed"]),
        layout=layout_of(opts),
        seed=opts["seed"], text_field=opts["text_field"], domain_field=opts["domain_field"],
        skip_bad=opts["skip_bad"],
    )
    with out_lock(out, "pack"):
        stats = pack_corpus(opts["model"], opts["data"], out, cfg, progress=progress)
    w = stats["windows"]
    skipped = sum(stats["read"].get("skipped", {}).values())
    typer.echo(
        f"packed {stats['mixture']['selected_docs']} documents into {w['count']} windows of {w['seq_len']} "
        f"({skipped} skipped) -> {out}; anchor/full attention compute {stats['attention_compute_ratio_anchor_vs_full']:.3f}"
    )
