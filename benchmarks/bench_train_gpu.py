"""`anchor train` against the plain transformers loop a user would write instead, on one GPU.

    python benchmarks/bench_train_gpu.py [--model default] [--seq-len 16384,32768] [--steps 8] [--warmup 2]
        [--rounds 1] [--plain sdpa,flex_attention] [--runs full/varlen,intra_doc/varlen,anchor/varlen,intra_doc/flex,anchor/flex]
        [--phases] [--out results/gpu/train_gpu_<gpu>.json]

The same model (its real weights), the same packed windows in the same order, bf16, one window a step:

(a) the plain loop: `AutoModelForCausalLM` (stock transformers, `attn_implementation` "sdpa" or
    "flex_attention"), each window's documents packed by `DataCollatorWithFlattening` (input_ids, labels
    with -100 at each document's first token, position_ids restarting per document: transformers then masks
    attention within each document, the intra-document mask with reset positions; the window's padding
    slots as one more sequence with no labels, so every step has the window's shape), `out.loss.backward()`,
    `clip_grad_norm_`, `torch.optim.AdamW` over the bf16 parameters;
(b) `anchor train` (torchtrain on DeepSpeed ZeRO-1 bf16, fp32 master weights) with each variant/engine of
    `--runs`, its step times read from the run's metrics.jsonl (the step alone, checkpoints excluded).

Per configuration, over `--rounds` rounds (each configuration in turn, then again): the median and the mean
step time after each run's `--warmup` steps (flex compiles on its first; a run's last step can take several
times its median, so the two can differ), the last step over the median, window slots
per second, the CUDA peak memory, and the MFU: the useful FLOPs of the mask it computes
(anchor_core/flops.py: 6 P per token for the matmuls, attention over the mask's pairs, forward and
backward) over the step time and the GPU's dense bf16 peak. Ratios against the plain loop are taken
within this one run, at each length. The RoPE base is raised to `--rope-theta` (5e5, the paper-gpu
profile's) so the model accepts windows past its 8192 positions.

`--phases` also times each anchor train step's parts (the loader, the forward with the fused loss,
DeepSpeed's backward, DeepSpeed's optimizer step), the device synchronized before and after each: to find
where a slow step spends its time. The synchronizations cost the overlap of host and device, so a run with
`--phases` measures where the time goes, not the throughput.

On a CPU the script dry-runs (tiny sizes, `--model random:llama`): the flex configurations are left out
with the reason (FlexAttention has no CPU backward) and no MFU is given. A configuration that fails (out
of memory, say) is recorded with its error and the others go on; the JSON is rewritten after each configuration's
run (a length still being measured has `"complete": false`), so a benchmark stopped at a time limit keeps what it
measured.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import anchor_steps  # noqa: E402  (anchor train's step seconds, from its metrics.jsonl)

# Dense bf16 tensor-core peaks (NVIDIA's data sheets, without sparsity), by a word of the device name.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
PLAIN = ("sdpa", "flex_attention")
RUNS = ("full/varlen", "intra_doc/varlen", "anchor/varlen", "intra_doc/flex", "anchor/flex")


def peak_flops() -> tuple[float | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device"
    name = torch.cuda.get_device_name()
    for word, peak in PEAK_BF16.items():
        if word in name:
            return peak, f"{name}: dense bf16 peak {peak / 1e12:.1f} TFLOP/s (data sheet)"
    return None, f"{name}: no known bf16 peak"


def default_out(gpu: str | None) -> Path:
    """results/train_gpu_<where>.json beside this script: the word of PEAK_BF16 in the GPU's name
    ("NVIDIA H100 80GB HBM3" -> h100), else the name as a file-name word; "cpu" without one."""
    import re

    word = "cpu" if gpu is None else next((w.lower() for w in PEAK_BF16 if w in gpu),
                                          re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-"))
    return Path(__file__).resolve().parents[1] / "results" / ("speed" if gpu is None else "gpu") / f"train_gpu_{word}.json"


def documents(tokens, doc_ids) -> list[dict[str, list[int]]]:
    """One window as DataCollatorWithFlattening's features: its documents (runs of equal non-negative
    doc_ids), then its padding slots as one more sequence whose labels are all -100. The collated batch
    keeps the window's T slots, so FlexAttention compiles for one shape (fed without its padding, each step
    would bring a new length and a new compile)."""
    import numpy as np

    keep = doc_ids >= 0
    t, d = tokens[keep], doc_ids[keep]
    starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
    ends = np.r_[starts[1:], len(d)]
    out = [{"input_ids": t[s:e].tolist(), "labels": t[s:e].tolist()} for s, e in zip(starts, ends)]
    if (~keep).any():
        pad = tokens[~keep].tolist()
        out.append({"input_ids": pad, "labels": [-100] * len(pad)})
    return out


def plain_steps(cfg, spec, state, data, implementation: str, steps: int) -> list[float]:
    """Seconds per optimizer step of the hand-written loop."""
    import torch
    from transformers import DataCollatorWithFlattening

    from anchor_core.data.packed import Loader
    from parity_tests.hf_stack import stock_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # stock transformers: the family's class from its config, the weights in bf16, no anchor code in the model
    model = stock_model(spec, state, "bfloat16", attn_implementation=implementation).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                            weight_decay=cfg.optim.weight_decay)
    collate = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    loader = Loader(data, batch_size=1, variant="intra_doc", seed=cfg.data.seed)  # the trainer's windows, in its order
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        w = next(loader)
        batch = collate(documents(w.tokens[0], w.doc_ids[0]))
        batch = {k: torch.as_tensor(v, device=device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # waits for the step, as a user's logging does
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del model, opt
    return times


def window_pairs(data, cfg, steps: int, variant: str) -> list[int]:
    """Allowed pairs of `variant`'s mask summed over the first `steps` windows the runs train on."""
    import numpy as np

    from anchor_core.data.packed import Loader
    from anchor_core.flops import pairs

    loader = Loader(data, batch_size=1, variant=variant, seed=cfg.data.seed)
    return [int(np.sum(pairs(next(loader).doc_ids, variant))) for _ in range(steps)]


