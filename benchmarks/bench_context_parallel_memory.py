"""Each rank's peak host memory under context parallelism, against the plan: SmolLM2-135M, one long window, C = 1, 2, 4.

    nice -n 5 .venv/bin/python benchmarks/bench_context_parallel_memory.py [--seq-len 16384] [--degrees 1,2,4]
        [--no-checkpointing] [--out results/memory/context_parallel_cpu.json]

For each degree C one fresh `anchor train` of one optimizer step on C processes, each holding T / C slots of the
window (`parallel.context_parallel: C`, the default corpus packed at T beforehand in another process):

    anchor train --config smollm2_2k --out TMP data.path=PACK data.seq_len=T data.global_batch=1 data.micro_batch=1
        schedule.steps=1 checkpoint.save_every=0 parallel.nproc=C parallel.context_parallel=C
        model.activation_checkpointing=true model.tiled_mlp=true [model.rope.theta=THETA]

(`--no-checkpointing` leaves out the last two: every layer's activations are kept, so at 4096 slots they are most of
a process's peak; with them the states and the optimizer step dominate a process up to about 16K slots.)

(fp32, the varlen engine, variant anchor). Each rank's peak is the one the run logged with its first step
(`ranks_peak_memory_gib` of metrics.jsonl: torchtrain.training.metrics.peak_memory, the process's peak RSS), beside
the plan of the same command (`anchor plan --json --start T`: its total over the C processes on this host, divided
by C, the per-process estimate `anchor train` refuses a run by) and their ratio, which the plan keeps in [1.00, 1.10]
where it holds; `--replan` sets the current plan beside the peaks already in the record (`planned_by`: its commit). Then, from the plan for this machine's memory: the longest window C processes reach with context
parallelism (one window over all C) and without it (C data-parallel processes, each a whole window).
Writes results/memory/context_parallel_cpu.json with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _peak_rss import GiB, ROOT, anchor_cmd, failure, pack

RUN = ["data.global_batch=1", "data.micro_batch=1", "schedule.steps=1", "checkpoint.save_every=0",
       "logging.report_to=[]", "eval.window=0"]
CHECKPOINTING = ["model.activation_checkpointing=true", "model.tiled_mlp=true"]
CONFIG = "smollm2_2k"


def rope(T: int) -> list[str]:
    """The paper's RoPE base for the shortest of its lengths that holds T, beyond the model's own positions."""
    from anchor_core.spec import PAPER_ROPE_BASE
    from anchor_core.weights import load_spec

    if T <= load_spec("default").max_position:
        return []
    return [f"model.rope.theta={PAPER_ROPE_BASE[min(n for n in PAPER_ROPE_BASE if n >= T)]:g}"]


def plan(T: int, overrides: list[str], *options: str) -> dict:
    done = subprocess.run(anchor_cmd("plan", "--config", CONFIG, "--start", str(T), "--json", *options, *overrides),
                          capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"anchor plan failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def one_step(T: int, C: int, data: Path, run: Path) -> dict:
    """One step at degree C: each rank's logged peak (`with_plan` sets the plan's estimate beside it)."""
    print(f"T={T}, context parallel {C}: one step ...", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(anchor_cmd("train", "--config", CONFIG, "--out", str(run), "--no-progress",
                                     f"data.path={data}", *overrides(T, C)),
                          capture_output=True, text=True, check=False, cwd=ROOT)
    row: dict = {"context_parallel": C, "processes": C, "slots_per_rank": T // C,
                 "seconds": round(time.perf_counter() - t0, 1)}
    if done.returncode != 0:
        return {**row, "failed": failure(done)}
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    return {**row, "loss": first["loss"], "ranks_peak_gib": first["ranks_peak_memory_gib"]}


def overrides(T: int, C: int) -> list[str]:
    return [*RUN, f"data.seq_len={T}", f"parallel.nproc={C}", f"parallel.context_parallel={C}", *rope(T)]


def with_plan(T: int, row: dict) -> dict:
    """The row with the current plan's per-process estimate of the same command beside each rank's peak."""
    predicted = plan(T, overrides(T, row["context_parallel"]))["rows"][0]
    per_process = predicted["total_bytes"] / predicted["procs"] / GiB
    row = {**row, "predicted_gib_per_process": per_process,
           "predicted_terms_gib": {k: v / GiB for k, v in predicted["terms_bytes"].items()}}
    if "ranks_peak_gib" in row:
        ratios = [per_process / p for p in row["ranks_peak_gib"]]
        row.update(ratios=[round(r, 4) for r in ratios], within_1_00_1_10=all(1.0 <= r <= 1.10 for r in ratios))
    return row


def memory_gib() -> float:
    """This machine's memory (MemTotal), the budget the longest windows are planned for: what is available at a
    moment depends on what else runs."""
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)


def longest(C: int, start: int) -> dict:
    """The plan's longest window on C processes of this machine's memory, with context parallel C and without (C
    windows at once)."""
    out = {}
    for name, keys in (("with", [f"parallel.context_parallel={C}"]), ("without", [])):
        run = [o for o in RUN if not o.startswith("data.global_batch=")]
        p = plan(start, [*run, f"parallel.nproc={C}", f"data.global_batch={C if not keys else 1}", *keys],
                 "--memory", str(memory_gib()))
        out[name] = p["longest"]
    return out


def main() -> None:
    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus
    from anchor_core.machine import machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                    help="without activation checkpointing and the tiled MLP")
    ap.add_argument("--degrees", default="1,2,4")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "memory" / "context_parallel_cpu.json")
    ap.add_argument("--replan", action="store_true",
                    help="train nothing: set the current plan beside the peaks already in --out")
    args = ap.parse_args()
    if args.replan:
        result = json.loads(args.out.read_text())
        T, checkpointing, rows = result["seq_len"], result["activation_checkpointing"], result["rows"]
        degrees = [r["context_parallel"] for r in rows]
    else:
        T, checkpointing, degrees = args.seq_len, args.checkpointing, [int(d) for d in args.degrees.split(",")]
    if checkpointing:
        RUN.extend(CHECKPOINTING)
    if not args.replan:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            write_default_corpus(tmp / "corpus")
            data = pack(tmp / "corpus" / CORPUS_FILE, T, tmp / "pack", model="default")
            for C in degrees:
                rows.append(one_step(T, C, data, tmp / f"run-{C}"))
                print(json.dumps(rows[-1]), flush=True)
        result = {"benchmark": f"each rank's peak RSS at context parallel {args.degrees} (one `anchor train` step of "
                               "one window) against the plan",
                  "model": "default (SmolLM2-135M-Instruct)", "seq_len": T, "dtype": "float32", "engine": "varlen",
                  "activation_checkpointing": checkpointing,
                  "command": ["anchor", "train", "--config", CONFIG, *RUN, f"data.seq_len={T}",
                              "parallel.nproc=C", "parallel.context_parallel=C", *rope(T)],
                  "machine": machine()}
    result["rows"] = [with_plan(T, {k: v for k, v in r.items() if not k.startswith(("predicted", "ratios", "within"))})
                      for r in rows]
    result["longest_window"] = {str(C): longest(C, T) for C in degrees if C > 1}
    result["longest_window_memory_gib"] = memory_gib()
    result["planned_by"] = machine()["commit"]  # the plan's code (the measurements' is the machine's commit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
