"""The memory estimates that refuse a run before any work (`torchtrain.training.memory`), against measured peaks.

    nice -n 5 .venv/bin/python benchmarks/bench_estimates.py [--quick]

Each case runs in a fresh process under `/usr/bin/time -v` ("Maximum resident set size": the peak RSS of
the whole process) and is recorded beside the estimate the verb checks before it starts:

- `anchor train` one step (forward + backward + AdamW + the final checkpoint): `step_memory`, for
  `configs/train/tiny.yaml` (random:llama, 3 layers) at several T with the default engine and sdpa, and
  `configs/train/smollm2_2k.yaml` (SmolLM2-135M, 30 layers, 49K vocabulary) at 1K and 2K;
- `anchor eval` (RULER niah_single_1, 4 prompts in one batch, no perplexity): `forward_memory`, for
  random:llama and SmolLM2 at 4K with sdpa and varlen.

An estimate is meant to be an upper bound of the same order: `ratio` = estimate / peak, expected in
[1, 3] (below 1 the check could let a run through that does not fit). Writes
results/memory/memory_estimates_cpu.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from _peak_rss import GiB, ROOT, measure, pack as pack_corpus


def measured(cmd: list[str]) -> dict:
    row = measure(cmd)
    if "peak_rss_bytes" in row:
        return {"peak_gib": round(row.pop("peak_rss_bytes") / GiB, 3), **row}
    return row


def train_case(config: str, T: int, engine: str, data: Path, tmp: Path) -> dict:
    import torch

    from torchtrain.config import load_train_config
    from torchtrain.attention.engines import resolve_engine
    from torchtrain.training.memory import step_memory
    from torchtrain.training.fit import model_spec
    overrides = [f"data.path={data}", f"data.seq_len={T}", "data.global_batch=1", "data.micro_batch=1",
                 f"model.engine={engine}", "model.rope.theta=1e6", "schedule.steps=1", "checkpoint.save_every=0"]
    cfg = load_train_config(ROOT / config, overrides)
    spec = model_spec(cfg)
    if T > spec.max_position:
        spec = spec.replace(max_position=T)
    ran = resolve_engine(engine, "cpu")
    est = step_memory(spec, seq_len=T, micro_batch=1, dtype=torch.float32, engine=ran, zero_stage=cfg.parallel.zero_stage,
                      procs=1, activation_checkpointing=cfg.model.activation_checkpointing)
    print(f"train {config} T={T} {engine}: estimate {est.total / GiB:.2f} GiB ...", flush=True)
    row = {"verb": "train", "config": config, "seq_len": T, "engine": ran, "estimate_gib": round(est.total / GiB, 3),
           "estimate": est.describe(),
           **measured(["train", "--config", str(ROOT / config), "--out", str(tmp / f"run-{T}-{engine}"),
                       "--no-progress", *overrides])}
    if "peak_gib" in row:
        row["ratio"] = round(row["estimate_gib"] / row["peak_gib"], 2)
    print("  ", {k: row.get(k) for k in ("peak_gib", "ratio", "seconds", "failed")}, flush=True)
    return row


def eval_case(model: str, T: int, engine: str, tmp: Path) -> dict:
    import torch

    from anchor_core.weights import load_spec
    from torchtrain.training.memory import forward_memory

    est = forward_memory(load_spec(model), seq_len=T, batch=4, dtype=torch.float32, engine=engine)
    print(f"eval {model} T={T} {engine}: estimate {est.total / GiB:.2f} GiB ...", flush=True)
    row = {"verb": "eval", "model": model, "seq_len": T, "engine": engine, "estimate_gib": round(est.total / GiB, 3),
           "estimate": est.describe(),
           **measured(["eval", "--model", model, "--out", str(tmp / f"eval-{T}-{engine}-{model.replace(':', '_')}"),
                       "--tasks", "niah_single_1", "--lengths", str(T), "--samples", "4", "--batch-size", "4",
                       "--engine", engine, "--dtype", "float32", "--perplexity-windows", "0", "--no-progress"])}
    if "peak_gib" in row:
        row["ratio"] = round(row["estimate_gib"] / row["peak_gib"], 2)
    print("  ", {k: row.get(k) for k in ("peak_gib", "ratio", "seconds", "failed")}, flush=True)
    return row


def pack(model: str, T: int, corpus: Path, out: Path) -> Path:
    return pack_corpus(corpus, T, out, model=model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny cases only")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "memory" / "memory_estimates_cpu.json"))
    args = ap.parse_args()
    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus
    from anchor_core.machine import machine

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-estimates-") as tmp:
        tmp = Path(tmp)
        write_default_corpus(tmp / "corpus", progress=False)
        corpus = tmp / "corpus" / CORPUS_FILE
        for T in (4097, 16385, 65537):
            data = pack("random:llama", T, corpus, tmp / f"pack-tiny-{T}")
            for engine in ("auto", "sdpa") if T <= 16385 else ("auto",):
                rows.append(train_case("configs/train/tiny.yaml", T, engine, data, tmp))
        if not args.quick:
            for T in (1025, 2049):
                data = pack("default", T, corpus, tmp / f"pack-smol-{T}")
                rows.append(train_case("configs/train/smollm2_2k.yaml", T, "auto", data, tmp))
        for model in ("random:llama",) if args.quick else ("random:llama", "default"):
            for engine in ("sdpa", "varlen"):
                rows.append(eval_case(model, 4096, engine, tmp))
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    result = {"benchmark": "memory estimates (torchtrain.training.memory) against the measured peak RSS of a fresh process",
              "method": "/usr/bin/time -v, Maximum resident set size; fp32; one process",
              "rows": rows, "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
              "machine": machine()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"estimate / peak: {result['ratio_min']} .. {result['ratio_max']}; wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
