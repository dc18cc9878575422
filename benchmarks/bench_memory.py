"""Peak memory (CPU RSS) of one `anchor train` step per attention engine and window length: the
default engine (`auto`, varlen here) grows linearly in T, sdpa and eager hold a dense T x T mask.

    nice -n 5 .venv/bin/python benchmarks/bench_memory.py [--lens 4096,8192,16384,32768,65536,131072]
        [--engines auto,sdpa,eager] [--margin-gib 4]

One case = one process of

    anchor train --config configs/train/tiny.yaml --out TMP data=PACK seq_len=T steps=1 global_batch=1
        micro_batch=1 rope.theta=1e6 engine=E save_every=0

(tiny.yaml's random:llama, 3 layers; one window of T slots, variant anchor, fp32; the step, then the
final checkpoint) under `/usr/bin/time -v`, whose "Maximum resident set size" is the peak RSS of the
whole process (Python, torch, DeepSpeed, the model, the step). PACK is the embedded corpus packed for
T beforehand, outside the measured process (`pack.budget` = max(60000, 2 T) tokens, so there is at
least one window). A case is skipped, with its estimate recorded, when the estimate exceeds
MemAvailable minus `--margin-gib`: the dense engines' T x T bytes
(`torchtrain.attention.engines.dense_attention_bytes`) plus the default engine's measured peak at that T, or
the default engine's peak extrapolated linearly from its last two lengths.

For the default engine: the growth ratio [peak(64K) - peak(32K)] / [peak(32K) - peak(16K)]
(2 = linear, 4 = quadratic) and the memory per token (least-squares slope over all lengths, MB per
1K tokens). For the dense engines: the fitted T² coefficient of peak minus the default engine's peak,
beside the estimate's. Writes results/memory/memory_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from _peak_rss import GiB, ROOT, measure, pack as pack_corpus, require_time

TINY = ROOT / "configs" / "train" / "tiny.yaml"


def mem_available() -> int:
    from torchtrain.attention.engines import available_memory

    return available_memory("cpu") or 0


def pack(corpus: Path, T: int, out: Path) -> Path:
    """The corpus packed for random:llama at T (not measured)."""
    budget = max(60000, 2 * T)
    pack_corpus(corpus, T, out, model="random:llama", budget=budget)
    windows = json.loads((out / "pack.json").read_text())["num_windows"]
    print(f"packed T={T}: {windows} windows from {budget} tokens", flush=True)
    return out


def train_step(engine: str, T: int, data: Path, run: Path) -> dict:
    """One step in a fresh process under /usr/bin/time -v: peak RSS and wall seconds."""
    import yaml

    print(f"running {engine} at T={T} ...", flush=True)
    row = measure(["train", "--config", str(TINY), "--out", str(run), "--no-progress", f"data.path={data}",
                   f"data.seq_len={T}", "data.global_batch=1", "data.micro_batch=1", "model.rope.theta=1e6",
                   f"model.engine={engine}", "schedule.steps=1", "checkpoint.save_every=0"])
    if "failed" in row:
        return row
    ran = yaml.safe_load((run / "config.yaml").read_text())["model"]["engine"]  # the engine that ran (auto resolved)
    loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    peak = row["peak_rss_bytes"]
    print(f"  {engine} ({ran}) T={T}: peak RSS {peak / GiB:.2f} GiB, {row['seconds']:.0f} s", flush=True)
    return {"resolved_engine": ran, "peak_rss_bytes": peak, "peak_rss_gib": round(peak / GiB, 3),
            "seconds": row["seconds"], "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--engines", default="auto,sdpa,eager")
    ap.add_argument("--margin-gib", type=float, default=4.0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "memory"))
    args = ap.parse_args()
    require_time()

    import numpy as np

    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus
    from anchor_core.machine import machine
    from anchor_core.weights import load_spec
    from torchtrain.attention.engines import dense_attention_bytes, resolve_engine

    lens = sorted(int(x) for x in args.lens.split(","))
    engines = args.engines.split(",")
    spec = load_spec("random:llama")
    rows: list[dict] = []
    auto_peak: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        tmp = Path(tmp)
        write_default_corpus(tmp / "corpus", progress=False)
        corpus = tmp / "corpus" / CORPUS_FILE
        for T in lens:
            data = pack(corpus, T, tmp / f"pack-{T}")
            for engine in engines:
                ran = resolve_engine(engine, "cpu")
                dense = dense_attention_bytes(ran, seq_len=T, batch=1, layers=spec.num_layers, heads=spec.num_heads)
                row = {"engine": engine, "resolved_engine": ran, "seq_len": T}
                if dense:
                    base = auto_peak.get(T)
                    estimate = dense + (base or 0)
                    row["estimate_gib"] = round(estimate / GiB, 2)
                    row["estimate_is"] = ("dense_attention_bytes + the default engine's peak at this T" if base
                                          else "dense_attention_bytes")
                else:
                    known = sorted(auto_peak.items())
                    estimate = 0
                    if len(known) >= 2:
                        (t1, p1), (t2, p2) = known[-2:]
                        estimate = int(p2 + (p2 - p1) / (t2 - t1) * (T - t2))
                        row["estimate_gib"] = round(estimate / GiB, 2)
                        row["estimate_is"] = f"linear from the default engine's peaks at T={t1} and {t2}"
                free = mem_available()
                row["mem_available_gib"] = round(free / GiB, 1)
                if estimate > free - args.margin_gib * GiB:
                    row["skipped"] = (f"estimate {estimate / GiB:.1f} GiB > MemAvailable {free / GiB:.1f} GiB "
                                      f"- {args.margin_gib:g} GiB margin")
                    print(f"  {engine} T={T}: skipped ({row['skipped']})", flush=True)
                else:
                    run = tmp / f"run-{engine}-{T}"
                    row.update(train_step(engine, T, data, run))
                    subprocess.run(["rm", "-rf", str(run)], check=False)
                    if "peak_rss_bytes" in row and engine == "auto":
                        auto_peak[T] = row["peak_rss_bytes"]
                rows.append(row)
            subprocess.run(["rm", "-rf", str(data)], check=False)

    summary: dict = {}
    pts = sorted(auto_peak.items())
    if len(pts) >= 2:
        t, p = np.array([x for x, _ in pts], float), np.array([y for _, y in pts], float)
        slope = float(np.polyfit(t, p, 1)[0])
        summary["default_engine_bytes_per_token"] = round(slope)
        summary["default_engine_mb_per_1k_tokens"] = round(slope * 1024 / 1e6, 1)
    if all(n in auto_peak for n in (16384, 32768, 65536)):
        ratio = (auto_peak[65536] - auto_peak[32768]) / (auto_peak[32768] - auto_peak[16384])
        summary["default_engine_growth_ratio_64k_32k_16k"] = round(ratio, 2)
        summary["default_engine_linear"] = ratio <= 2.5
    for engine in engines:
        dense = [(r["seq_len"], r["peak_rss_bytes"] - auto_peak[r["seq_len"]]) for r in rows
                 if r["engine"] == engine and "peak_rss_bytes" in r and r["seq_len"] in auto_peak and engine != "auto"]
        ran = resolve_engine(engine, "cpu")
        if len(dense) >= 2:
            t, extra = np.array([x for x, _ in dense], float), np.array([y for _, y in dense], float)
            summary[f"{engine}_bytes_per_t2_over_default"] = round(float(np.polyfit(t**2, extra, 1)[0]), 2)
        model = dense_attention_bytes(ran, seq_len=1, batch=1, layers=spec.num_layers, heads=spec.num_heads)
        if model:
            summary[f"{engine}_bytes_per_t2_estimate"] = model
    result = {
        "benchmark": "peak RSS of one `anchor train` step (forward + backward + AdamW + final checkpoint) per engine",
        "command": "anchor train --config configs/train/tiny.yaml --out RUN data=PACK seq_len=T steps=1 global_batch=1 "
                   "micro_batch=1 rope.theta=1e6 engine=E save_every=0",
        "model": f"random:llama ({spec.num_layers} layers, {spec.num_heads} heads, hidden {spec.hidden_size})",
        "variant": "anchor", "dtype": "float32", "windows_per_step": 1,
        "method": "fresh process per case under /usr/bin/time -v (Maximum resident set size); the data packed "
                  "beforehand in another process (pack.budget = max(60000, 2 T))",
        "margin_gib": args.margin_gib,
        "rows": rows, "summary": summary,
        "note": "2-core machine shared with a running test suite: seconds are loaded-machine figures; peak RSS "
                "is per process",
        "machine": machine(mem_available_gib_at_end=round(mem_available() / GiB, 1)),
    }
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "memory_cpu.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
