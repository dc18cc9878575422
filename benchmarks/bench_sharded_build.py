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
        eval.window=0 "logging.report_to=[]"

at W = 1 and 2 processes, and the same with the tiny config's own model (random:llama, 0.2M parameters) for the
idle size of a process of that run. Measured:
  build    each rank's host memory peak once the model was built (partitioned and filled: `ranks_build_peak_gib`
           in the first line of metrics.jsonl), above the tiny run's (the idle size)
  engine   each rank's peak once DeepSpeed's engine was built beside it, before the first step
           (`ranks_engine_peak_gib`), above the tiny run's
  step     each rank's peak at the end of the first step (`ranks_peak_memory_gib`), above the tiny run's
  run      the most resident memory the run's processes (the launcher and the ranks) held together, sampled every
           20 ms from /proc over the whole run, build, step, checkpoint and export
beside the plan's prediction of each (torchtrain.training.memory: `build_memory`, for rank 0, which reads the weights, and for
the others; `step_memory`, `run_memory`) and the bound
the sharded construction must keep: half the float32 parameter bytes plus the largest shard it reads.
Writes results/memory/sharded_build_cpu.json.

`--build-only` measures the construction alone, in each dtype of `--dtypes` (default bfloat16,float32), from a
folder of shards of at most `--shard` (default 1GB): W fresh processes joined as the trainer joins them
(torchtrain.parallel.distributed.init_world), each building the model as `anchor train` does at ZeRO-3
(torchtrain.parallel.sharded_build.build_partitioned, the run's DeepSpeed config), its peak (VmHWM) above its resident size
just before, against the plan (`build_memory`, rank 0 the reader) and the bound: a rank's partitions in the run's
dtype (e P / W) plus the largest shard; no step, so a float32 case fits beside other work. Writes
results/memory/sharded_build_only_cpu.json.
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
DEFAULT_OUT = ROOT / "results" / "memory" / "sharded_build_cpu.json"
SEQ_LEN = 512
RUN = ["model.dtype=bfloat16", "parallel.zero_stage=3", "data.micro_batch=1", "schedule.steps=1", "eval.window=0",
       "checkpoint.max_shard_size=500MB", f"data.seq_len={SEQ_LEN}",
       "logging.report_to=[]"]


def write_folder(folder: Path, shard: str = SHARD) -> dict:
    """The 0.48B model's folder (module docstring), in shards of at most `shard`; its parameter count, shards and
    largest shard in bytes."""
    from anchor_core.export import write_model, write_tokenizer
    from anchor_core.weights import random_preset, random_state
    from torchtrain.training.memory import parameters

    spec = random_preset("llama").replace(**SPEC)
    if not (folder / "model.safetensors.index.json").is_file():
        write_model(spec, random_state(spec, 0), folder, max_shard_size=shard)
        write_tokenizer("random:llama", spec, folder)
    shards = sorted(folder.glob("*.safetensors"))
    return {"parameters": parameters(spec), "shards": [f.name for f in shards],
            "largest_shard_bytes": max(f.stat().st_size for f in shards), "shard_limit": shard, "spec": SPEC}


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


RANK_WORKER = r"""
import json, os, sys
from anchor_core.limits import peak_rss
from torchtrain.config import load_train_config
from torchtrain.config.deepspeed_json import deepspeed_config
from torchtrain.parallel.distributed import ParallelGroups, init_world
from torchtrain.training.fit import model_spec
from torchtrain.parallel.sharded_build import build_partitioned
from torchtrain.training.trainer import release_memory, return_freed_memory

folder, dtype, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = load_train_config("tiny", [f"model.name={folder}", f"model.dtype={dtype}", "parallel.zero_stage=3",
                                 f"parallel.nproc={world}", f"data.global_batch={world}", "data.micro_batch=1",
                                 "data.seq_len=512"])
w = init_world(1, 600)
return_freed_memory()  # as the trainer's rank starts on a CPU (torchtrain.training.trainer._start_rank)
groups = ParallelGroups(w)
spec = model_spec(cfg)
release_memory()  # as the trainer's worker does before it builds
with open("/proc/self/status") as f:
    rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here: the build's own peak
    f.write("5")
model = build_partitioned(folder, engine="varlen", dtype=dtype, rope=spec.rope, seed=0,
                          ds_config=deepspeed_config(cfg, world), group=groups.get_data_parallel_group())
print("RESULT " + json.dumps({"rank": w.rank, "before_bytes": rss, "peak_bytes": peak_rss()}), flush=True)
"""


def build_only(folder: Path, world: int, dtype: str) -> dict:
    """The model built at ZeRO-3 in `world` fresh processes (module docstring, `--build-only`): each rank's peak
    above its resident size just before the build, GiB, or why it failed."""
    import sys

    from torchtrain.parallel.distributed import free_port

    port = str(free_port())
    procs = []
    t0 = time.perf_counter()
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_WORKER, str(folder), dtype, str(world)], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate() for p in procs]
    seconds = round(time.perf_counter() - t0, 1)
    ranks: dict[int, dict] = {}
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            return {"failed": failure(subprocess.CompletedProcess(p.args, p.returncode, out, err)), "seconds": seconds}
        got = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        ranks[got["rank"]] = got
    return {"build_above_before_gib": [round((ranks[r]["peak_bytes"] - ranks[r]["before_bytes"]) / GiB, 4)
                                       for r in range(world)],
            "before_gib": [round(ranks[r]["before_bytes"] / GiB, 4) for r in range(world)], "seconds": seconds}