PHASES = ("loader", "forward", "backward", "optimizer")


@contextlib.contextmanager
def phase_timing(steps: list[dict[str, float]]) -> Iterator[None]:
    """While open, each anchor train step appends {phase: seconds} to `steps`: PHASES, and "train_step"
    (the whole `_train_step`, the loader excluded, as the trainer's own step time includes it), the device
    synchronized around each part. Patches the trainer's module functions and the classes' methods the
    training loop calls, and puts them back on exit."""
    import deepspeed
    import torch

    import torchtrain.training.trainer as trainer
    from anchor_core.data.packed import Loader

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    current: dict[str, float] = {}

    def timing(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                current[name] = current.get(name, 0.0) + time.perf_counter() - t0
                if name == "train_step":
                    steps.append({k: current.pop(k, 0.0) for k in (*PHASES, "train_step")})
        return wrapper

    engine = deepspeed.runtime.engine.DeepSpeedEngine
    patches = [(trainer, "_train_step", "train_step"), (trainer, "_micro_batch_loss", "forward"),
               (Loader, "__next__", "loader"), (engine, "backward", "backward"), (engine, "step", "optimizer")]
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in patches]
    try:
        for owner, attr, name in patches:
            setattr(owner, attr, timing(name, getattr(owner, attr)))
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def timed(fn) -> tuple[list[float], float | None]:
    """Step seconds from `fn` and the CUDA peak memory (GiB) it reached, the caches emptied around it."""
    import torch

    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        times = fn()
        return times, torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    finally:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def row(label: str, rounds: list[list[float]], peaks: list[float | None], wall: float, peak_flop_s: float | None,
        flops_per_step: list[float], warmup: int, seq_len: int, echo: bool = True) -> dict[str, Any]:
    """The JSON row of one configuration: the median over every round's steps after its warm-up."""
    kept = [t for times in rounds for t in (times[warmup:] or times)]
    med = statistics.median(kept)
    n = max(len(times) for times in rounds)
    flops = statistics.mean(flops_per_step[warmup:n] or flops_per_step[:n])
    mean = statistics.mean(kept)
    out = {"config": label, "step_s": rounds if len(rounds) > 1 else rounds[0], "median_step_s": med,
           "mean_step_s": mean, "tokens_per_s": seq_len / med, "tokens_per_s_mean": seq_len / mean,
           "last_step_over_median": statistics.mean(times[-1] for times in rounds) / med, "model_flops_per_step": flops, "tflop_s": flops / med / 1e12,
           "mfu": flops / med / peak_flop_s if peak_flop_s else None,
           "peak_memory_gib": max(peaks) if peaks and peaks[0] is not None else None, "wall_s": wall}
    if echo:
        print(f"  {label}: median {med:.3f} s/step, {seq_len / med:,.0f} tok/s, {out['tflop_s']:.1f} TFLOP/s"
              + (f", MFU {out['mfu']:.3f}" if out["mfu"] else "")
              + (f", peak {out['peak_memory_gib']:.1f} GiB" if out["peak_memory_gib"] is not None else ""), flush=True)
    return out


