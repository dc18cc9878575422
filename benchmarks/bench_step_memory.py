"""Peak memory (CPU RSS) of one training step, with the lm-head fused with the loss and without.

    nice -n 5 .venv/bin/python benchmarks/bench_step_memory.py [--seq-len 32768] [--check-len 8192]
        [--check-lens 4096,8192] [--docs 5] [--before auto|run|estimate]
        [--bench-cases default:2:1024,...] [--attention-cases varlen:16384,...]
    nice -n 5 .venv/bin/python benchmarks/bench_step_memory.py --estimates-only   # the last two kinds only

One step = forward + backward (no optimizer step) of one window of T slots of random tokens with a
few documents, variant `anchor`, engine `varlen`, fp32, through a 2-layer model of SmolLM2's shape
(`anchor_core.weights.load_spec("default").replace(num_layers=2)`, random weights from
`anchor_core.weights.random_state`). Cases:

  logits  before: the model's logits [1, T, V] and `token_cross_entropy` (the trainer's old path,
          still used under ZeRO-3)
  fused   after:  `final_hidden_states` + `head_cross_entropy` (the trainer's path at ZeRO 0-2)

Each case runs in a fresh subprocess: it builds the model and the window, resets the peak with
`echo 5 > /proc/self/clear_refs`, runs the step and reads VmHWM from /proc/self/status ("peak"),
next to VmRSS just before the step ("base"). Both cases are measured at the `--check-lens` (small
enough to run anywhere); at `--seq-len` the fused case is measured and the logits case is measured
only where the machine has the memory for it (`--before auto`: MemAvailable above its estimate plus
4 GiB), else estimated: the fused case's peak at `--seq-len`, plus the logits-minus-fused peak
measured at the longest check length, plus the per-slot growth of that difference measured between
the two check lengths (the model of it, fp32 logits and their gradient, is 2 x V x 4 bytes per
slot; both are recorded). The JSON says which.

The estimate (`anchor.bench.memory`, the sizes `anchor bench` checks before any work) beside every
measured peak, with estimate / measured:
  logits, fused  what the step adds over the built model (step_bytes): gradients 4 P, the activations
                 (`activation_bytes_per_slot`, L + 1 layers) and the lm-head's chunks (fused) or the
                 logits and their gradient, 2 x V x 4 bytes per slot (logits)
  bench          `anchor bench`'s training-step rows as it runs them (`--bench-cases MODEL:LAYERS:T`): a
                 fresh process cuts the model, packs the default corpus at T and trains 2 steps
                 (`anchor.bench.step.time_steps`, variant anchor, engine varlen); its whole life's
                 peak RSS (VmHWM) against `step_memory(...).total`
  attention      `anchor bench`'s attention rows (`--attention-cases ENGINE:T`, SmolLM2's heads, the
                 variants full, intra_doc, anchor, 1 slimpajama window): a fresh process's peak RSS
                 against `attention_memory(...).total`
`--estimates-only` runs the last two and adds the estimates to the rows of the JSON already there (their
peaks measured by an earlier run; the estimate is a function of the recorded sizes), keeping them.

Writes results/memory/step_memory_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GiB = 2**30


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _mem_available() -> int:
    from torchtrain.attention.engines import available_memory  # MemAvailable of /proc/meminfo, as the trainer's size check

    free = available_memory("cpu")
    if free is None:
        raise RuntimeError("MemAvailable not in /proc/meminfo")
    return free


def window(T: int, docs: int, vocab: int, seed: int):
    """One anchor window (docs/DESIGN.md §1): the BOS anchor at slot 0, then `docs` documents of random
    lengths filling the T slots, random tokens. Returns the Batch of `anchor_core.data.batch.make_batch`."""
    import numpy as np

    from anchor_core.data.batch import make_batch

    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(2, T - 1), size=docs - 1, replace=False))
    seg = np.zeros(T, dtype=np.int32)
    for i, (s, e) in enumerate(zip([1, *cuts], [*cuts, T]), start=1):
        seg[s:e] = i
    tokens = rng.integers(3, vocab, size=T)
    tokens[0] = 1
    return make_batch(tokens[None], seg[None], np.zeros((1, T), dtype=bool), "anchor")


def run_case(case: str, T: int, docs: int, seed: int) -> dict:
    """One step of `case` in this process; the measured memory in bytes."""
    import torch

    from anchor_core.weights import load_spec, random_state
    from torchtrain.model.loss import final_hidden_states, head_cross_entropy, token_cross_entropy
    from torchtrain.model import model_from_weights

    spec = load_spec("default").replace(num_layers=2)
    model = model_from_weights(spec, random_state(spec, seed), engine="varlen", dtype="float32").train()
    b = window(T, docs, spec.vocab_size, seed)
    inputs = {"input_ids": torch.as_tensor(b.tokens, dtype=torch.long),
              "position_ids": torch.as_tensor(b.positions, dtype=torch.long),
              "doc_ids": torch.as_tensor(b.doc_ids, dtype=torch.long), "variant": "anchor"}
    targets = torch.roll(inputs["input_ids"], -1, dims=1)
    mask = torch.as_tensor(b.loss_mask, dtype=torch.float32)
    base = _status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    t0 = time.perf_counter()
    if case == "fused":
        ce = head_cross_entropy(model, final_hidden_states(model, model, **inputs), targets)
    else:
        ce = token_cross_entropy(model(**inputs).logits, targets)
    loss = (ce * mask).sum() / mask.sum()
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM") * 1024
    return {"case": case, "seq_len": T, "docs": docs, "vocab": spec.vocab_size, "hidden": spec.hidden_size,
            "layers": spec.num_layers, "base_rss_bytes": base, "peak_rss_bytes": peak,
            "step_bytes": peak - base, "peak_rss_gib": round(peak / GiB, 3), "step_s": round(seconds, 2),
            "loss": float(loss.detach()), "torch_threads": torch.get_num_threads()}


def run_bench_case(model: str, layers: int, T: int) -> dict:
    """`anchor bench`'s step rows in this (fresh) process, as `_bench_steps` runs them; the whole process's
    peak RSS. The estimate `anchor bench` checks before any work, beside it."""
    import tempfile

    import torch

    from anchor_core.weights import load_spec
    from anchor.bench.memory import step_memory
    from anchor.bench.run import step_pack
    from anchor.bench.step import cut_model, time_steps

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-step-memory-") as tmp:
        folder, _ = cut_model(model, layers, T, Path(tmp) / "model")
        step_pack(folder, T, Path(tmp) / "data", model=model, data=None)
        row = time_steps(folder, Path(tmp) / "data", T, "anchor", "varlen", Path(tmp) / "run", steps=2)
    peak = _status_kib("VmHWM") * 1024
    need = step_memory(load_spec(model), T, layers, engine="varlen", dtype="float32", device="cpu")
    return {"case": "bench", "model": model, "layers": layers, "seq_len": T, "engine": "varlen", "variant": "anchor",
            "steps": 2, "peak_rss_bytes": peak, "peak_rss_gib": round(peak / GiB, 3),
            "estimate_bytes": need.total, "estimate_parts": need.parts,
            "estimate_over_peak": round(need.total / peak, 3), "step_s": row["step_s"],
            "run_s": round(time.perf_counter() - t0, 1), "torch_threads": torch.get_num_threads()}


def run_attention_case(engine: str, T: int) -> dict:
    """`anchor bench`'s attention rows at T on `engine` in this (fresh) process (SmolLM2's heads, three
    variants, one slimpajama window); the whole process's peak RSS, and the estimate beside it."""
    import torch

    from anchor_core.weights import load_spec
    from anchor.bench.memory import attention_memory
    from anchor.bench.timing import Heads, time_variants
    from anchor.bench.windows import synthetic_seg

    spec = load_spec("default")
    variants = ["full", "intra_doc", "anchor"]
    t0 = time.perf_counter()
    seg = synthetic_seg("slimpajama", T, 1, 0)
    time_variants(engine, variants, seg, Heads(spec.num_heads, spec.num_kv_heads, spec.head_dim), device="cpu",
                  dtype="float32", repeats=1)
    peak = _status_kib("VmHWM") * 1024
    need = attention_memory(spec, T, engine, len(variants), windows=1, dtype="float32", device="cpu")
    return {"case": "attention", "model": "default (heads)", "seq_len": T, "engine": engine, "variants": variants,
            "windows": 1, "peak_rss_bytes": peak, "peak_rss_gib": round(peak / GiB, 3),
            "estimate_bytes": need.total, "estimate_parts": need.parts,
            "estimate_over_peak": round(need.total / peak, 3), "run_s": round(time.perf_counter() - t0, 1),
            "torch_threads": torch.get_num_threads()}


