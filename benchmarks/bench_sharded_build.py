"""Host memory of a ZeRO-3 run of a 0.5B Llama read from a sharded folder: while the engine is built, at the
first step, and over the whole run (every process, build, step and export), against the plan.

    nice -n 5 .venv/bin/python benchmarks/bench_sharded_build.py [--worlds 1,2] [--work DIR] [--keep]

The model: Llama-shaped, 0.48B parameters (hidden 1024, 32 layers, MLP 2816, 16 heads, vocabulary 32000, lm-head
untied), random weights (anchor_core.weights.random_state, seed 0) written once in float32 as safetensors shards
of at most 1 GB with their index (two files), with the byte tokenizer. The default corpus is packed for it into
windows of 512 slots (not measured). Each case is one fresh `anchor train` of one optimizer step, bf16, ZeRO-3,
its final checkpoint and export (500 MB shards) written:

    anchor train --config tiny --out RUN model.name=FOLDER data.path=PACK model.dtype=bfloat16
        parallel.zero_stage=3 parallel.nproc=W data.global_batch=W data.micro_batch=1 schedule.steps=1
        eval.window=0 logging.tensorboard=false

at W = 1 and 2 processes, and the same with the tiny config's own model (random:llama, 0.2M parameters) for the
idle size of a process of that run. Measured:
  build    each rank's host memory peak once the model was built (partitioned and filled: `ranks_build_peak_gib`
           in the first line of metrics.jsonl), above the tiny run's (the idle size)
  engine   each rank's peak once DeepSpeed's engine was built beside it, before the first step
           (`ranks_engine_peak_gib`), above the tiny run's
  step     each rank's peak at the end of the first step (`ranks_peak_memory_gib`), above the tiny run's
  run      the most resident memory the run's processes (the launcher and the ranks) held together, sampled every
           20 ms from /proc over the whole run, build, step, checkpoint and export
beside the plan's prediction of each (torchtrain.memory: `build_memory`, for rank 0, which reads the weights, and for
the others; `step_memory`, `run_memory`) and the bound
the sharded construction must keep: half the float32 parameter bytes plus the largest shard it reads.
Writes results/memory/sharded_build_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from _peak_rss import GiB, ROOT, anchor_cmd, failure, pack

SPEC = dict(hidden_size=1024, num_layers=32, intermediate_size=2816, num_heads=16, num_kv_heads=16, head_dim=64,
            vocab_size=32000, tie_embeddings=False)
SHARD = "1GB"
SEQ_LEN = 512
RUN = ["model.dtype=bfloat16", "parallel.zero_stage=3", "data.micro_batch=1", "schedule.steps=1", "eval.window=0",
       "checkpoint.max_shard_size=500MB", f"data.seq_len={SEQ_LEN}",
       "logging.tensorboard=false"]


def write_folder(folder: Path) -> dict:
    """The 0.48B model's folder (module docstring); its parameter count, shards and largest shard in bytes."""
    from anchor_core.export import write_model, write_tokenizer
    from anchor_core.weights import random_preset, random_state
    from torchtrain.memory import parameters

    spec = random_preset("llama").replace(**SPEC)
    if not (folder / "model.safetensors.index.json").is_file():
        write_model(spec, random_state(spec, 0), folder, max_shard_size=SHARD)
        write_tokenizer("random:llama", spec, folder)
    shards = sorted(folder.glob("*.safetensors"))
    return {"parameters": parameters(spec), "shards": [f.name for f in shards],
            "largest_shard_bytes": max(f.stat().st_size for f in shards), "shard_limit": SHARD, "spec": SPEC}


