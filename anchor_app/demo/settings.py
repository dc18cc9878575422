"""The demo's settings and stage names: what every other module of `anchor_app.demo` reads.

`STAGES` in the pipeline's order, `NEEDS` (the stages each one reads), `TITLES` (the page's headings),
`DemoSettings` (everything a stage's result depends on besides its inputs) and `PROFILES` (`--profile`).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"
STAGES = ("top5", "corpus", "pack", "audit", "train", "parity", "eval", "bench")
NEEDS = {"pack": ("corpus",), "audit": ("corpus",), "train": ("pack",), "parity": ("train",), "eval": ("train",),
         "bench": ("corpus",)}
TITLES = {"top5": "Next-token top-5: the oracle against transformers", "corpus": "The embedded corpus",
          "pack": "Packed windows", "audit": "Precision audit: RoPE in bf16",
          "train": "Training: AnchorAttention against full attention",
          "parity": "Parity of the trained checkpoint: the trainer against the oracle",
          "eval": "Evaluation: RULER averaged over the last checkpoints", "bench": "Speed: anchor against full"}
DEMO_JSON = "demo.json"


@dataclass(frozen=True)
class DemoSettings:
    """Everything a stage's result depends on (besides its inputs): the fingerprints hash these."""

    model: str = "default"
    prompt: str = DEFAULT_PROMPT
    policy: str = "fp32"
    seq_len: int = 1024                       # pack and train windows
    budget: int = 400_000                     # tokens drawn from the corpus for packing
    train_variants: tuple[str, ...] = ("anchor", "full")
    train_steps: int = 4
    global_batch: int = 1
    lr: float = 1e-4                          # higher than the paper's 2e-5: a short run should move
    train_engine: str = "varlen"              # costs what the mask says, trains on CPU
    train_dtype: str = "float32"
    eval_every: int = 2                       # evaluation checkpoints: every eval_every steps ...
    eval_window: int = 4                      # ... over the last eval_window (paper: 10 over 50)
    parity_seq_len: int = 97
    parity_policies: tuple[str, ...] = ("fp32", "bf16")   # forward cases on the whole trained model
    parity_grad_layers: int = 2               # gradient cases (fp32) on its first layers (0: all)
    eval_tasks: tuple[str, ...] = ("niah_single_1", "vt")
    eval_lengths: tuple[int, ...] = (1024, 2048)
    eval_samples: int = 4
    eval_dtype: str = "auto"                  # bf16 where it multiplies faster (CUDA, CPUs with bf16 units;
                                              # anchor_app.eval.dtype), else fp32: eval.json records which and why
    eval_engine: str = "varlen"               # the prefill's engine: fused per prompt (sdpa's padded batch
                                              # takes the masked path: 1.9x slower at 4K on this CPU)
    perplexity_windows: int = 1
    bench_seq_lens: tuple[int, ...] = (2048, 4096)
    bench_windows: int = 1
    bench_repeats: int = 2
    seed: int = 0


# `make paper-small`: the paper's comparison at small scale (four variants, RULER 1K-4K, five checkpoints).
PROFILES = {
    "demo": DemoSettings(),
    "paper-small": DemoSettings(
        seq_len=4096, budget=1_200_000, train_variants=("full", "intra_doc", "intra_doc_reset", "anchor"),
        train_steps=20, global_batch=1, eval_every=4, eval_window=20, parity_seq_len=515,
        eval_tasks=("niah_single_1", "niah_multikey_1", "vt"), eval_lengths=(1024, 2048, 4096),
        eval_samples=4, perplexity_windows=2, bench_seq_lens=(4096, 8192, 16384), bench_windows=2),
}

