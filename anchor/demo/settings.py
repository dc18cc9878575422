"""The demo's settings and job names: what every other module of `anchor.demo` reads.

`JOBS` in the pipeline's order, `NEEDS` (the jobs each one reads), `TITLES` (the page's headings),
`DemoSettings` (everything a job's result depends on besides its inputs), `PROFILES` (`--profile`) and
`run_names` / `parse_run` (the training runs of a profile: its variants, and short float32 runs named
`<variant>@fp32`), and `upgrade_record` (demo.json as an earlier version wrote it, read as this one writes it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from anchor_core.errors import InputError

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"
JOBS = ("top5", "corpus", "pack", "audit", "train", "parity", "eval", "bench")
NEEDS = {"pack": ("corpus",), "audit": ("corpus",), "train": ("pack",), "parity": ("train",), "eval": ("train",),
         "bench": ("corpus",)}
TITLES = {"top5": "Next-token top-5: the oracle against transformers", "corpus": "The embedded corpus",
          "pack": "Packed windows", "audit": "Precision audit: RoPE in bf16",
          "train": "Training: AnchorAttention against full attention",
          "parity": "Parity of the trained checkpoint: the trainer against the oracle",
          "eval": "Evaluation: RULER averaged over the last checkpoints", "bench": "Speed: anchor against full"}
DEMO_JSON = "demo.json"
# demo.json as versions before the demo's pipeline units were named jobs wrote it: the same record, its jobs under
# this key and the settings' `jobs` under this name (`upgrade_record` reads it; the next write uses the new names)
OLD_JOBS_KEY = "stages"


def _renamed(d: Any, old: str, new: str) -> Any:
    """`d` with its key `old` named `new` in its place, where it has `old` and not `new`; else `d` as it is."""
    if not isinstance(d, dict) or old not in d or new in d:
        return d
    return {(new if k == old else k): v for k, v in d.items()}


def upgrade_record(d: Any) -> Any:
    """A demo.json object as this version writes it: one an earlier version wrote has its jobs and the settings'
    `jobs` under `OLD_JOBS_KEY`, renamed here, nothing else changed (a job's fingerprint hashes the bytes it hashed
    before the rename: a finished job of such a folder is reused); anything else is returned as it is."""
    d = _renamed(d, OLD_JOBS_KEY, "jobs")
    if isinstance(d, dict) and isinstance(d.get("settings"), dict):
        d = {**d, "settings": _renamed(d["settings"], OLD_JOBS_KEY, "jobs")}
    return d


@dataclass(frozen=True)
class DemoSettings:
    """Everything a job's result depends on (besides its inputs): the fingerprints hash these."""

    model: str = "default"
    prompt: str = DEFAULT_PROMPT
    policy: str = "fp32"
    seq_len: int = 1024                       # pack and train windows
    budget: int = 400_000                     # tokens taken from the corpus for packing
    pack_docs: str = "whole"                  # the corpus's files whole (long-upsampled), or `pieces`: cut at
                                              # their functions and sections (anchor/demo/documents.py)
    train_variants: tuple[str, ...] = ("anchor", "full")
    train_steps: int = 4
    global_batch: int = 1
    lr: float = 1e-4                          # higher than the paper's 2e-5: a short run should move
    train_engine: str = "varlen"              # costs what the mask says, trains on CPU
    train_dtype: str = "float32"              # or `auto`: bf16 where the machine has bf16 units (CUDA, a CPU with
                                              # avx512_bf16 or AMX), fp32 elsewhere; evaluation follows it
                                              # (checks.choose_dtype)
    eval_every: int = 2                       # evaluation checkpoints: every eval_every steps ...
    eval_window: int = 4                      # ... over the last eval_window (paper: 10 over 50)
    parity_seq_len: int = 97
    parity_policies: tuple[str, ...] = ("fp32", "bf16")   # forward cases on the whole trained model
    parity_grad_layers: int = 2               # gradient cases (fp32) on its first layers (0: all)
    eval_tasks: tuple[str, ...] = ("niah_single_1", "vt")
    eval_lengths: tuple[int, ...] = (1024, 2048)
    eval_samples: int = 4
    eval_dtype: str = "auto"                  # bf16 where it multiplies faster (CUDA, CPUs with bf16 units;
                                              # anchor.eval.dtype), else fp32: eval.json records which and why
    eval_engine: str = "varlen"               # the prefill's engine: fused per prompt (sdpa's padded batch
                                              # takes the masked path: 1.9x slower at 4K on this CPU)
    perplexity_windows: int = 1
    bench_seq_lens: tuple[int, ...] = (2048, 4096)
    bench_windows: int = 1
    bench_repeats: int = 2
    seed: int = 0
    # The settings `paper-gpu` sets; at these defaults the demo behaves, and fingerprints its jobs, as
    # without them (pipeline._KEYS_IF_SET: a key enters a job's fingerprint only when it differs from its
    # default).
    train_rope_theta: float | None = None     # the runs' RoPE base (train config `rope.theta`); None: the model's
    zero_stage: int = 0                       # DeepSpeed ZeRO stage of the runs (bf16 needs >= 1)
    train_warmup_steps: int = 1
    fp32_variants: tuple[str, ...] = ()       # short float32 runs beside the others, named `<variant>@fp32`
    fp32_steps: int = 0                       # their steps (same seed, windows, schedule: their first steps
                                              # are the main runs' first steps in float32)
    fp32_eval_window: int = 1                 # their evaluation checkpoints: every eval_every over the last this many
    eval_batch_size: int = 4                  # prompts per generation batch
    eval_group_by_budget: bool = False        # tasks of the same answer budget generate together at a length
    perplexity_docs: str = "packed"           # packed held-out windows, or `long`: one long document per window
    perplexity_bucket: int = 2048             # positions per bucket of the held-out NLL by position
    perplexity_data: str = ""                 # held-out documents (a corpus file); "": the stdlib test suites
    only_runs: tuple[str, ...] = ()           # a part of the runs (`--runs`): this folder trains and evaluates
                                              # these alone; `anchor demo --merge` joins the parts (demo/merge.py)
    timing_steps: int = 0                     # a part without `full`: full trained this many steps beside its
                                              # runs, timed only, the step time they are set against
    # Not results: what runs when --jobs is not given, and the summary JSON written into the demo folder
    jobs: tuple[str, ...] = JOBS
    summary_json: str = ""


