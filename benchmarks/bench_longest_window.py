"""The longest window SmolLM2-135M trains on this machine: one optimizer step per length, peak RSS against the plan.

    nice -n 5 .venv/bin/python benchmarks/bench_longest_window.py [--start 8192] [--lens 8192,16384,...]

The plan (`anchor plan --json`, torchtrain.training.memory.step_memory) is asked first for this machine's available memory:
it names the longest window that fits. Then one case per length, doubling from --start up to that window, is one
fresh process of one optimizer step (AdamW's moments are allocated before it, torchtrain.training.optim.allocate_state, so
its peak is the peak of any longer run, which the plan predicts)

    anchor train --config smollm2_2k --out TMP data.path=PACK data.seq_len=T data.global_batch=1
        data.micro_batch=1 model.activation_checkpointing=true model.tiled_mlp=true schedule.steps=1
        checkpoint.save_every=0 [model.rope.theta=THETA]

(the embedded SmolLM2-135M-Instruct, variant anchor, fp32, the varlen engine, the default corpus packed into
windows of T slots beforehand in another process; beyond the model's 8192 positions the paper's RoPE base for the
context length that holds T) under `/usr/bin/time -v`, whose "Maximum resident set size" is
the peak RSS of the whole process. Each row records the plan's prediction of that step (total and per term), the
measured peak, their ratio and the step's loss (finite), and the record the plan's line for the next doubling.
Writes results/memory/longest_window_cpu.json.

On a GPU (`--device cuda`) the same series runs in bf16 under DeepSpeed (ZeRO-1: the fp32 master beside the
bf16 weights), as GPU users train, and the peak is the step's own record in metrics.jsonl: the caching
allocator's peak reservation from the device (`peak_reserved_gib`, beside `peak_memory_gib`, the peak of live
tensors; torchtrain.training.metrics.peak_memory). The plan is for the device memory free when the series began
(`--device` named by the GPU, `--memory` that much); with `--offload` the checkpoints go to host memory and
the plan holds them against the host's (`--host-memory`). Lengths double from --start up to the plan's longest;
the next doubling is recorded as what `anchor train` says of it (its refusal, or its step where it runs); the
series ends at the first length that fails.
The corpus is packed whole (documents of every length: a GPU's attention is fast enough for the long one).
Writes results/gpu/longest_window_<gpu>.json (`--out` folder: longest_window_<gpu>.json in it).

`--in-command` measures the command a user types instead, the corpus packed by `anchor train` itself (its
`data.path: corpus`, the config's packing settings), variant intra_doc, one fresh process per length (default
2048, 8192, 16384):

    anchor train --config smollm2_2k --out TMP model.variant=intra_doc data.seq_len=T data.global_batch=1
        data.micro_batch=1 model.activation_checkpointing=true model.tiled_mlp=true schedule.steps=1
        checkpoint.save_every=0 [model.rope.theta=THETA]

each row beside the plan of that command, with the peaks the run logged before its first step (the model built,
the engine built) and its step's own; writes results/memory/longest_window_in_command_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

from _peak_rss import GiB, ROOT, anchor_cmd, failure, measure, pack, require_time

RUN = ["data.global_batch=1", "data.micro_batch=1", "model.activation_checkpointing=true", "model.tiled_mlp=true",
       "schedule.steps=1", "checkpoint.save_every=0"]
GPU_RUN = ["model.dtype=bfloat16", "parallel.zero_stage=1", *RUN]  # what a GPU user trains in: bf16 under DeepSpeed
CONFIG = "smollm2_2k"
IN_COMMAND = ["model.variant=intra_doc", *RUN]  # `--in-command`: the corpus packed by the command itself
IN_COMMAND_LENS = [2048, 8192, 16384]


# The GPU plans set beside ALST's published figures (torchtrain.training.memory.ALST_LLAMA_8B): ALST's recipe: bf16 under
# ZeRO-3 with the optimizer states offloaded to host memory, activation checkpoints offloaded too, the MLP tiled,
# the loss fused with the lm-head, and Ulysses over all the GPUs where the heads split (Llama-3.1-8B's 32 do;
# SmolLM2's 9 do not, so each of its GPUs trains windows of its own).
GPU_RECIPE = ["model.dtype=bfloat16", "model.activation_checkpointing=true", "model.tiled_mlp=true",
              "model.offload_checkpoints=true", "data.micro_batch=1", "parallel.zero_stage=3",
              "parallel.offload_optimizer=true"]
GPU_CASES = [  # (model, --shape or None, GPUs, sequence-parallel degree, further overrides)
    ("SmolLM2-135M", None, 1, 1, []), ("SmolLM2-135M", None, 8, 1, []),
    # one GPU holds Llama-8B's bf16 weights and gradients (32 GB) unless ZeRO-3 offloads the parameters too
    ("Llama-3.1-8B", "llama3.1-8b", 1, 1, ["parallel.offload_params=true"]), ("Llama-3.1-8B", "llama3.1-8b", 8, 8, []),
]
GPU_DEVICE = "h100"
GPU_START = 131072


def the_plan(start: int, overrides: list[str], *options: str, config: str = CONFIG) -> dict:
    done = subprocess.run(anchor_cmd("plan", "--config", config, "--start", str(start), "--json", *options, *overrides),
                          capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"anchor plan failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def gpu_plans() -> list[dict]:
    """`anchor plan` on GPU_DEVICE for each of GPU_CASES (nothing runs on a GPU)."""
    out = []
    for model, shape, gpus, sp, extra in GPU_CASES:
        overrides = [*GPU_RECIPE, *extra, f"parallel.nproc={gpus}", f"parallel.sequence_parallel={sp}",
                     f"data.global_batch={gpus // sp}"]
        options = ["--device", GPU_DEVICE, *(["--shape", shape] if shape else [])]
        out.append({"model": model, "gpus": gpus, "device": GPU_DEVICE, "overrides": overrides, "options": options,
                    "plan": the_plan(GPU_START, overrides, *options)})
    return out


def rope_theta(T: int) -> float | None:
    """The paper's RoPE base for the shortest of its context lengths that holds T (anchor_core.spec.PAPER_ROPE_BASE);
    None within the model's own positions."""
    from anchor_core.spec import PAPER_ROPE_BASE
    from anchor_core.weights import load_spec

    if T <= load_spec("default").max_position:
        return None
    return PAPER_ROPE_BASE[min(n for n in PAPER_ROPE_BASE if n >= T)]


