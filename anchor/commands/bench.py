"""`anchor bench`: attention and training-step speed per variant against the FLOP limit, and the
days-per-1B-tokens estimate (docs/DESIGN.md §10)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from anchor.cli import app


def _ints(text: str, flag: str) -> list[int]:
    from anchor_core.errors import InputError

    out = []
    for part in (p.strip().lower() for p in text.split(",")):
        k = part.endswith("k")
        digits = part[:-1] if k else part
        if not digits.isdigit():
            raise InputError(f"{flag}: expected comma-separated integers (e.g. 8192,16k), got {text!r}")
        out.append(int(digits) * (1024 if k else 1))
    return out


def _names(text: str, flag: str) -> list[str]:
    from anchor_core.errors import InputError

    out = [p.strip() for p in text.split(",") if p.strip()]
    if not out:
        raise InputError(f"{flag}: empty selection")
    return out


SUMMARY = "Time attention and training steps per engine, variant and length."


@app.command(short_help=SUMMARY)
def bench(
    out: Annotated[Path, typer.Option("--out", help="Output folder (replaced when complete).")],
    seq_len: Annotated[str, typer.Option(
        "--seq-len", help="Window lengths, comma-separated (16k = 16384).")] = "2048,4096,8192,16384",
    variants: Annotated[str, typer.Option(
        "--variants", help="Variants to time (full is always timed: every ratio is against it).")
    ] = "full,intra_doc,anchor",
    engines: Annotated[Optional[str], typer.Option(
        "--engines", help="Attention engines (default: varlen on CPU; varlen,flex,sdpa on CUDA).")] = None,
    distributions: Annotated[str, typer.Option(
        "--distributions", help="Document layouts: corpus (windows packed from --data), slimpajama, "
                                "long_upsampled (synthetic length distributions).")] = "corpus,slimpajama,long_upsampled",
    data: Annotated[Optional[str], typer.Option(
        "--data", help="Corpus (JSONL, parquet, folder) or `anchor pack` output; default: the embedded corpus.")
    ] = None,
    model: Annotated[str, typer.Option(
        "--model", help="Head shape of the attention rows and the model of the step rows.")] = "default",
    windows: Annotated[int, typer.Option("--windows", help="Windows per length and distribution.")] = 2,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repeats per window (after one warm-up).")] = 2,
    attention: Annotated[bool, typer.Option("--attention/--no-attention", help="Time attention alone.")] = True,
    step: Annotated[bool, typer.Option("--step/--no-step", help="Time whole `anchor train` steps.")] = True,
    step_seq_len: Annotated[Optional[int], typer.Option(
        "--step-seq-len", help="Window length of the step rows (default: the longest --seq-len up to 8192).")] = None,
    step_layers: Annotated[int, typer.Option("--step-layers", help="Layers of --model kept for the step rows.")] = 2,
    step_steps: Annotated[int, typer.Option("--step-steps", help="Steps per variant (the first is a warm-up).")] = 3,
    step_variants: Annotated[Optional[str], typer.Option(
        "--step-variants", help="Variants of the step rows (full is always run; default: anchor).")] = None,
    estimate_model: Annotated[str, typer.Option(
        "--estimate-model", help="Model of the estimate: llama2-7b, llama3-8b, llama3.1-8b, llama3.1-70b, mistral-7b, "
                                 "qwen2-7b.")] = "llama2-7b",
    estimate_seq_len: Annotated[str, typer.Option(
        "--estimate-seq-len", help="Context lengths of the estimate.")] = "65536,131072",
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs of the estimate (Ulysses over all).")] = 8,
    gpu: Annotated[str, typer.Option("--gpu", help="GPU of the estimate: a100-40gb, a100-80gb, h100, h200 or b200 "
                                                "(assumed rates).")] = "a100-80gb",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic layouts and the random q, k, v.")] = 0,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Time attention (forward + backward) per engine, variant and length on packed windows, and whole
    training steps, set against the FLOP model; estimate days per 1B tokens for a large model. Writes
    bench.json, report.md and PNG figures to --out."""
    from anchor.bench.run import check_memory, check_options, run_bench
    from anchor_core.limits import check_seed
    from anchor_core.outdir import guard_out

    check_seed(seed)
    if step_seq_len is not None and step_seq_len < 1:  # 0 is refused, never silently taken as the default
        from anchor_core.errors import InputError

        raise InputError(f"--step-seq-len must be >= 1 (leave it out for the default), got {step_seq_len}")
    opts = dict(seq_lens=_ints(seq_len, "--seq-len"), variants=_names(variants, "--variants"),
                engines=_names(engines, "--engines") if engines is not None else None,
                distributions=_names(distributions, "--distributions"), windows=windows, repeats=repeats,
                step_layers=step_layers, step_steps=step_steps, gpus=gpus,
                estimate_lengths=_ints(estimate_seq_len, "--estimate-seq-len"), estimate_model=estimate_model, gpu=gpu)
    check_options(**{**opts, "engines": opts["engines"] or ["varlen"]})
    if data is not None and not Path(data).exists():
        from anchor_core.errors import InputError

        raise InputError("no such file or folder", path=data)
    # the sizes against the memory here, before any work (unchecked, `anchor bench --step-seq-len 100000000`
    # grows to 13 GB before failing)
    check_memory(model=model, seq_lens=opts["seq_lens"], variants=opts["variants"], engines=opts["engines"],
                 windows=windows, attention=attention, step=step, step_seq_len=step_seq_len, step_layers=step_layers)
    out = guard_out(out, "bench", inputs=(data, model))  # --model counts as an input: never under --out

    from anchor_core.atomic import staging_dir
    from anchor.bench.report import render_report, write_bench

    # From the start: the lock (a second bench on this --out exits 2 before any work) and the staging
    # folder `.<out>.tmp-<pid>-<random>` that holds the temporary files too (the cut model, its pack, the
    # training runs): removed at the end, or by the next bench on this --out if this one is killed.
    with staging_dir(out, "bench", inputs=(data, model)) as tmp:
        result = run_bench(model=model, data=data, attention=attention, step=step, step_seq_len=step_seq_len,
                           step_variants=_names(step_variants, "--step-variants") if step_variants else None,
                           seed=seed, progress=progress, work_dir=tmp / "work", **opts)
        path = write_bench(result, out, staging=tmp)
    typer.echo(render_report(result, None))
    typer.echo(f"wrote {path / 'bench.json'}, {path / 'report.md'}")
