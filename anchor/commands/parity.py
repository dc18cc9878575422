"""`anchor parity`: the trainer (torchtrain) held against the oracle (jaxref), layer by layer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from anchor.cli import app


PARITY_BYTES_PER_SCORE = 16  # the trainer's eager attention: fp32 scores, probabilities and temporaries


def _split(text: str, option: str) -> list[str]:
    from anchor_core.errors import InputError

    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"{option}: nothing given")
    return list(dict.fromkeys(items))


INPUTS_HELP = ("flattening (DataCollatorWithFlattening's restarting position_ids, no mask, use_cache at the model's "
               "default), flattening-nocache (the same with use_cache=False; the default), flash-kwargs (the "
               "collator's cu_seq_lens_q/k and max_length_q/k too), continuous (position_ids 0..T-1, no mask), "
               "mask4d-bool and mask4d-float (the variant's position_ids and mask as a 4-D attention_mask).")

SUMMARY = "Compare a training stack with the oracle, layer by layer."


@app.command(short_help=SUMMARY)
def parity(
    out: Annotated[Path, typer.Option("--out", help="Output folder (replaced when complete; until then each finished "
                                                     "case is kept in .<name>.parts beside it, and a rerun of a killed "
                                                     "run with the same options takes them from there).")],
    model: Annotated[str, typer.Option(
        "--model", help="HF folder, .gguf file, random:<preset> or default.")] = "default",
    variants: Annotated[str, typer.Option(
        "--variants", help="Comma-separated attention variants.")] = "full,intra_doc,intra_doc_reset,anchor",
    engines: Annotated[str | None, typer.Option(
        "--engines", help="Comma-separated engines (torchtrain engines, cp<C>:ENGINE at context-parallel degree C, "
                          "registered parity runners; default eager,sdpa,flash_varlen_emulated). --stack torch only.")] = None,
    policies: Annotated[str, typer.Option(
        "--policies", help="Comma-separated: fp32 (trainer in float32, held within 1e-5 of fp64), bf16 (trainer in "
                           "bfloat16, held against the oracle's emulation of its engine), or a bf16 preset "
                           "(hf_bf16, fa2_bf16, paper_bf16). --stack hf: fp32 (always run: it identifies the "
                           "variant computed) and bf16 (the bf16 rule).")] = "fp32,bf16",
    layouts: Annotated[str | None, typer.Option(
        "--layouts", help="Comma-separated data layouts: plain, tags, interleave (default plain). "
                          "--stack torch only.")] = None,
    stack: Annotated[str, typer.Option(
        "--stack", help="torch: torchtrain's engines; hf: stock transformers (its own attention implementations, "
                        "inputs packed as transformers expects) or your --attention function.")] = "torch",
    attn_implementation: Annotated[str | None, typer.Option(
        "--attn-implementation", help="--stack hf: transformers' eager,sdpa,flex_attention,flash_attention_2 "
                                      "(comma-separated; default all four, none with --attention).")] = None,
    inputs: Annotated[str | None, typer.Option(
        "--inputs", help=f"--stack hf: how the batch reaches transformers' implementations, comma-separated or all: "
                         f"{INPUTS_HELP}")] = None,
    attention: Annotated[str | None, typer.Option(
        "--attention", help="--stack hf: your attention function, pkg.module:function with transformers' "
                            "AttentionInterface signature; it gets doc_ids= and variant= keywords.")] = None,
    rope_in: Annotated[str, typer.Option(
        "--rope-in", help="--attention: model (q and k arrive rotated, transformers' convention) or attention "
                          "(your function applies RoPE; q and k arrive unrotated).")] = "model",
    emulation: Annotated[str | None, typer.Option(
        "--emulation", help="--attention: the oracle bf16 preset your function's arithmetic follows (default "
                            "fa2_bf16; paper_bf16 with --rope-in attention).")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Window length T, 8 to the model's positions (odd sizes find more bugs).")] = 97,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the document lengths and the interleaving.")] = 0,
    device: Annotated[str, typer.Option(
        "--device", help="Where the trainer's side runs: cpu, or cuda (the real kernels: varlen's FlashAttention-2, "
                         "flex with its backward, flash_varlen).")] = "cpu",
    oracle_device: Annotated[str, typer.Option(
        "--oracle-device", help="Where the oracle (jaxref) runs: cpu (its fused CPU kernels, the tested path) or "
                                "cuda (JAX's CUDA backend, for long windows; it compiles each program for the "
                                "GPU).")] = "cpu",
    grads: Annotated[bool, typer.Option(
        "--grads/--no-grads", help="Also compare each case's gradients and the parameters after 1 and 3 AdamW steps, "
                                   "per parameter (a per-parameter error plot per case).")] = False,
    keep_parts: Annotated[bool, typer.Option(
        "--keep-parts", help="Keep each case's part (.<name>.parts beside --out) after the report is written, so "
                             "that a later run takes every case whose settings, code, library versions and "
                             "machine (GPU, CPU) are the same (a CI cache, or cases carried from one run on a "
                             "GPU machine to the next). --stack torch only.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> int:
    """Compare embeddings, q/k after RoPE, attention logits and probabilities of sampled rows, attention and
    MLP outputs, hidden states and logits of every layer, for each variant x layout x policy x engine, on
    batches made by the real packer; with --grads also every parameter's gradient and the parameters after
    1 and 3 AdamW steps. Writes parity.json, index.html, summary.md and figures to --out;
    exits 1 when a case fails. A killed run keeps each case it finished (.<name>.parts beside --out);
    the same command again computes only the rest. --stack hf: stock transformers (in each --inputs style) or
    your --attention function, per variant (parity_tests.hf_stack); exits 1 where one does not compute the
    variant asked or fails the bf16 rule."""
    from parity_tests.cases import LAYOUTS, VARIANTS

    from anchor_core.errors import InputError

    variant_list = _split(variants, "--variants")
    bad = [v for v in variant_list if v not in VARIANTS]
    if bad:
        raise InputError(f"--variants: unknown variant {bad[0]!r} (known: {', '.join(VARIANTS)})")
    if stack not in ("torch", "hf"):
        raise InputError(f"--stack: expected torch or hf, got {stack!r}")
    if stack == "hf":
        if device != "cpu" or oracle_device != "cpu":
            raise InputError("--device and --oracle-device apply to --stack torch "
                             "(the --stack hf runners run on the CPU)")
        _refuse({"--engines": engines, "--layouts": layouts, "--grads": grads, "--keep-parts": keep_parts},
                "applies to --stack torch (--stack hf holds transformers' own attention)")
        return _parity_hf(out, model, variant_list, policies, seq_len, seed, attn_implementation, attention,
                          rope_in, emulation, progress, inputs)
    _refuse({"--attn-implementation": attn_implementation, "--attention": attention, "--rope-in": rope_in != "model",
             "--emulation": emulation, "--inputs": inputs}, "applies to --stack hf")
    engines = engines or "eager,sdpa,flash_varlen_emulated"
    layout_list = _split(layouts or "plain", "--layouts")
    bad = [v for v in layout_list if v not in LAYOUTS]
    if bad:
        raise InputError(f"--layouts: unknown layout {bad[0]!r} (known: {', '.join(LAYOUTS)})")
    from anchor_core.limits import check_seed
    from anchor_core.outdir import guard_out

    check_seed(seed)
    policy_list = _split(policies, "--policies")
    out = guard_out(out, "parity",
                    inputs=(model, *[p for p in policy_list if p.endswith((".yaml", ".yml"))]))
    _checked_length(model, seq_len)
    engine_list = _split(engines, "--engines")
    return _parity_torch(out, model, variant_list, layout_list, policy_list, engine_list, seq_len, seed, device,
                         oracle_device, grads, progress, keep_parts)


def _parity_torch(out: Path, model: str, variant_list: list[str], layout_list: list[str], policy_list: list[str],
                  engine_list: list[str], seq_len: int, seed: int, device: str, oracle_device: str, grads: bool,
                  progress: bool, keep_parts: bool = False) -> int:
    """`anchor parity --stack torch` once its options are checked: the devices, then the cases, then the report."""
    from anchor_core.errors import InputError
    from anchor_core.outdir import out_lock
    from anchor_core.parts import Parts, parts_dir
    from parity_tests.report import render_markdown, write_report
    from jaxref.device import use_device as use_oracle_device
    from parity_tests.runners import use_device
    from parity_tests.suite import build_cases, run_parity

    use_device(device)
    oracle_where = use_oracle_device(oracle_device, option="--oracle-device")
    if grads:
        if "flex" in engine_list and device != "cuda":
            raise InputError("--grads: engine 'flex' has no backward on the CPU (FlexAttention limitation); "
                             "leave it out of --engines or run with --device cuda")
    with out_lock(out, "parity"):
        cases = build_cases(model, variants=variant_list, layouts=layout_list, policies=policy_list,
                            engines=engine_list, seq_lens=[seq_len], seed=seed)
        # Each finished case is kept beside --out until the report is published: a killed run (a job's time
        # limit, Ctrl-C) is rerun with the same options and computes only what it had not finished.
        parts = Parts(parts_dir(out), "parity")
        key = parts_key(model, device, oracle_where, grads, policy_list)
        result = run_parity(cases, progress=progress, grads=grads, parts=parts, key=key)
        result["model"] = model
        result["device"] = device
        result["oracle_device"] = oracle_where
        path = write_report(result, out)
        if not keep_parts:
            parts.remove()
    typer.echo(render_markdown(result))
    typer.echo(f"wrote {path / 'parity.json'}, {path / 'index.html'}, {path / 'summary.md'}")
    return 0 if result["pass"] else 1


CODE_PACKAGES = ("anchor_core", "jaxref", "torchtrain", "parity_tests")  # what a parity case's numbers come from


def parts_key(model: str, device: str, oracle_where: str, grads: bool, policy_list: list[str]) -> dict:
    """What every kept case of `anchor parity --stack torch` was computed from besides its own settings: the
    model's bytes (`anchor_core.weights.model_identity`: `default` is the GGUF it resolves to, so a changed file
    keys anew whatever its name, size or modification time), the policy files, the devices, `parts_context`."""
    from anchor_core import __version__
    from anchor_core.parts import files_id
    from anchor_core.weights import model_identity

    return {"anchor": __version__, "model_files": model_identity(model), "device": device,
            "oracle_device": oracle_where, "grads": grads, "policy_files": [files_id(p) for p in policy_list],
            **parts_context(device)}


def parts_context(device: str) -> dict:
    """What a kept case also depends on beyond its settings: the code (`anchor_core.parts.sources_id` of
    CODE_PACKAGES), the numerical libraries' versions, the GPU that ran the trainer's side (with `device`
    cuda), and the CPU (its model and the capability torch's kernels dispatch to: the trainer's side on the
    CPU, and the oracle's kernels, built for the CPU they run on, on either device). In every part's key, so
    a part carried to another run or machine is taken only where these are the same."""
    from anchor_core.machine import cpu_capability, cpu_model, machine
    from anchor_core.parts import sources_id

    gpu = None
    if device == "cuda":
        import torch

        gpu = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    return {"code": sources_id(CODE_PACKAGES), "versions": machine()["versions"], "gpu": gpu,
            "cpu": f"{cpu_model()} ({cpu_capability()})"}


def _refuse(options: dict, why: str) -> None:
    """One line naming the first option given (a truthy value) that does not apply here."""
    from anchor_core.errors import InputError

    given = next((name for name, value in options.items() if value), None)
    if given:
        raise InputError(f"{given} {why}")


def _checked_length(model: str, seq_len: int):
    """The model's spec, after checking --seq-len against its positions and the memory of its attention maps."""
    from anchor_core.errors import InputError
    from anchor_core.limits import check_int, check_memory
    from anchor_core.weights import load_spec

    spec = load_spec(model)  # a bad --model fails here, before anything heavy
    check_int(seq_len, "--seq-len", lo=8)
    if seq_len > spec.max_position:
        raise InputError(f"--seq-len {seq_len} is longer than the model's {spec.max_position} positions "
                         f"(max_position_embeddings of {model})")
    # an estimate: eager attention holds [windows (<= 2), heads, T, T] scores and probabilities
    check_memory(PARITY_BYTES_PER_SCORE * 2 * spec.num_heads * seq_len * seq_len,
                 f"--seq-len {seq_len} (attention maps of {spec.num_heads} heads)")
    return spec


def _parity_hf(out: Path, model: str, variant_list: list[str], policies: str, seq_len: int, seed: int,
               attn_implementation: str | None, attention: str | None, rope_in: str, emulation: str | None,
               progress: bool, inputs: str | None = None) -> int:
    """`anchor parity --stack hf` (parity_tests.hf_stack): checks, then the rows, then the report."""
    from anchor_core.errors import InputError
    from anchor_core.limits import check_seed
    from anchor_core.outdir import guard_out, out_lock
    from parity_tests.hf_report import render_markdown
    from parity_tests.report import write_report
    from parity_tests.hf_stack import input_styles, not_run_reason, run_hf_stack, stock, user_stack

    check_seed(seed)
    policy_list = _split(policies, "--policies")
    bad = [p for p in policy_list if p not in ("fp32", "bf16")]
    if bad or "fp32" not in policy_list:
        raise InputError(f"--policies with --stack hf: fp32 or fp32,bf16 (got {policies!r})")
    dtypes = ["float32"] + (["bfloat16"] if "bf16" in policy_list else [])
    implementations = None if attn_implementation is None else _split(attn_implementation, "--attn-implementation")
    for name in implementations or ():
        stock(name)  # an unknown name fails here
    if attention is None and (rope_in != "model" or emulation):
        raise InputError("--rope-in and --emulation apply to --attention")
    styles = input_styles(inputs)  # an unknown style fails here
    runnable = [n for n in implementations or () if not_run_reason(stock(n)) is None]
    if attention is None and implementations and not runnable:
        raise InputError(f"nothing was checked: {', '.join(implementations)} cannot run here "
                         f"({not_run_reason(stock(implementations[0]))})")
    if inputs is not None and attention is not None and implementations is None:
        raise InputError("--inputs applies to transformers' own implementations (--attn-implementation); "
                         "--attention gets its own feed")
    if attention is not None:
        user_stack(attention, rope_in=rope_in, emulation=emulation)  # a bad function fails here
    out = guard_out(out, "parity", inputs=(model,))
    _checked_length(model, seq_len)
    with out_lock(out, "parity"):
        result = run_hf_stack(model, implementations=implementations, attention=attention, rope_in=rope_in,
                              emulation=emulation, variants=variant_list, seq_len=seq_len, seed=seed,
                              dtypes=dtypes, inputs=styles, progress=progress)
        path = write_report(result, out)
    typer.echo(render_markdown(result))
    typer.echo(f"wrote {path / 'parity.json'}, {path / 'summary.md'}, {path / 'index.html'}")
    return 0 if result["pass"] else 1