def build_only_series(args) -> None:
    """`--build-only` (module docstring): for each dtype and world, the build's peak per rank against the plan
    (`build_memory`: rank 0 the reader, the others not) and the bound (the partitions and the largest shard)."""
    import torch

    from anchor_core.machine import machine
    from torchtrain.training.memory import build_memory
    from torchtrain.training.fit import model_spec
    from torchtrain.config import load_train_config

    work = args.work or Path(tempfile.mkdtemp(prefix="sharded-build-only-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        folder = work / f"llama-0.5b-{args.shard}"
        model = write_folder(folder, args.shard)
        spec = model_spec(load_train_config("tiny", [f"model.name={folder}"]))
        rows = []
        for dtype in args.dtypes.split(","):
            for world in [int(w) for w in args.worlds.split(",")]:
                got = build_only(folder, world, dtype)
                tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
                planned = [build_memory(spec, dtype=tdtype, zero_stage=3, world=world, reader=r == 0)[0] / GiB
                           for r in range(world)]
                # a rank's partitions in the run's dtype and the largest shard read (bf16 on one process, fp32 on
                # two: half the float32 parameter bytes, the full run's bound)
                elem = 2 if dtype == "bfloat16" else 4
                bound = (elem * model["parameters"] / world + model["largest_shard_bytes"]) / GiB
                row = {"dtype": dtype, "world": world, "measured": got,
                       "planned_build_gib": [round(x, 4) for x in planned], "bound_gib": round(bound, 4)}
                if "failed" not in got:
                    above = got["build_above_before_gib"]
                    row["planned_over_measured"] = [round(p_ / m, 3) for p_, m in zip(planned, above)]
                    row["measured_over_bound"] = [round(m / bound, 3) for m in above]
                rows.append(row)
                print(json.dumps(row), flush=True)
        result = {"benchmark": "a 0.48B Llama built partitioned at ZeRO-3 from safetensors shards: each rank's build "
                               "peak against the plan (build_memory) and the bound",
                  "method": "fresh processes per case joined by torchtrain.parallel.distributed.init_world (gloo), each "
                            "building the model with torchtrain.parallel.sharded_build.build_partitioned and the run's "
                            "DeepSpeed config, glibc's heap set as the trainer sets it (torchtrain.training.trainer."
                            "return_freed_memory, release_memory); the peak is VmHWM reset to VmRSS just before the build "
                            "(/proc/self/clear_refs), above that VmRSS",
                  "model": model, "rows": rows, "machine": machine()}
        out = args.out if args.out != DEFAULT_OUT else ROOT / "results" / "memory" / "sharded_build_only_cpu.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def predictions(folder: Path, world: int) -> dict:
    """The plan's figures for this case (torchtrain.training.memory), per rank and for the whole run."""
    import torch

    from torchtrain.config import load_train_config
    from torchtrain.training.memory import build_memory, run_memory, step_memory, step_of
    from torchtrain.training.fit import model_spec
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
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--build-only", action="store_true", help="The construction alone (module docstring).")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="With --build-only: the dtypes built.")
    ap.add_argument("--shard", default=SHARD, help="With --build-only: the folder's largest shard (e.g. 400MB).")
    args = ap.parse_args()
    if args.build_only:
        build_only_series(args)
        return
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
