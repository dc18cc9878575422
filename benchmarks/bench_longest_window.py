"""The longest window SmolLM2-135M trains on this machine: two optimizer steps per length, peak RSS against the plan.

    nice -n 5 .venv/bin/python benchmarks/bench_longest_window.py [--start 8192] [--lens 8192,16384,...]

The plan (`anchor plan --json`, torchtrain.memory.step_memory) is asked first for this machine's available memory:
it names the longest window that fits. Then one case per length, doubling from --start up to that window, is one
fresh process of two steps (the first step's backward runs before AdamW allocates its moments; from the second on,
the backward holds them too: the peak of any longer run, which the plan predicts)

    anchor train --config smollm2_2k --out TMP data.path=PACK data.seq_len=T data.global_batch=1
        data.micro_batch=1 model.activation_checkpointing=true model.tiled_mlp=true schedule.steps=2
        checkpoint.save_every=0

(the embedded SmolLM2-135M-Instruct, variant anchor, fp32, the varlen engine, the default corpus packed into
windows of T slots beforehand in another process) under `/usr/bin/time -v`, whose "Maximum resident set size" is
the peak RSS of the whole process. Each row records the plan's prediction of that step (total and per term), the
measured peak, their ratio and the step's loss (finite), and the record the plan's line for the next doubling.
Writes results/memory/longest_window_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
TIME = "/usr/bin/time"
RUN = ["data.global_batch=1", "data.micro_batch=1", "model.activation_checkpointing=true", "model.tiled_mlp=true",
       "schedule.steps=2", "checkpoint.save_every=0"]
CONFIG = "smollm2_2k"


def anchor(*args: str) -> list[str]:
    return [sys.executable, "-m", "anchor", *args]


def the_plan(start: int, seq_overrides: list[str]) -> dict:
    done = subprocess.run(anchor("plan", "--config", CONFIG, "--start", str(start), "--json", *RUN, *seq_overrides),
                          capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"anchor plan failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def pack(corpus: Path, T: int, out: Path) -> Path:
    """The default corpus packed into windows of T slots for SmolLM2 (not measured)."""
    cmd = anchor("pack", "--model", "default", "--data", str(corpus), "--seq-len", str(T), "--budget",
                 str(max(200000, 2 * T)), "--out", str(out), "--no-progress")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"packing at T={T} failed: {done.stderr.strip().splitlines()[-1:]}")
    return out


def train_step(T: int, data: Path, run: Path) -> dict:
    cmd = anchor("train", "--config", CONFIG, "--out", str(run), "--no-progress", f"data.path={data}",
                 f"data.seq_len={T}", *RUN)
    print(f"training two steps at T={T} ...", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run([TIME, "-v", *cmd], capture_output=True, text=True, cwd=ROOT, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("\t")][-2:]
        return {"failed": f"exit {done.returncode}: {tail}", "seconds": round(seconds, 1)}
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) * 1024
    loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    print(f"  T={T}: peak RSS {peak / GiB:.2f} GiB, loss {loss:.4f}, {seconds:.0f} s", flush=True)
    return {"peak_rss_bytes": peak, "seconds": round(seconds, 1), "loss": loss, "loss_finite": math.isfinite(loss)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=8192)
    ap.add_argument("--lens", default=None, help="Comma-separated lengths instead of the plan's doubling series.")
    ap.add_argument("--out", default=str(ROOT / "results" / "memory"))
    args = ap.parse_args()
    if not Path(TIME).is_file():
        raise SystemExit(f"{TIME} is missing (GNU time: apt-get install time)")

    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus
    from anchor_core.machine import machine

    plan = the_plan(args.start, [])
    lens = ([int(x) for x in args.lens.split(",")] if args.lens else
            [r["seq_len"] for r in plan["rows"] if r["fits"]])
    refused = next((r for r in plan["rows"] if not r["fits"]), None)
    predicted = {r["seq_len"]: r for r in plan["rows"]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-longest-") as tmp:
        tmp = Path(tmp)
        write_default_corpus(tmp / "corpus", progress=False)
        corpus = tmp / "corpus" / CORPUS_FILE
        for T in lens:
            data = pack(corpus, T, tmp / f"pack-{T}")
            row = {"seq_len": T}
            p = predicted.get(T) or the_plan(T, [])["rows"][0]
            row.update(predicted_bytes=p["total_bytes"], predicted_terms_bytes=p["terms_bytes"])
            row.update(train_step(T, data, tmp / f"run-{T}"))
            if "peak_rss_bytes" in row:
                row["predicted_over_measured"] = round(row["predicted_bytes"] / row["peak_rss_bytes"], 3)
            rows.append(row)
            subprocess.run(["rm", "-rf", str(tmp / f"run-{T}"), str(data)], check=False)
    measured = [r for r in rows if "peak_rss_bytes" in r]
    result = {
        "benchmark": "two `anchor train` steps per window length: peak RSS against the plan (anchor plan)",
        "command": f"anchor train --config {CONFIG} --out RUN data.path=PACK data.seq_len=T " + " ".join(RUN),
        "model": "default (SmolLM2-135M-Instruct)", "variant": "anchor", "dtype": "float32", "engine": "varlen",
        "method": "fresh process per length under /usr/bin/time -v (Maximum resident set size); the default corpus "
                  "packed beforehand in another process",
        "plan": {k: v for k, v in plan.items() if k != "rows"},
        "plan_rows": plan["rows"],
        "longest_planned": plan["longest"],
        "refused_next": None if refused is None else {"seq_len": refused["seq_len"],
                                                      "total_bytes": refused["total_bytes"]},
        "rows": rows,
        "summary": {
            "lengths_measured": len(measured),
            "longest_trained": max((r["seq_len"] for r in measured if r["loss_finite"]), default=None),
            "worst_predicted_over_measured": max((abs(r["predicted_over_measured"] - 1) for r in measured),
                                                 default=None),
        },
        "machine": machine(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "longest_window_cpu.json"
    tmp_path = path.with_suffix(".json.tmp")
    tmp_path.write_text(json.dumps(result, indent=1))
    os.replace(tmp_path, path)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