def fwd_bwd_estimate(row: dict) -> dict:
    """The estimate of what a `logits`/`fused` step adds over the built model (step_bytes), from its sizes."""
    from anchor_core.weights import load_spec
    from anchor.bench.memory import HEAD_BYTES
    from torchtrain.training.memory import activation_bytes_per_slot, parameters

    spec = load_spec("default").replace(num_layers=row["layers"])
    T = row["seq_len"]
    parts = {"gradients": 4 * parameters(spec), "activations": T * activation_bytes_per_slot(spec, 4, layers=spec.num_layers + 1),
             **({"lm-head chunks": HEAD_BYTES} if row["case"] == "fused" else {"logits and gradient": 2 * spec.vocab_size * 4 * T})}
    est = sum(parts.values())
    return {"step_estimate_bytes": est, "step_estimate_parts": parts,
            "step_estimate_over_step_bytes": round(est / row["step_bytes"], 3)}


def _child(cmd: list[str], what: str) -> dict:
    print(f"running {what} ...", flush=True)
    done = subprocess.run([sys.executable, __file__, *cmd], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def in_subprocess(case: str, T: int, docs: int, seed: int) -> dict:
    result = _child(["--child", case, "--seq-len", str(T), "--docs", str(docs), "--seed", str(seed)], f"{case} at T={T}")
    result.update(fwd_bwd_estimate(result))
    print(f"  {case} T={T}: peak RSS {result['peak_rss_gib']:.2f} GiB (step adds "
          f"{result['step_bytes'] / GiB:.2f} GiB, estimate {result['step_estimate_bytes'] / GiB:.2f}: "
          f"x{result['step_estimate_over_step_bytes']}), {result['step_s']} s, loss {result['loss']:.4f}", flush=True)
    return result


def estimate_cases(bench_cases: str, attention_cases: str) -> dict:
    """The `bench` and `attention` cases, each in a fresh process."""
    rows = []
    for case in filter(None, bench_cases.split(",")):
        model, layers, T = case.rsplit(":", 2)
        r = _child(["--child", "bench", "--model", model, "--layers", layers, "--seq-len", T], f"bench {case}")
        rows.append(r)
        print(f"  bench {case}: peak RSS {r['peak_rss_gib']:.2f} GiB, estimate {r['estimate_bytes'] / GiB:.2f} "
              f"(x{r['estimate_over_peak']}), {r['run_s']} s", flush=True)
    for case in filter(None, attention_cases.split(",")):
        engine, T = case.split(":")
        r = _child(["--child", "attention", "--engine", engine, "--seq-len", T], f"attention {case}")
        rows.append(r)
        print(f"  attention {case}: peak RSS {r['peak_rss_gib']:.2f} GiB, estimate {r['estimate_bytes'] / GiB:.2f} "
              f"(x{r['estimate_over_peak']}), {r['run_s']} s", flush=True)
    return {"rows": rows, "how": "fresh process per case; VmHWM of the whole process against anchor.bench.memory's "
                                 "estimate (what `anchor bench` checks against the memory available before any work)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--check-lens", default="4096,8192", help="two lengths where both cases are measured (the estimate's basis)")
    ap.add_argument("--docs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--before", choices=("auto", "run", "estimate"), default="auto",
                    help="the logits case at --seq-len: measured where memory allows (auto), always, or estimated")
    ap.add_argument("--target-gib", type=float, default=8.0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "memory"))
    ap.add_argument("--bench-cases", default="default:2:1024,default:2:2047,random:llama:1:65537",
                    help="MODEL:LAYERS:T of anchor bench's step rows, measured against the estimate")
    ap.add_argument("--attention-cases", default="varlen:8191,sdpa:4095",
                    help="ENGINE:T of anchor bench's attention rows, measured against the estimate")
    ap.add_argument("--estimates-only", action="store_true",
                    help="only the bench and attention cases; the estimates added to the JSON's earlier rows")
    ap.add_argument("--child", choices=("logits", "fused", "bench", "attention"), help=argparse.SUPPRESS)
    ap.add_argument("--model", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="varlen", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "bench":
        print(json.dumps(run_bench_case(args.model, args.layers, args.seq_len)))
        return
    if args.child == "attention":
        print(json.dumps(run_attention_case(args.engine, args.seq_len)))
        return
    if args.child:
        print(json.dumps(run_case(args.child, args.seq_len, args.docs, args.seed)))
        return

    from anchor_core.machine import machine

    path = Path(args.out) / "step_memory_cpu.json"
    if args.estimates_only:
        result = json.loads(path.read_text())
        for row in [*result["check"].values(), result["after"], result["before"]]:
            if "step_bytes" in row:
                row.update(fwd_bwd_estimate(row))
        result["estimates"] = estimate_cases(args.bench_cases, args.attention_cases)
        result["estimates"]["machine"] = machine(mem_available_gib=round(_mem_available() / GiB, 1))
        result["estimates"]["note"] = ("the logits/fused rows' peaks are from the earlier full run (same script, "
                                       "same sizes); their step_estimate_* fields were added by --estimates-only")
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
        return

    lens = sorted(int(x) for x in args.check_lens.split(","))
    if len(lens) != 2:
        raise SystemExit("--check-lens takes two lengths, e.g. 4096,8192")
    check = {f"{c}@{n}": in_subprocess(c, n, args.docs, args.seed) for n in lens for c in ("fused", "logits")}
    diff = {n: check[f"logits@{n}"]["peak_rss_bytes"] - check[f"fused@{n}"]["peak_rss_bytes"] for n in lens}
    V = check[f"fused@{lens[0]}"]["vocab"]
    per_slot_model = 2 * V * 4  # fp32 logits [T, V] and their gradient
    per_slot_measured = (diff[lens[1]] - diff[lens[0]]) / (lens[1] - lens[0])
    print(f"logits minus fused: {diff[lens[0]] / GiB:.2f} GiB at T={lens[0]}, {diff[lens[1]] / GiB:.2f} GiB at "
          f"T={lens[1]}: {per_slot_measured:.0f} bytes per slot (model 2 x V x 4 = {per_slot_model})", flush=True)
    after = in_subprocess("fused", args.seq_len, args.docs, args.seed)
    T = args.seq_len
    estimate = after["peak_rss_bytes"] + diff[lens[1]] + per_slot_measured * (T - lens[1])
    available = _mem_available()
    run_before = args.before == "run" or (args.before == "auto" and available > estimate + 4 * GiB)
    if run_before:
        before = in_subprocess("logits", T, args.docs, args.seed)
        before_source = "measured"
    else:
        print(f"logits at T={T}: estimated ({available / GiB:.1f} GiB available, "
              f"estimate {estimate / GiB:.1f} GiB + 4 GiB margin needed)", flush=True)
        before = {"case": "logits", "seq_len": T, "peak_rss_bytes": int(estimate), "peak_rss_gib": round(estimate / GiB, 3),
                  "estimated_as": f"fused peak at T={T} + (logits - fused peak at T={lens[1]}) + "
                                  f"{per_slot_measured:.0f} bytes/slot (measured between T={lens[0]} and {lens[1]}) "
                                  f"x {T - lens[1]} slots"}
        before_source = "estimated"
    before["estimate_bytes"] = int(estimate)
    result = {
        "benchmark": "peak RSS of one training step (forward + backward), lm-head fused with the loss vs logits",
        "model": "SmolLM2-135M shape, 2 layers, random weights (anchor_core.weights.random_state)",
        "engine": "varlen", "variant": "anchor", "dtype": "float32", "docs": args.docs, "seed": args.seed,
        "seq_len": T, "vocab": V,
        "method": "fresh subprocess per case; /proc/self/clear_refs=5 before the step, VmHWM after",
        "check_lens": lens, "check": check, "logits_minus_fused_bytes": diff,
        "per_slot_bytes": {"measured_between_check_lens": per_slot_measured, "model_2xVx4": per_slot_model},
        "after": after, "before": before, "before_source": before_source,
        "saved_gib": round((before["peak_rss_bytes"] - after["peak_rss_bytes"]) / GiB, 3),
        "target_gib": args.target_gib, "after_under_target": after["peak_rss_bytes"] < args.target_gib * GiB,
        "note": "2-core machine shared with other agents: step times are loaded-machine figures; RSS peaks are "
                "per process and not affected by the load",
        "machine": machine(mem_available_gib_at_decision=round(available / GiB, 1)),
        "estimates": estimate_cases(args.bench_cases, args.attention_cases),
    }
    print(f"T={T}: before {before['peak_rss_bytes'] / GiB:.2f} GiB ({before_source}), "
          f"after {after['peak_rss_bytes'] / GiB:.2f} GiB; target {args.target_gib} GiB: "
          f"{'met' if result['after_under_target'] else 'NOT met'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
