"""`anchor audit`: the RoPE/BF16 precision audit of a model (paper §2, Figure 1; docs/DESIGN.md §5)."""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from anchor.cli import app

COMPILE_CACHE_BYTES = 2 << 30
"""Size limit of the audit's compilation cache (a default audit's programs take about 3 MB)."""


SUMMARY = "Measure how a position shift changes attention per dtype policy."


@app.command(short_help=SUMMARY)
def audit(
    out: Annotated[Path, typer.Option("--out", help="Output folder (replaced when complete).")],
    model: Annotated[str, typer.Option(
        "--model", help="HF folder, .gguf file, random:<preset> or default.")] = "default",
    policies: Annotated[Optional[str], typer.Option(
        "--policies", help="Comma-separated dtype policies of the oracle: presets (fp64, fp32, hf_bf16, fa2_bf16, "
                           "paper_bf16, sdpa_cpu_bf16, fa2_bf16_1pass; FP8: torchao_rowwise_bf16, "
                           "torchao_tensorwise_bf16, te_fp8), shipped policy files by name "
                           "(hf_bf16_rope_fp32, fa2_bf16_fp64_softmax, paper_bf16_phase32, paper_bf16_phase64) or YAML files "
                           "(default: fp32,hf_bf16,fa2_bf16,paper_bf16).")] = None,
    stack: Annotated[str, typer.Option(
        "--stack", help="oracle: jaxref under each --policies; torch: torchtrain's model itself on --engine in "
                        "--dtype, beside the oracle's emulation of that stack.")] = "oracle",
    engine: Annotated[str, typer.Option(
        "--engine", help="--stack torch: eager, sdpa, varlen, flex, flash_varlen (CUDA) or flash_varlen_emulated.")] = "eager",
    dtype: Annotated[str, typer.Option("--dtype", help="--stack torch: bfloat16 or float32.")] = "bfloat16",
    random_init: Annotated[bool, typer.Option(
        "--random-init", help="Also audit the architecture with PyTorch's default init (the paper's green line).")
    ] = False,
    data: Annotated[Optional[str], typer.Option(
        "--data", help="JSONL (or any `anchor pack` source) with a `text` field; default: the embedded corpus.")
    ] = None,
    shifts: Annotated[Optional[str], typer.Option(
        "--shifts", help="Comma-separated shifts of the shift curve (default: the paper's 0 to 2000), or `million`: "
                         "a few short ones and every power of two from 4096 to 2^20 (the windows stay short).")] = None,
    rope_base: Annotated[Optional[str], typer.Option(
        "--rope-base", help="Comma-separated RoPE bases (e.g. 1e4,5e5,5e6,1e8), each measuring the shift curve "
                            "again with the model's weights (its walls, its phase error); the rest runs under the "
                            "model's own base.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(
        "--seq-len", help="Window length of the shift curve (default 256, quick 64; the paper: 4096).")] = None,
    num_seqs: Annotated[Optional[int], typer.Option(
        "--num-seqs", help="Windows averaged over (default 2, quick 1; the paper: 50).")] = None,
    max_len: Annotated[Optional[int], typer.Option(
        "--max-len", help="Longest length of the length curve (default 1024, quick 256; the paper: 8192).")
    ] = None,
    length_seqs: Annotated[Optional[int], typer.Option(
        "--length-seqs", help="Windows of --max-len the length curve averages over (default 1; the paper: 50).")
    ] = None,
    budget_policy: Annotated[Optional[str], typer.Option(
        "--budget-policy", help="Policy of the error budget (default: the first bf16 policy).")] = None,
    budget: Annotated[Optional[bool], typer.Option(
        "--budget/--no-budget", help="Run the stage-by-stage error budget (default yes, quick no).")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="A short audit: 1 window of 64 tokens, six shifts, lengths up to 256, no error budget.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of --random-init (and of random:<preset> weights).")] = 0,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
    oracle_device: Annotated[str, typer.Option("--oracle-device", help="Where jaxref runs: cpu (its fused kernels, "
                                               "the measured path) or cuda (JAX's CUDA backend).")] = "cpu",
    compile_cache: Annotated[bool, typer.Option(
        "--compile-cache/--no-compile-cache",
        help="Keep the compiled XLA programs on disk (in <cache>/jax, or $JAX_COMPILATION_CACHE_DIR), so that a "
             "later audit of the same sizes skips compiling them (about a fifth of a default audit's CPU time); "
             "the numbers are the same.")] = True,
) -> None:
    """Measure how a position shift changes the attention maps under each dtype policy (RoPE should make
    it zero), which key token carries the change, how it grows with length, and which numerical stage
    causes it. Writes audit.json, report.md and PNG figures to --out. A killed audit keeps each policy's
    finished curves (.<name>.parts beside --out); the same command again computes only the rest."""
    with _without_cyclic_gc():
        from anchor_core.limits import check_seed
        from anchor_core.outdir import guard_out

        from anchor_core.errors import InputError

        check_seed(seed)
        from parity_tests.audit.settings import parse_rope_bases, parse_shifts

        shift_list = parse_shifts(shifts) if shifts is not None else None
        bases = parse_rope_bases(rope_base) if rope_base is not None else None
        if stack not in ("oracle", "torch"):
            raise InputError(f"--stack: unknown stack {stack!r} (known: oracle, torch)")
        if stack == "torch":
            given = [flag for flag, v in (("--policies", policies), ("--shifts", shifts), ("--rope-base", rope_base),
                                          ("--random-init", random_init or None),
                                          ("--budget-policy", budget_policy), ("--budget", budget)) if v is not None]
            if given:
                raise InputError(f"{given[0]} applies to --stack oracle; --stack torch is held against its engine's "
                                 "emulation")
            if dtype not in ("bfloat16", "float32"):
                raise InputError(f"--dtype: unsupported dtype {dtype!r} (supported: bfloat16, float32)")
        policies = policies or "fp32,hf_bf16,fa2_bf16,paper_bf16"
        policy_files = [p.strip() for p in policies.split(",") if p.strip().endswith((".yaml", ".yml"))]
        out = guard_out(out, "audit", inputs=(data, model, *policy_files))
        from jaxref.device import use_device

        where = use_device(oracle_device, option="--oracle-device")

        if stack == "torch":
            _audit_torch(out, model, engine, dtype, data, quick, progress, seq_len, num_seqs, max_len, length_seqs,
                         seed, where, compile_cache)
            return
        overrides = {"seq_len": seq_len, "num_seqs": num_seqs, "max_len": max_len, "length_seqs": length_seqs,
                     "shifts": shift_list, "rope_bases": bases,
                     "budget_policy": budget_policy,
                     "random_init": random_init, "seed": seed}
        if budget is not None or budget_policy is not None:
            overrides["budget"] = budget if budget is not None else True
        _audit_oracle(out, model, policies, data, quick, progress, overrides, where, compile_cache)


