"""`anchor parity`: the trainer (torchtrain) held against the oracle (jaxref), layer by layer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from anchor_app.cli import app


PARITY_BYTES_PER_SCORE = 16  # the trainer's eager attention: fp32 scores, probabilities and temporaries


def _split(text: str, option: str) -> list[str]:
    from anchor.errors import InputError

    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"{option}: nothing given")
    return list(dict.fromkeys(items))


@app.command()
def parity(
    out: Annotated[Path, typer.Option("--out", help="Output folder (replaced when complete).")],
    model: Annotated[str, typer.Option(
        "--model", help="HF folder, .gguf file, random:<preset> or default.")] = "default",
    variants: Annotated[str, typer.Option(
        "--variants", help="Comma-separated attention variants.")] = "full,intra_doc,intra_doc_reset,anchor",
    engines: Annotated[str, typer.Option(
        "--engines", help="Comma-separated engines (torchtrain engines and registered parity runners).")
    ] = "eager,sdpa,flash_varlen_emulated",
    policies: Annotated[str, typer.Option(
        "--policies", help="Comma-separated: fp32 (trainer in float32, held within 1e-5 of fp64), bf16 (trainer in "
                           "bfloat16, held against the oracle's emulation of its engine), or a bf16 preset "
                           "(hf_bf16, fa2_bf16, paper_bf16).")] = "fp32,bf16",
    layouts: Annotated[str, typer.Option(
        "--layouts", help="Comma-separated data layouts: plain, tags, interleave.")] = "plain",
    seq_len: Annotated[int, typer.Option("--seq-len", help="Window length T, 8 to the model's positions (odd sizes find more bugs).")] = 97,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the document lengths and the interleaving.")] = 0,
    grads: Annotated[bool, typer.Option(
        "--grads/--no-grads", help="Also compare each case's gradients and the parameters after 1 and 3 AdamW steps, "
                                   "per parameter (a per-parameter error plot per case).")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> int:
    """Compare embeddings, q/k after RoPE, attention logits and probabilities of sampled rows, attention and
    MLP outputs, hidden states and logits of every layer, for each variant x layout x policy x engine, on
    batches made by the real packer; with --grads also every parameter's gradient and the parameters after
    1 and 3 AdamW steps. Writes parity.json, index.html, summary.md and figures to --out;
    exits 1 when a case fails."""
    from parity_tests.cases import LAYOUTS, VARIANTS
    from parity_tests.report import render_markdown, write_report
    from parity_tests.suite import build_cases, run_parity

    from anchor.errors import InputError

    variant_list = _split(variants, "--variants")
    bad = [v for v in variant_list if v not in VARIANTS]
    if bad:
        raise InputError(f"--variants: unknown variant {bad[0]!r} (known: {', '.join(VARIANTS)})")
    layout_list = _split(layouts, "--layouts")
    bad = [v for v in layout_list if v not in LAYOUTS]
    if bad:
        raise InputError(f"--layouts: unknown layout {bad[0]!r} (known: {', '.join(LAYOUTS)})")
    from anchor.limits import check_int, check_memory, check_seed
    from anchor.outdir import guard_out, out_lock
    from anchor.weights import load_spec

    check_seed(seed)
    policy_list = _split(policies, "--policies")
    out = guard_out(out, "parity",
                    inputs=(model, *[p for p in policy_list if p.endswith((".yaml", ".yml"))]))
    spec = load_spec(model)  # a bad --model fails here, before anything heavy
    check_int(seq_len, "--seq-len", lo=8)
    if seq_len > spec.max_position:
        raise InputError(f"--seq-len {seq_len} is longer than the model's {spec.max_position} positions "
                         f"(max_position_embeddings of {model})")
    # an estimate: the trainer's eager attention holds [windows (<= 2), heads, T, T] scores and probabilities
    check_memory(PARITY_BYTES_PER_SCORE * 2 * spec.num_heads * seq_len * seq_len,
                 f"--seq-len {seq_len} (attention maps of {spec.num_heads} heads)")
    engine_list = _split(engines, "--engines")
    if grads:
        import torch

        if "flex" in engine_list and not torch.cuda.is_available():
            raise InputError("--grads: engine 'flex' has no backward on the CPU (FlexAttention limitation); "
                             "leave it out of --engines or run on CUDA")
    with out_lock(out, "parity"):
        cases = build_cases(model, variants=variant_list, layouts=layout_list, policies=policy_list,
                            engines=engine_list, seq_lens=[seq_len], seed=seed)
        result = run_parity(cases, progress=progress, grads=grads)
        result["model"] = model
        path = write_report(result, out)
    typer.echo(render_markdown(result))
    typer.echo(f"wrote {path / 'parity.json'}, {path / 'index.html'}, {path / 'summary.md'}")
    return 0 if result["pass"] else 1