FP32_SUFFIX = "@fp32"


def all_run_names(s: DemoSettings) -> tuple[str, ...]:
    """The training runs of the profile `s`, in order: one per variant, then the float32 runs `<variant>@fp32`."""
    return tuple(s.train_variants) + tuple(f"{v}{FP32_SUFFIX}" for v in s.fp32_variants)


def run_names(s: DemoSettings) -> tuple[str, ...]:
    """The training runs this demo folder holds: `all_run_names`, or those of `s.only_runs` (in that order)."""
    names = all_run_names(s)
    return tuple(r for r in names if r in s.only_runs) if s.only_runs else names


def times_full(s: DemoSettings) -> bool:
    """Whether this folder trains `full` for `timing_steps` steps to time it: a part (`only_runs`) with a run in
    the main dtype and no `full` (its runs' step times are set against full's in the same sitting)."""
    names = run_names(s)
    return bool(s.only_runs and s.timing_steps and "full" not in names
                and any(not v.endswith(FP32_SUFFIX) for v in names))


def check_runs(s: DemoSettings, runs: str) -> tuple[str, ...]:
    """`--runs` (comma-separated) as run names of `s`, in the profile's order; an unknown or no name is an
    InputError naming the runs there are."""
    names = all_run_names(s)
    items = [x.strip() for x in runs.split(",") if x.strip()]
    unknown = [x for x in items if x not in names]
    if not items or unknown:
        what = f"unknown run {unknown[0]!r}" if unknown else "no run given"
        raise InputError(f"--runs: {what} (this profile's runs: {', '.join(names)})")
    return tuple(r for r in names if r in items)


def parse_run(s: DemoSettings, run: str) -> dict[str, Any]:
    """What a run of `run_names(s)` trains: variant, dtype, steps and evaluation window."""
    if run.endswith(FP32_SUFFIX):
        return {"variant": run[:-len(FP32_SUFFIX)], "dtype": "float32", "steps": s.fp32_steps,
                "eval_window": s.fp32_eval_window}
    return {"variant": run, "dtype": s.train_dtype, "steps": s.train_steps, "eval_window": s.eval_window}