def gpu_word(name: str) -> str:
    """A GPU's name as the plan's --device (anchor_core.hardware.GPUS) where one matches ("NVIDIA H100 80GB HBM3" ->
    h100), else as a file-name word."""
    import re

    from anchor_core.hardware import GPUS

    low = name.lower()
    return next((k for k in GPUS if all(part in low for part in k.split("-"))),
                re.sub(r"[^a-z0-9]+", "-", low).strip("-"))


def metrics_step(T: int, data: Path, run: Path, overrides: list[str], config: str = CONFIG) -> dict:
    """One `anchor train` step at T in a fresh process on the GPU: its seconds, its loss, and the peaks it recorded
    (metrics.jsonl: torchtrain.training.metrics.peak_memory), or why it failed (the last two lines of its stderr)."""
    import time

    print(f"training one step at T={T} ...", flush=True)
    theta = rope_theta(T) if config == CONFIG else None
    t0 = time.perf_counter()
    done = subprocess.run(anchor_cmd("train", "--config", config, "--out", str(run), "--no-progress",
                                     f"data.path={data}", f"data.seq_len={T}", *overrides,
                                     *([f"model.rope.theta={theta:g}"] if theta else [])),
                          capture_output=True, text=True, check=False, cwd=ROOT)
    row: dict = {"seconds": round(time.perf_counter() - t0, 1), "rope_theta": theta}
    if done.returncode != 0:
        return {**row, "failed": failure(done)}
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    row.update(peak_allocated_bytes=int(last["peak_memory_gib"] * GiB),
               peak_reserved_bytes=int(last.get("peak_reserved_gib", last["peak_memory_gib"]) * GiB),
               loss=last["loss"], loss_finite=math.isfinite(last["loss"]))
    print(f"  T={T}: peak {row['peak_reserved_bytes'] / GiB:.2f} GiB reserved "
          f"({row['peak_allocated_bytes'] / GiB:.2f} allocated), loss {row['loss']:.4f}, {row['seconds']:.0f} s",
          flush=True)
    return row