def measure_all(configs: list[tuple[str, Any, list[float]]], rounds: int, peak_flop_s: float | None, warmup: int,
                seq_len: int, report: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Every configuration `rounds` times, in turn (plain, then each anchor train run, then again), so a
    shared machine's drift reaches each alike; a configuration that fails is recorded with its error and
    left out of later rounds. configs: (label, fn(round) -> step seconds, FLOPs per step). `report` gets
    the rows measured so far after each configuration's run (a killed benchmark keeps them)."""
    times: dict[str, list[list[float]]] = {c[0]: [] for c in configs}
    peaks: dict[str, list] = {c[0]: [] for c in configs}
    wall = {c[0]: 0.0 for c in configs}
    errors: dict[str, str] = {}

    def rows_now(echo: bool) -> list[dict[str, Any]]:
        rows = []
        for label, _, flops in configs:
            if not times[label]:
                if label in errors:
                    rows.append({"config": label, "error": errors[label], "wall_s": wall[label]})
                continue
            rows.append(row(label, times[label], peaks[label], wall[label], peak_flop_s, flops, warmup, seq_len,
                            echo=echo))
            if label in errors:  # failed in a later round: the rounds it finished, and why it stopped
                rows[-1]["error"] = errors[label]
        return rows

    for r in range(rounds):
        for label, fn, _ in configs:
            if label in errors:
                continue
            t0 = time.perf_counter()
            try:
                t, peak = timed(lambda: fn(r))
                times[label].append(t)
                peaks[label].append(peak)
            except Exception as e:  # noqa: BLE001 - recorded, the other configurations go on
                traceback.print_exc()
                errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                print(f"  {label}: {errors[label]}", flush=True)
            finally:
                wall[label] += time.perf_counter() - t0
            if report:
                report(rows_now(echo=False))
    return rows_now(echo=True)


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s of each anchor train row over each plain row of the same length, by median step and by mean
    step (a run whose steps are not alike, e.g. a slow last one, moves the two apart), and anchor's step over
    full's."""
    ok = {r["config"]: r for r in rows if "error" not in r and "skipped" not in r}
    out: dict[str, Any] = {}
    plain = {k: r for k, r in ok.items() if k.startswith("plain/")}
    for k, r in ok.items():
        if k.startswith("train/"):
            for p, pr in plain.items():
                out[f"{k} over {p}"] = r["tokens_per_s"] / pr["tokens_per_s"]
                out[f"{k} over {p} (means)"] = r["tokens_per_s_mean"] / pr["tokens_per_s_mean"]
    for engine in ("varlen", "flex"):
        full, anch = ok.get(f"train/full/{engine}"), ok.get(f"train/anchor/{engine}")
        if full and anch:
            out[f"anchor over full step time ({engine})"] = anch["median_step_s"] / full["median_step_s"]
            out[f"anchor over full FLOPs ({engine})"] = anch["model_flops_per_step"] / full["model_flops_per_step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--seq-len", default="16384,32768")
    ap.add_argument("--steps", type=int, default=8, help="steps per configuration, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the median")
    ap.add_argument("--rounds", type=int, default=1, help="times each configuration runs, in turn with the others")
    ap.add_argument("--plain", default=",".join(PLAIN), help="attn_implementation values of the plain loop")
    ap.add_argument("--runs", default=",".join(RUNS), help="variant/engine pairs of anchor train")
    ap.add_argument("--rope-theta", type=float, default=5e5)
    ap.add_argument("--config", default="configs/train/smollm2_2k.yaml", help="the base of the train config")
    ap.add_argument("--phases", action="store_true", help="time each anchor train step's parts, synchronized (slower)")
    ap.add_argument("--out", default=None, help="(default: results/train_gpu_<gpu>.json beside this script, the "
                                                "GPU's word in PEAK_BF16 or its name; train_gpu_cpu.json on a CPU)")
    args = ap.parse_args()

    import torch

    from anchor_core.atomic import write_text_atomic
    from anchor_core.data.packed import PackedData
    from anchor_core.machine import machine
    from anchor_core.weights import load_weights
    from anchor_core.flops import step_flops
    from torchtrain.config import load_train_config, with_changes
    from torchtrain.training.fit import check_model, model_spec
    from torchtrain.training.run_folder import prepare_run
    cuda = torch.cuda.is_available()
    peak, peak_note = peak_flops()
    lengths = [int(x) for x in args.seq_len.split(",")]
    plain_list = [p for p in args.plain.split(",") if p]
    run_list = [tuple(r.split("/")) for r in args.runs.split(",") if r]
    _, state = load_weights(args.model)
    out = Path(args.out or default_out(torch.cuda.get_device_name() if cuda else None))
    result: dict[str, Any] = {
        "benchmark": "anchor train vs a plain transformers loop (DataCollatorWithFlattening, torch AdamW), bf16, one GPU",
        "model": args.model, "rope_theta": args.rope_theta, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds, "phases": "each part synchronized (PHASES)" if args.phases else None,
        "peak_bf16_flop_s": peak, "peak_note": peak_note, "machine": machine(),
        "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
        "mfu_flops": "useful FLOPs of the mask computed: 6 P per token + attention over the mask's pairs (fwd+bwd)",
        "lengths": {},
    }
    t_all = time.perf_counter()
    for T in lengths:
        print(f"T = {T}", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-train-gpu-") as tmp:
            base = [f"model.name={args.model}", "model.dtype=bfloat16", f"model.rope.theta={args.rope_theta}",
                    f"data.seq_len={T}", "data.global_batch=1", "data.micro_batch=1",
                    f"data.pack.budget={int(T * (args.steps + 2) * 1.5)}", f"schedule.steps={args.steps}",
                    "schedule.warmup_steps=1", "parallel.zero_stage=1", "checkpoint.save_every=0", "eval.window=0",
                    "logging.every=1000", "logging.report_to=[]"]
            cfg = load_train_config(args.config, base)
            first = Path(tmp) / "pack"
            prepare_run(with_changes(cfg, {"model.engine": "varlen", "model.variant": "intra_doc"}), first, progress=False)
            data_dir = first / "data"
            data = PackedData.open(data_dir)
            cfg = with_changes(cfg, {"data.path": str(data_dir), "data.seq_len": data.seq_len})
            spec = check_model(cfg, model_spec(cfg), T, memory=False)  # RoPE raised, max_position = T
            flops = {v: [step_flops(spec, n, T)["total"] for n in window_pairs(data, cfg, args.steps, v)]
                     for v in ("full", "intra_doc", "anchor")}
            rows, configs = [], []
            phases: dict[str, list[list[dict[str, float]]]] = {}
            for impl in plain_list:
                label = f"plain/{impl}"
                if impl == "flex_attention" and not cuda:
                    rows.append({"config": label, "skipped": "FlexAttention has no CPU backward"})
                    continue
                configs.append((label, lambda r, impl=impl: plain_steps(cfg, spec, state, data, impl, args.steps),
                                flops["intra_doc"]))
            for k, (variant, engine) in enumerate(run_list):
                label = f"train/{variant}/{engine}"
                if engine == "flex" and not cuda:
                    rows.append({"config": label, "skipped": "FlexAttention has no CPU backward"})
                    continue
                run_cfg = with_changes(cfg, {"model.variant": variant, "model.engine": engine})

                def run(r, k=k, run_cfg=run_cfg, label=label):
                    timing = contextlib.nullcontext()
                    if args.phases:
                        phases.setdefault(label, []).append([])
                        timing = phase_timing(phases[label][-1])
                    with timing:
                        return anchor_steps(run_cfg, Path(tmp) / f"run-{k}-{r}")

                configs.append((label, run, flops["intra_doc" if variant == "intra_doc_reset" else variant]))
            skipped = rows

            def publish(rows: list[dict[str, Any]], complete: bool, echo: bool = False) -> None:
                """This length's rows (with the phases) and ratios into the JSON, rewritten atomically."""
                for r in rows:
                    timed_rounds = phases.get(r["config"])
                    if timed_rounds and all(timed_rounds):  # every round timed its steps
                        r["phases"] = timed_rounds
                        if echo:
                            last = {k: statistics.mean(p[-1][k] for p in r["phases"]) for k in (*PHASES, "train_step")}
                            print(f"  {r['config']} last step: " + ", ".join(f"{k} {v:.3f} s" for k, v in last.items()),
                                  flush=True)
                result["lengths"][str(T)] = {"windows": data.num_windows, "complete": complete,
                                             "rows": rows + skipped, "ratios": ratios(rows)}
                result["seconds"] = time.perf_counter() - t_all
                out.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(out, json.dumps(result, indent=1))

            rows = measure_all(configs, args.rounds, peak, args.warmup, T,
                               report=lambda rows: publish(rows, complete=False))
            publish(rows, complete=True, echo=True)
            for k, v in result["lengths"][str(T)]["ratios"].items():
                print(f"  {k}: {v:.3f}", flush=True)
    print(f"wrote {out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