# The paper's RoPE base per training length (its "RoPE base" study): 1M at 32K, 5M at 64K, 10M at 128K,
# 50M at 256K. paper-gpu trains SmolLM2-135M (base 1e5, 8192 positions) at 16K: 5e5, SmolLM2's own base
# raised 5x for the doubling of its context, the paper's factor for a doubling (32K -> 64K: 1M -> 5M;
# 128K -> 256K: 10M -> 50M). It also lies between the paper's schedule carried back one doubling from 32K
# (about 3e5 on its log-log trend) and the base that did best at 16K in the paper's 32K study (600K-900K),
# above the lower bound of Men et al. for 16K (about 3e5 at head dim 128).
PAPER_ROPE_THETA = {32768: 1e6, 65536: 5e6, 131072: 1e7, 262144: 5e7}
PAPER_GPU_ROPE_THETA = 5e5


# `make paper-small`: the paper's comparison at small scale (four variants, RULER 1K-4K, five checkpoints).
PROFILES = {
    # several documents per window (anchor and full differ there), bf16 where the CPU multiplies it natively
    "demo": DemoSettings(pack_docs="pieces", train_dtype="auto"),
    "paper-small": DemoSettings(
        seq_len=4096, budget=1_200_000, train_variants=("full", "intra_doc", "intra_doc_reset", "anchor"),
        train_steps=20, global_batch=1, eval_every=4, eval_window=20, parity_seq_len=515,
        eval_tasks=("niah_single_1", "niah_multikey_1", "vt"), eval_lengths=(1024, 2048, 4096),
        eval_samples=4, perplexity_windows=2, bench_seq_lens=(4096, 8192, 16384), bench_windows=2),
    # `make paper-gpu`: the comparison on one GPU (docs/verbs/demo.md). SmolLM2-135M continued at 16K, beyond
    # its 8192 positions, RoPE base 5e5; bf16 under ZeRO-1; 200 steps of one window each, evaluation
    # checkpoints every 10 steps over the last 50 (the paper's five); RULER 4K-16K with 34 samples per task
    # and length (the standard error of a length's task mean is at most 50 / sqrt(3 x 34) = 4.95 points: 34 is
    # the least n with 50 / sqrt(3 n) < 5), the two needle tasks (128-token answers) in one batch of 68 per
    # length, vt (30 tokens) in its own;
    # held-out NLL by 2K position bucket on eight long documents; intra_doc and intra_doc_reset again in fp32
    # for 40 steps (the reset's size in bf16 against fp32).
    "paper-gpu": DemoSettings(
        seq_len=16384, budget=3_400_000, train_variants=("full", "intra_doc", "intra_doc_reset", "anchor"),
        train_steps=200, global_batch=1, lr=1e-4, train_warmup_steps=10, train_engine="auto",
        train_dtype="bfloat16", zero_stage=1, train_rope_theta=PAPER_GPU_ROPE_THETA, eval_every=10, eval_window=50,
        fp32_variants=("intra_doc", "intra_doc_reset"), fp32_steps=40, fp32_eval_window=1,
        eval_tasks=("niah_single_1", "niah_multikey_1", "vt"), eval_lengths=(4096, 8192, 16384), eval_samples=34,
        eval_batch_size=68, eval_group_by_budget=True, eval_engine="varlen", perplexity_windows=8, perplexity_docs="long",
        perplexity_bucket=2048, timing_steps=20, jobs=("corpus", "pack", "train", "eval"),
        summary_json="paper_gpu.json"),
}
# `paper-gpu-short`: a quick check of a GPU machine before paper-gpu's long runs, and a first look at the
# comparison. It takes every path paper-gpu takes (16K windows, bf16 under ZeRO-1, RULER's batch of 68 prompts
# of 16K, the held-out loss by position) in one command sized to take minutes, so that a missing wheel, a kernel
# that fails on this GPU or too little memory shows before the long runs start: the four variants in bf16 on
# paper-gpu's windows (the same corpus, budget and seed: its first 100), 100 steps each, RULER 4K-16K with
# paper-gpu's samples (the same standard-error bound) and the held-out loss by position on the last checkpoint
# alone; no fp32 pair. Its length is an estimate: the steps take 4 x 100 x 0.317 s = 127 s on an H100 by
# anchor/varlen's median step at 16K, 197 s by its mean of 0.492 s (4 timed steps, the last 3x the median;
# results/gpu/train_gpu_h100.json); each run's start, its checkpoint and
# the evaluation are not measured on a GPU yet (the summary records every job's seconds).
PROFILES["paper-gpu-short"] = replace(
    PROFILES["paper-gpu"], train_steps=100, eval_window=1, fp32_variants=(), fp32_steps=0, timing_steps=0,
    summary_json="paper_gpu_short.json")