def train_step(T: int, data: Path, run: Path) -> dict:
    print(f"training one step at T={T} ...", flush=True)
    theta = rope_theta(T)
    row = measure(["train", "--config", CONFIG, "--out", str(run), "--no-progress", f"data.path={data}",
                   f"data.seq_len={T}", *RUN, *([f"model.rope.theta={theta:g}"] if theta else [])])
    row["rope_theta"] = theta
    if "failed" in row:
        return row
    loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    print(f"  T={T}: peak RSS {row['peak_rss_bytes'] / GiB:.2f} GiB, loss {loss:.4f}, {row['seconds']:.0f} s",
          flush=True)
    return {**row, "loss": loss, "loss_finite": math.isfinite(loss)}


def in_command_step(T: int, run: Path) -> dict:
    """One `anchor train` of the user's command at T (module docstring, `--in-command`) under /usr/bin/time -v: its
    peak RSS, and the peaks its first metrics line logged (the model built, the engine built, the step)."""
    print(f"training one step at T={T}, the corpus packed by the command ...", flush=True)
    theta = rope_theta(T)
    row = measure(["train", "--config", CONFIG, "--out", str(run), "--no-progress", f"data.seq_len={T}",
                   *IN_COMMAND, *([f"model.rope.theta={theta:g}"] if theta else [])])
    row["rope_theta"] = theta
    if "failed" in row:
        return row
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    row.update(loss=first["loss"], loss_finite=math.isfinite(first["loss"]),
               build_peak_bytes=int(first["build_peak_gib"] * GiB), engine_peak_bytes=int(first["engine_peak_gib"] * GiB),
               step_peak_bytes=int(first["peak_memory_gib"] * GiB))
    print(f"  T={T}: peak RSS {row['peak_rss_bytes'] / GiB:.2f} GiB (engine built {first['engine_peak_gib']:.2f}, "
          f"step {first['peak_memory_gib']:.2f}), loss {row['loss']:.4f}, {row['seconds']:.0f} s", flush=True)
    return row


def in_command_series(args) -> None:
    """`--in-command` (module docstring): the user's command at each length, a fresh process each, the record
    rewritten after each length (a killed series keeps its lengths), then set beside the plan."""
    from anchor_core.machine import machine
    from torchtrain.attention.engines import available_memory

    require_time()
    path = Path(args.out) / "longest_window_in_command_cpu.json"
    lens = [int(x) for x in args.lens.split(",")] if args.lens else IN_COMMAND_LENS
    result = {
        "benchmark": "the command a user types, its corpus packed by the command: peak RSS against the plan",
        "command": f"anchor train --config {CONFIG} --out RUN data.seq_len=T " + " ".join(IN_COMMAND),
        "model": "default (SmolLM2-135M-Instruct)", "variant": "intra_doc", "dtype": "float32", "engine": "varlen",
        "run": IN_COMMAND, "in_command": True,
        "method": "fresh process per length under /usr/bin/time -v (Maximum resident set size), the embedded corpus "
                  "written and packed by `anchor train` itself (data.path: corpus, the config's packing); the peaks "
                  "before the first step and the step's own from its metrics.jsonl (VmHWM)",
        "rows": [], "mem_available_bytes_at_start": available_memory("cpu"),
    }
    with tempfile.TemporaryDirectory(prefix="bench-in-command-") as tmp:
        for T in lens:
            run = Path(tmp) / f"run-{T}"
            result["rows"].append({"seq_len": T, "windows": "the default corpus, packed by the command",
                                   "commit": machine()["commit"], **in_command_step(T, run)})
            subprocess.run(["rm", "-rf", str(run)], check=False)
            write({**result, "machine": machine(), "unfinished": True}, path)
    result["machine"] = machine()
    write(with_plan(result, lens[0], args.memory_gib), path)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")


