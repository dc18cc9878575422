"""`anchor train`'s step against a plain transformers + torch AdamW loop: the trainer's overhead.

    .venv/bin/python benchmarks/bench_train.py [--config configs/train/smollm2_2k.yaml] [--steps 4] [--rounds 2] [section.key=value ...]

Both sides train the same model with the same engine, windows, global batch, micro-batches,
masked loss, AdamW groups and clipping, in this one process: the plain loop is what a user would
write by hand (forward, masked cross-entropy over the global count, backward per micro-batch,
`clip_grad_norm_`, `AdamW.step`; on CUDA where there is one, with the RoPE the config sets); `anchor train` adds DeepSpeed (ZeRO as configured), the loader,
metrics, the count all-reduce and the progress line. The rounds alternate (plain, then anchor
train) so slow drift of a shared machine hits both; the first step of each run is a warm-up and is
left out; the ratio is that of the median step times over all rounds. Checkpoint writing is not a
step cost and is left out (the trainer's last step writes one after its metrics line).

Writes results/speed/train_overhead_<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def plain_steps(cfg, data, steps: int) -> list[float]:
    """Seconds per optimizer step of the hand-written loop."""
    import torch
    from torchtrain.model.loss import token_cross_entropy

    from anchor_core.data.packed import Loader
    from torchtrain.model import build_model
    from torchtrain.training.optim import param_groups

    from torchtrain.training.fit import check_model, model_spec
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = check_model(cfg, model_spec(cfg), cfg.data.seq_len, memory=False)  # the RoPE the trainer trains with
    model = build_model(cfg.model.name, engine=cfg.model.engine, dtype=cfg.model.dtype, rope=spec.rope, seed=cfg.data.seed).to(device)
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(param_groups(model, cfg.optim), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps)
    loader = Loader(data, batch_size=cfg.data.global_batch, variant=cfg.model.variant, seed=cfg.data.seed)
    gas = cfg.data.global_batch // cfg.data.micro_batch
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(loader)
        tokens = torch.as_tensor(batch.tokens, dtype=torch.long, device=device)
        targets = torch.roll(tokens, -1, dims=1)
        mask = torch.as_tensor(batch.loss_mask, dtype=torch.float32, device=device)
        count = mask.sum().clamp_min(1.0)
        for m in range(gas):
            rows = slice(m * cfg.data.micro_batch, (m + 1) * cfg.data.micro_batch)
            out = model(input_ids=tokens[rows],
                        position_ids=torch.as_tensor(batch.positions[rows], dtype=torch.long, device=device),
                        doc_ids=torch.as_tensor(batch.doc_ids[rows], dtype=torch.long, device=device),
                        variant=cfg.model.variant)
            ce = token_cross_entropy(out.logits, targets[rows])
            ((ce * mask[rows]).sum() / count).backward()
        if cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def anchor_steps(cfg, run: Path) -> list[float]:
    """Seconds per optimizer step of `anchor train` (from its metrics.jsonl)."""
    from torchtrain.training.trainer import train

    train(cfg, run, progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    T = cfg.data.seq_len
    return [cfg.data.global_batch * T / r["tokens_per_s"] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/train/smollm2_2k.yaml")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is a warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "speed"))
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides (as for anchor train)")
    args = ap.parse_args()

    import torch

    from anchor_core.data.packed import PackedData
    from anchor_core.machine import machine
    from torchtrain.config import load_train_config, with_changes
    from torchtrain.training.fit import resolved_engine
    from torchtrain.training.run_folder import prepare_run
    cfg = load_train_config(args.config, [*args.overrides, f"schedule.steps={args.steps}", "checkpoint.save_every=0",
                                          "eval.window=0", "logging.every=1000", "logging.report_to=[]"])
    cfg = with_changes(cfg, {"model.engine": resolved_engine(cfg)})  # the plain loop builds its model with the engine the trainer runs
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        first = Path(tmp) / "run-0"
        prepare_run(cfg, first, progress=False)  # packs the data once; later runs reuse it
        data_dir = first / "data" if (first / "data" / "pack.json").is_file() else Path(cfg.data.path)
        cfg = with_changes(cfg, {"data.path": str(data_dir)})
        data = PackedData.open(data_dir)
        cfg = with_changes(cfg, {"data.seq_len": data.seq_len})
        plain, anchor = [], []
        for r in range(args.rounds):
            p = plain_steps(cfg, data, args.steps)
            a = anchor_steps(cfg, Path(tmp) / f"run-{r + 1}")
            print(f"round {r}: plain {[round(x, 2) for x in p]} s, anchor train {[round(x, 2) for x in a]} s", flush=True)
            plain += p[1:]
            anchor += a[1:]
    mp, ma = statistics.median(plain), statistics.median(anchor)
    tokens = cfg.data.global_batch * cfg.data.seq_len
    result = {
        "benchmark": "anchor train step vs a plain transformers + torch AdamW loop",
        "config": args.config, "overrides": args.overrides,
        "model": cfg.model.name, "engine": cfg.model.engine, "dtype": cfg.model.dtype, "seq_len": cfg.data.seq_len,
        "global_batch": cfg.data.global_batch, "micro_batch": cfg.data.micro_batch, "zero_stage": cfg.parallel.zero_stage,
        "steps_per_run": args.steps, "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
        "plain_step_s": plain, "anchor_step_s": anchor,
        "plain_median_s": mp, "anchor_median_s": ma,
        "plain_tokens_per_s": tokens / mp, "anchor_tokens_per_s": tokens / ma,
        "overhead": ma / mp - 1.0,
        "machine": machine(),
    }
    print(f"plain {tokens / mp:.0f} tok/s, anchor train {tokens / ma:.0f} tok/s: overhead {100 * (ma / mp - 1):+.1f}%")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"train_overhead_{'cuda' if torch.cuda.is_available() else 'cpu'}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
