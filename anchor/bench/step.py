"""A whole training step per variant, through `anchor train` itself.

The model is the bench model cut to its first `layers` layers (real weights where the model has
them), written as a Hugging Face folder with the model's tokenizer (max positions raised to T: the
cost does not depend on the RoPE base); the data is the corpus packed at T. Each variant trains
`steps` optimizer steps of one window (global batch 1, fp32, ZeRO 0, the given engine) in this
process with `torchtrain.training.trainer.train`; a step's time is what the trainer records in
metrics.jsonl (tokens_per_s), the first step (warm-up) left out; the peak resident memory is the
process's over the whole run (model, optimizer, activations, the final checkpoint's write).
"""

from __future__ import annotations

import gc
import re
import statistics
from pathlib import Path
from typing import Any

from anchor.bench.timing import peak_memory
from anchor_core.errors import InputError
from anchor_core.export import export_hf
from anchor_core.weights import load_weights
from torchtrain.config import load_train_config
from torchtrain.training.metrics import read_metrics
from torchtrain.training.trainer import train

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def cut_model(model: str, layers: int, max_position: int, folder: Path) -> tuple[Path, Any]:
    """`model`'s first `layers` layers as a Hugging Face folder; returns (folder, spec)."""
    spec, state = load_weights(model)
    if not 1 <= layers <= spec.num_layers:
        raise InputError(f"--step-layers must be in [1, {spec.num_layers}] for this model, got {layers}")
    spec = spec.replace(num_layers=layers, max_position=max(spec.max_position, max_position))
    state = {k: v for k, v in state.items() if not ((m := _LAYER.match(k)) and int(m.group(1)) >= layers)}
    return export_hf(spec, state, folder, tokenizer_of=model), spec


def time_steps(model_dir: Path, data: Path, T: int, variant: str, engine: str, run: Path, *, steps: int = 3,
               dtype: str = "float32", device: str = "cpu") -> dict[str, Any]:
    """Train `steps` steps of one window (the trainer runs on CUDA where there is one); -> {step_s
    (median, warm-up excluded), step_s_all, loss, peak_rss_gib or peak_cuda_gib}."""
    cfg = load_train_config(None, [
        f"model.name={model_dir}", f"model.variant={variant}", f"model.engine={engine}", f"model.dtype={dtype}",
        f"data.path={data}", f"data.seq_len={T}", "data.global_batch=1", "data.micro_batch=1", "optim.lr=2e-5",
        f"schedule.steps={steps}", f"parallel.zero_stage={0 if dtype == 'float32' else 1}", "checkpoint.save_every=0",
        "checkpoint.keep_last=1", "eval.window=0", "logging.every=1000", "logging.report_to=[]"])
    with peak_memory(device) as mem:
        train(cfg, run, progress=False)
    gc.collect()  # the trainer's model and optimizer sit in reference cycles: freed now, not on top of the next run
    rows = read_metrics(run)
    times = [T / r["tokens_per_s"] for r in rows]
    timed = times[1:] or times
    return {"step_s": round(statistics.median(timed), 3), "step_s_all": [round(t, 3) for t in times],
            "loss": rows[-1]["loss"], **mem}