def with_plan(result: dict, start: int, memory_gib: float | None = None) -> dict:
    """`result` with the plan's side: this machine's plan from `start` for `memory_gib` (default: the memory
    available when the measurements started, `mem_available_bytes_at_start`), each measured row's prediction and
    ratio, on a CPU the GPU plans beside ALST's figures, the summary. The plan is arithmetic on the sizes
    (torchtrain.training.memory), so `--replan` can set the current one beside measurements already taken. A GPU record
    names its run overrides (`run`), the plan's other options (`plan_options`: the GPU, the host's memory) and the
    row key of its measured peak (`measured`)."""
    from anchor_core.machine import machine
    from torchtrain.training.memory import ALST_BASELINE, ALST_LLAMA_8B

    run, options, config = result.get("run", RUN), result.get("plan_options", []), result.get("config", CONFIG)
    measured_key = result.get("measured", "peak_rss_bytes")
    result["plan_memory_from"] = "--memory-gib" if memory_gib is not None else "mem_available_bytes_at_start"
    if memory_gib is None:
        memory_gib = round(result["mem_available_bytes_at_start"] / GiB, 2)
    result["plan_memory_gib"] = memory_gib
    plan = the_plan(start, run, "--memory", f"{memory_gib:g}", *options, config=config)
    predicted = {r["seq_len"]: r for r in plan["rows"]}
    refused = next((r for r in plan["rows"] if not r["fits"]), None)
    for row in result["rows"]:
        p = predicted.get(row["seq_len"]) or the_plan(row["seq_len"], run, *options, config=config)["rows"][0]
        row.update(predicted_bytes=p["total_bytes"], predicted_terms_bytes=p["terms_bytes"])
        if measured_key in row:
            row["predicted_over_measured"] = round(row["predicted_bytes"] / row[measured_key], 3)
    measured = [r for r in result["rows"] if measured_key in r]
    result.update({
        "plan_args": ["--config", config, "--start", str(start), "--memory", f"{memory_gib:g}", *options, *run],
        "plan": {k: v for k, v in plan.items() if k != "rows"},
        "plan_rows": plan["rows"],
        "longest_planned": plan["longest"],
        "refused_next": None if refused is None else {"seq_len": refused["seq_len"],
                                                      "total_bytes": refused["total_bytes"],
                                                      "host_total_bytes": refused.get("host_total_bytes")},
        "summary": {
            "lengths_measured": len(measured),
            "longest_trained": max((r["seq_len"] for r in measured if r["loss_finite"]), default=None),
            "worst_predicted_over_measured": max((abs(r["predicted_over_measured"] - 1) for r in measured),
                                                 default=None),
        },
        "planned_by": machine()["commit"],  # the plan's code (the measurements' is the machine's commit)
    })
    if measured and result.get("in_command"):
        result["summary"]["predicted_over_measured"] = {str(r["seq_len"]): r["predicted_over_measured"]
                                                         for r in measured}
    if "plan_options" not in result and not result.get("in_command"):  # the CPU record: GPU plans beside ALST's
        result.update({
            "gpu_plans": gpu_plans(),
            "alst": {"source": "Bekman et al., Arctic Long Sequence Training (arXiv:2506.13996): Llama-3.1-8B in "
                               "bf16 on H100 80GB GPUs, the longest sequence trained per GPU count",
                     "llama3.1-8b_longest_by_gpus": {str(k): v for k, v in ALST_LLAMA_8B.items()},
                     "baseline_longest": ALST_BASELINE},
        })
    return result


def write(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".json.tmp")
    tmp_path.write_text(json.dumps(result, indent=1))
    os.replace(tmp_path, path)


