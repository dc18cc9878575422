"""The demo's checks before any work, and the dtype its runs train and evaluate in.

`resolve_dtype` turns a `train_dtype` of `auto` into bfloat16 where the machine has bf16 units and float32
elsewhere (`choose_dtype`, with the reason the page shows). `feasible` leaves out the RULER tasks whose prompts do
not fit the evaluation lengths with the model's tokenizer, `check_disk` holds the training runs' checkpoints
(`checkpoint_bytes`) against the free disk, and `_check_model` reads the model's config, so that each of these
fails with one line before the demo folder holds anything.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from anchor.demo.settings import DemoSettings, parse_run, run_names, times_full
from anchor.eval.perplexity import heldout_windows
from anchor.eval.runner import tasks_that_do_not_fit
from anchor_core import machine
from anchor_core.errors import InputError
from anchor_core.flops import matmul_params
from anchor_core.tokenizer import load_tokenizer
from anchor_core.weights import load_spec


def choose_dtype() -> dict[str, Any]:
    """The demo's training and evaluation dtype on this machine, and why: bfloat16 where it has bf16 units
    (CUDA; a CPU with avx512_bf16 or AMX, anchor_core.machine.cpu_bf16): it multiplies bf16 natively (a 1024²
    matmul ran 3.1x faster than in fp32 on a 2-core AVX-512-bf16 EPYC, anchor/eval/dtype.py), and the
    runs train in the precision whose effect on RoPE the paper is about; float32 elsewhere, where bf16 is
    emulated and 3-6x slower (anchor_core.machine)."""
    import torch


    if torch.cuda.is_available():
        return {"dtype": "bfloat16", "reason": f"a CUDA GPU ({torch.cuda.get_device_name(0)}) multiplies bf16 "
                                               "natively (the paper's precision)", "bf16_units": ["cuda"]}
    units = machine.cpu_bf16()
    if units:
        return {"dtype": "bfloat16", "reason": f"this CPU has bf16 units ({', '.join(units)}): it multiplies bf16 "
                                               "natively, and the runs train in the precision the paper is about",
                "bf16_units": units}
    return {"dtype": "float32", "reason": "this CPU has no bf16 units (no avx512_bf16, no AMX): bf16 would be "
                                          "emulated, slower than fp32", "bf16_units": []}


def resolve_dtype(s: DemoSettings) -> tuple[DemoSettings, dict[str, Any] | None]:
    """`s` with a `train_dtype` of `auto` resolved by `choose_dtype` (evaluation too, where it is `auto`; ZeRO-1
    in bf16, which the trainer needs), and the choice; `s` and None where the dtype is given."""
    if s.train_dtype != "auto":
        return s, None
    choice = choose_dtype()
    dtype = choice["dtype"]
    zero = max(s.zero_stage, 1) if dtype == "bfloat16" else s.zero_stage
    return replace(s, train_dtype=dtype, zero_stage=zero,
                   eval_dtype=dtype if s.eval_dtype == "auto" else s.eval_dtype), choice


def feasible(s: DemoSettings, todo: tuple[str, ...]) -> tuple[DemoSettings, list[str]]:
    """The settings with what cannot run on this model left out, and a line for each thing left out; an
    InputError (before any work) where nothing of a job would be left. What is left out: the RULER tasks whose prompts
    do not fit every evaluation length with the model's tokenizer (a byte-level tokenizer needs ~1.7K tokens
    for `vt`); they are left out of the whole grid, so every length averages the same tasks."""
    if "eval" not in todo:
        return s, []

    tok = load_tokenizer(s.model)
    if s.perplexity_windows and s.perplexity_docs == "long":  # enough long held-out documents, before training

        heldout_windows(tok, max(s.eval_lengths), s.perplexity_windows, s.perplexity_data or None,
                        whole_documents=True)
    misfits = tasks_that_do_not_fit(tok, s.eval_tasks, s.eval_lengths, s.eval_samples, s.seed)
    if not misfits:
        return s, []
    keep = tuple(t for t in s.eval_tasks if t not in misfits)
    if not keep:
        first = next(iter(misfits.values()))
        raise InputError(f"no RULER task of the demo fits its evaluation lengths "
                         f"{', '.join(map(str, s.eval_lengths))} with the model {s.model!r}'s tokenizer ({first}); "
                         "give longer lengths or leave out the eval job (--jobs)")
    return replace(s, eval_tasks=keep), [f"RULER {t}: {why}" for t, why in misfits.items()]


def bytes_per_param(dtype: str, zero_stage: int) -> int:
    """A checkpoint's bytes per parameter: DeepSpeed's module (4 in fp32, 2 in bf16), AdamW's two moments (8),
    ZeRO >= 1's fp32 copy of the parameters (4), and hf/ in the training dtype (4 in fp32, 2 in bf16). 16 in fp32
    under ZeRO-0: SmolLM2-135M's measured 2.1 GB is 15.6. `auto` counts fp32's (16 either way: bf16 trains under
    ZeRO-1)."""
    elem = 2 if dtype == "bfloat16" else 4
    return elem + 8 + (4 if zero_stage >= 1 else 0) + elem


def checkpoint_bytes(s: DemoSettings) -> int:
    """About how many bytes the `train` job's checkpoints take: every run's evaluation checkpoints and its
    last (kept for good), `bytes_per_param` each."""
    spec = load_spec(s.model)
    params = matmul_params(spec) + (0 if spec.tie_embeddings else spec.vocab_size * spec.hidden_size)
    total = 0
    for run in run_names(s):
        r = parse_run(s, run)
        steps, window = r["steps"], r["eval_window"]
        count = len({k for k in range(1, steps + 1) if steps - k < window and (steps - k) % s.eval_every == 0}
                    | {steps})
        total += count * params * bytes_per_param(r["dtype"], s.zero_stage)
    if times_full(s):  # its last checkpoint
        total += params * bytes_per_param(s.train_dtype, s.zero_stage)
    return total


def check_disk(s: DemoSettings, out: Path) -> None:
    """The checkpoints still to write (checkpoint_bytes less what `out/train` holds) against the disk's free
    space: one line and exit 2 before any work, where they would not fit."""
    need = checkpoint_bytes(s)
    train = out / "train"
    have = sum(f.stat().st_size for f in train.rglob("*") if f.is_file()) if train.is_dir() else 0
    where = out
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need - have > free:
        raise InputError(f"the training runs' checkpoints need about {(need - have) / 1e9:.1f} GB "
                         f"({len(run_names(s))} runs, their evaluation checkpoints and last ones); "
                         f"{free / 1e9:.1f} GB are free here: free some space or name an --out on a larger disk",
                         path=where)


def _check_model(model: str) -> None:
    """The model exists and its config reads (weights and tokenizer are checked by the first job that loads
    them; a failure before any job finished removes the folder it created)."""
    load_spec(model)