def _audit_torch(out: Path, model: str, engine: str, dtype: str, data: str | None, quick: bool, progress: bool,
                 seq_len: int | None, num_seqs: int | None, max_len: int | None, length_seqs: int | None, seed: int,
                 where: str, compile_cache: bool) -> None:
    """`anchor audit --stack torch` once its options are checked: torchtrain's model beside the emulation."""
    from anchor_core.outdir import out_lock
    from parity_tests.audit import write_audit
    from parity_tests.audit.torch_stack import audit_torch_stack

    with out_lock(out, "audit"), _compile_cache(compile_cache):
        result = audit_torch_stack(model, engine, dtype, data=data, quick=quick, progress=progress, seq_len=seq_len,
                                   num_seqs=num_seqs, max_len=max_len, length_seqs=length_seqs, seed=seed)
        result["oracle_device"] = where
        path = write_audit(result, out)
    comp = result["comparison"]
    typer.echo(f"{comp['torch']} against oracle {comp['oracle']}: D differs by at most {comp['max_rel_diff']:.1%} "
               f"over {len(comp['shifts'])} shifts")
    typer.echo(f"wrote {path / 'audit.json'}, {path / 'report.md'} ({result['runtime_s']:.0f} s)")


def _audit_oracle(out: Path, model: str, policies: str, data: str | None, quick: bool, progress: bool,
                  overrides: dict, where: str, compile_cache: bool) -> None:
    """`anchor audit` (the oracle under each policy) once its options are checked; each policy's curves and the
    budget are kept beside --out as they finish, so a killed audit, run again with the same options, computes
    only the rest."""
    from anchor_core.outdir import out_lock
    from anchor_core.parts import Parts, parts_dir
    from parity_tests.audit import run_audit, write_audit

    with out_lock(out, "audit"), _compile_cache(compile_cache):
        parts = Parts(parts_dir(out), "audit")
        result = run_audit(model, policies, data=data, quick=quick, progress=progress, parts=parts, **overrides)
        result["oracle_device"] = where
        path = write_audit(result, out)
        parts.remove()
    typer.echo(f"wrote {path / 'audit.json'}, {path / 'report.md'} ({result['runtime_s']:.0f} s)")


@contextlib.contextmanager
def _without_cyclic_gc():
    """Python's cyclic garbage collector off for the call: the audit makes no cycles worth collecting,
    and reading the GGUF and tokenizing (hundreds of thousands of small objects) and the imports take
    about 0.5 s less of its single-threaded setup without it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _compile_cache(enabled: bool):
    """JAX's persistent compilation cache for the audit's programs, set for the call and put back after.

    The folder is `<cache>/jax` unless the user named one (JAX_COMPILATION_CACHE_DIR), kept under
    COMPILE_CACHE_BYTES (least recently used programs go first; JAX then locks the folder around each
    read and write, so concurrent audits share it safely). A cached program is the compiled program
    itself, so the results do not change; JAX keys it by the program, the XLA flags and the versions,
    and compiles again when an entry cannot be read.
    """
    if not enabled:
        yield
        return
    import jax

    from anchor_core.paths import cache_dir

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_compilation_cache_max_size")
    before = {k: getattr(jax.config, k) for k in names}
    if before["jax_compilation_cache_dir"] is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax"))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program, not only slow ones
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and before["jax_compilation_cache_max_size"] == -1:
        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)
    try:
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