def gpu_series(args) -> None:
    """The series on this machine's GPU (module docstring): planned for the device memory free at the start,
    one fresh `anchor train` step per length, the record rewritten after each (a stopped series keeps its
    lengths), the next doubling past the plan's longest asked of `anchor train` too."""
    import torch

    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus
    from anchor_core.machine import machine
    from torchtrain.attention.engines import available_memory
    from torchtrain.config import load_train_config
    from anchor_core.hardware import GPUS

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise SystemExit("--device cuda: torch sees no CUDA device here (--dry-run runs the series on the CPU)")
    word = gpu_word(torch.cuda.get_device_name()) if cuda else "cpu-dry-run"
    out = Path(args.out) if args.out != str(ROOT / "results" / "memory") else ROOT / "results" / "gpu"
    path = out / f"longest_window_{word}.json"
    run = [*GPU_RUN, *(["model.offload_checkpoints=true"] if args.offload else [])]
    free, host = available_memory("cuda" if cuda else "cpu"), available_memory("cpu")
    if args.memory_gib:  # a dry run's stand-in for the device's memory
        free = int(args.memory_gib * GiB)
    options = ["--device", word if word in GPUS else "h100"]  # named: planned as a GPU, each process its device
    if args.offload:
        options += ["--host-memory", f"{host / GiB:.2f}"]
    plan = the_plan(args.start, run, "--memory", f"{free / GiB:.2f}", *options, config=args.config)
    lens = ([int(x) for x in args.lens.split(",")] if args.lens else
            [r["seq_len"] for r in plan["rows"] if r["fits"]] + [r["seq_len"] for r in plan["rows"] if not r["fits"]])
    result = {
        "benchmark": "one `anchor train` step per window length on a GPU: the allocator's peak against the plan",
        "command": f"anchor train --config {args.config} --out RUN data.path=PACK data.seq_len=T " + " ".join(run),
        "config": args.config, "variant": "anchor", "dtype": "bfloat16", "engine": "varlen", "run": run,
        "plan_options": options, "measured": "peak_reserved_bytes",
        "method": "fresh process per length; the peaks of its one step from its metrics.jsonl (torch.cuda."
                  "max_memory_reserved and max_memory_allocated); the default corpus packed whole beforehand",
        "rows": [], "mem_available_bytes_at_start": free, "host_available_bytes_at_start": host,
    }
    with tempfile.TemporaryDirectory(prefix="bench-longest-") as tmp:
        tmp = Path(tmp)
        write_default_corpus(tmp / "corpus", progress=False)
        model = load_train_config(args.config).model.name  # the windows packed for the config's own model
        for T in lens:
            data = pack(tmp / "corpus" / CORPUS_FILE, T, tmp / f"pack-{T}", model=model, budget=max(200000, T))
            row = metrics_step(T, data, tmp / f"run-{T}", run, args.config)
            result["rows"].append({"seq_len": T, "windows": "the default corpus", "commit": machine()["commit"], **row})
            subprocess.run(["rm", "-rf", str(tmp / f"run-{T}"), str(data)], check=False)
            write({**result, "machine": machine(), "unfinished": True}, path)
            if "failed" in row:  # a longer window fails too: the series ends at the first that does
                break
    result["machine"] = machine()
    write(with_plan(result, args.start), path)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=8192)
    ap.add_argument("--lens", default=None, help="Comma-separated lengths instead of the plan's doubling series.")
    ap.add_argument("--out", default=str(ROOT / "results" / "memory"))
    ap.add_argument("--replan", metavar="RECORD", default=None,
                    help="Measure nothing: set the current plan beside RECORD's measurements, written to --out under "
                         "RECORD's name.")
    ap.add_argument("--max-doc-chars", type=int, default=None,
                    help="Pack only the default corpus's documents of at most this many characters: the step's "
                         "memory does not depend on document lengths (the varlen engine), its time grows with "
                         "their squares (the corpus holds a document of about 190K tokens).")
    ap.add_argument("--rows-from", metavar="RECORD", default=None,
                    help="Begin the record with RECORD's measured rows (lengths measured by an earlier run).")
    ap.add_argument("--complete", action="store_true",
                    help="With --replan: RECORD's lengths are all there are (rows merged from runs of other lengths).")
    ap.add_argument("--memory-gib", type=float, default=None,
                    help="Plan this machine for this much memory (default: what was available when measuring began).")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the series on this machine's GPU, in bf16 under DeepSpeed ZeRO-1 (module docstring).")
    ap.add_argument("--offload", action="store_true",
                    help="With --device cuda: the checkpoints in host memory (model.offload_checkpoints=true).")
    ap.add_argument("--config", default=CONFIG, help="The run config (the series' model); tiny for a dry run.")
    ap.add_argument("--dry-run", action="store_true",
                    help="With --device cuda on a machine without one: the GPU series' code on the CPU (with "
                         "--config tiny, --memory-gib and --out: nothing here is a GPU's measurement).")
    ap.add_argument("--in-command", action="store_true",
                    help="The command a user types, its corpus packed by `anchor train` itself (module docstring).")
    args = ap.parse_args()
    if args.in_command:
        if args.replan:
            path = Path(args.out) / Path(args.replan).name
            result = with_plan(json.loads(Path(args.replan).read_text()), IN_COMMAND_LENS[0], args.memory_gib)
            write(result, path)
            print(json.dumps(result["summary"], indent=1))
            return
        in_command_series(args)
        return
    if args.device == "cuda":
        gpu_series(args)
        return
    path = Path(args.out) / (Path(args.replan).name if args.replan else "longest_window_cpu.json")
    if args.replan:
        result = json.loads(Path(args.replan).read_text())
        if args.complete:
            result.pop("unfinished", None)
        write(with_plan(result, args.start, args.memory_gib), path)
        print(json.dumps(result["summary"], indent=1))
        print(f"wrote {path}")
        return
    require_time()

    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus
    from anchor_core.machine import machine
    from torchtrain.attention.engines import available_memory

    lens = ([int(x) for x in args.lens.split(",")] if args.lens else
            [r["seq_len"] for r in the_plan(args.start, RUN, *(["--memory", f"{args.memory_gib:g}"]
                                                                if args.memory_gib else []))["rows"] if r["fits"]])
    result = {
        "benchmark": "one `anchor train` step per window length: peak RSS against the plan (anchor plan)",
        "command": f"anchor train --config {CONFIG} --out RUN data.path=PACK data.seq_len=T " + " ".join(RUN),
        "model": "default (SmolLM2-135M-Instruct)", "variant": "anchor", "dtype": "float32", "engine": "varlen",
        "method": "fresh process per length under /usr/bin/time -v (Maximum resident set size); the default corpus "
                  "packed beforehand in another process",
        "rows": [],
        "mem_available_bytes_at_start": available_memory("cpu"),
    }
    if args.rows_from:
        earlier = json.loads(Path(args.rows_from).read_text())
        result["rows"] = [{k: v for k, v in r.items() if not k.startswith("predicted")} for r in earlier["rows"]
                          if "peak_rss_bytes" in r]
        result["earlier_machine"] = earlier["machine"]
    with tempfile.TemporaryDirectory(prefix="bench-longest-") as tmp:
        tmp = Path(tmp)
        write_default_corpus(tmp / "corpus", progress=False)
        corpus = tmp / "corpus" / CORPUS_FILE
        windows = "the default corpus"
        if args.max_doc_chars:
            short = tmp / "short.jsonl"
            with open(corpus, encoding="utf-8") as src, open(short, "w", encoding="utf-8") as dst:
                dst.writelines(line for line in src if len(json.loads(line)["text"]) <= args.max_doc_chars)
            corpus, windows = short, f"the default corpus's documents of at most {args.max_doc_chars} characters"
        for T in lens:
            data = pack(corpus, T, tmp / f"pack-{T}", model="default", budget=max(200000, 2 * T))
            result["rows"].append({"seq_len": T, "windows": windows, "commit": machine()["commit"],
                                   **train_step(T, data, tmp / f"run-{T}")})
            result["rows"].sort(key=lambda r: (r["seq_len"], r.get("windows", "")))
            subprocess.run(["rm", "-rf", str(tmp / f"run-{T}"), str(data)], check=False)
            write({**result, "machine": machine(), "unfinished": True}, path)  # a killed run keeps its lengths
    result["machine"] = machine()
    write(with_plan(result, args.start, args.memory_gib), path)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