class TreeSampler:
    """The most resident memory a process and its descendants held together (VmRSS summed, sampled)."""

    def __init__(self, pid: int, every: float = 0.02):
        self.pid, self.every, self.peak, self.procs = pid, every, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        parents: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                parents.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo.extend(parents.get(p, []))
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            total, n = 0, 0
            for p in self._tree():
                try:
                    with open(f"/proc/{p}/status") as f:
                        for line in f:
                            if line.startswith("VmRSS:"):
                                total += int(line.split()[1]) * 1024
                                n += 1
                                break
                except OSError:
                    continue
            if total > self.peak:
                self.peak, self.procs = total, n
            time.sleep(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def train(run: Path, model: str, data: Path, world: int) -> dict:
    """One case (module docstring) in a fresh process: the first line of its metrics, its sampled whole-run peak."""
    args = anchor_cmd("train", "--config", "tiny", "--out", str(run), "--no-progress", f"model.name={model}",
                      f"data.path={data}", *RUN, f"parallel.nproc={world}", f"data.global_batch={world}")
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(proc.pid)
    out, err = proc.communicate()
    sampler.stop()
    seconds = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        return {"failed": failure(subprocess.CompletedProcess(args, proc.returncode, out, err)), "seconds": seconds}
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    hf = run / "checkpoints" / "step-1" / "hf"
    return {"build_gib": first["ranks_build_peak_gib"], "engine_gib": first["ranks_engine_peak_gib"],
            "step_gib": first["ranks_peak_memory_gib"],
            "run_gib": round(sampler.peak / GiB, 4), "run_processes": sampler.procs, "loss": first["loss"],
            "export_files": sorted(f.name for f in hf.glob("*.safetensors")), "seconds": seconds}


def predictions(folder: Path, world: int) -> dict:
    """The plan's figures for this case (torchtrain.memory), per rank and for the whole run."""
    import torch

    from torchtrain.config import load_train_config
    from torchtrain.memory import build_memory, run_memory, step_memory, step_of
    from torchtrain.run_folder import model_spec

    cfg = load_train_config("tiny", [f"model.name={folder}", *RUN, f"parallel.nproc={world}",
                                     f"data.global_batch={world}"])
    spec = model_spec(cfg)
    keys = step_of(cfg, engine=cfg.model.engine if cfg.model.engine != "auto" else "varlen", dtype=torch.bfloat16,
                   procs=world, world=world, on_gpu=False)
    step = step_memory(spec, seq_len=SEQ_LEN, **keys)
    build = build_memory(spec, dtype=torch.bfloat16, zero_stage=3, world=world)
    run = run_memory(step, build)
    others = build_memory(spec, dtype=torch.bfloat16, zero_stage=3, world=world, reader=False)[0]
    return {"build_gib": round(build[0] / GiB, 4), "build_other_ranks_gib": round(others / GiB, 4), "engine_gib": round(build[1] / GiB, 4), "step_gib": round((step.per_process - step.base) / GiB, 4),
            "run_gib": round(run / GiB, 4), "step_terms_gib": {k: round(v / GiB, 4) for k, v in step.terms().items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--work", type=Path, default=None, help="Folder for the model, data and runs (default: a temporary one).")
    ap.add_argument("--keep", action="store_true", help="Keep --work's model and packed data for a rerun.")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "memory" / "sharded_build_cpu.json")
    args = ap.parse_args()
    from anchor_core.data.corpus import write_default_corpus
    from anchor_core.machine import machine

    work = args.work or Path(tempfile.mkdtemp(prefix="sharded-build-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        folder = work / "llama-0.5b"
        model = write_folder(folder)
        if not (work / "corpus" / "corpus.jsonl").is_file():
            write_default_corpus(work / "corpus")
        corpus = work / "corpus" / "corpus.jsonl"
        data = work / "pack-0.5b" if (work / "pack-0.5b").is_dir() else pack(corpus, SEQ_LEN, work / "pack-0.5b",
                                                                             model=str(folder))
        tiny = work / "pack-tiny" if (work / "pack-tiny").is_dir() else pack(corpus, SEQ_LEN, work / "pack-tiny",
                                                                            model="random:llama")
        rows = []
        for world in [int(w) for w in args.worlds.split(",")]:
            idle = train(work / f"run-tiny-{world}", "random:llama", tiny, world)
            got = train(work / f"run-{world}", str(folder), data, world)
            for r in (f"run-tiny-{world}", f"run-{world}"):
                shutil.rmtree(work / r, ignore_errors=True)
            row = {"world": world, "idle": idle, "measured": got,
                   "planned": predictions(folder, world)}
            if "failed" not in got and "failed" not in idle:
                row["build_above_idle_gib"] = [round(b - i, 4) for b, i in zip(got["build_gib"], idle["build_gib"])]
                row["engine_above_idle_gib"] = [round(e - i, 4) for e, i in zip(got["engine_gib"], idle["engine_gib"])]
                row["step_above_idle_gib"] = [round(s - i, 4) for s, i in zip(got["step_gib"], idle["step_gib"])]
                row["bound_gib"] = round((2 * model["parameters"] + model["largest_shard_bytes"]) / GiB, 4)
                row["build_over_bound"] = [round(b / row["bound_gib"], 3) for b in row["build_above_idle_gib"]]
                row["planned_over_measured"] = {
                    "build": [round(row["planned"]["build_gib" if r == 0 else "build_other_ranks_gib"] / b, 3)
                              for r, b in enumerate(row["build_above_idle_gib"])],
                    "engine": [round(row["planned"]["engine_gib"] / e, 3) for e in row["engine_above_idle_gib"]],
                    "step": [round(row["planned"]["step_gib"] / s, 3) for s in row["step_above_idle_gib"]],
                    "run": round(row["planned"]["run_gib"] / got["run_gib"], 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        result = {"model": model, "seq_len": SEQ_LEN, "run": RUN, "rows": rows, "machine": machine()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
