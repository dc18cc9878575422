"""The whole benchmark, as `anchor bench` runs it: attention, training steps, FLOP model, estimate.

    result = run_bench(seq_lens=(8192,), variants=("full", "anchor"))
    write_bench(result, "out/bench")   # bench.json, report.md, PNG figures

Ratios (`flop_ratio`, `time_ratio`) are a variant's against `full` on the same engine, length,
distribution and windows, measured in the same run (`full` is always timed). On the `varlen`
engine `full` is one causal fused SDPA call per window (torch's fastest exact causal attention),
so `varlen` rows compare each mask's cost with causal attention's.

Sizes are checked before any work against the memory available here (`anchor.bench.memory`:
one line naming the option and the estimate). Temporary files (the cut model, its pack, the training
runs) go to `work_dir` (`anchor bench`: inside --out's staging folder, which the next bench on that
--out removes if this one is killed), else to `cache_dir()/bench/.work.tmp-<pid>-<random>/`, which
the next bench removes once its process is gone.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from anchor.bench import estimate as est
from anchor_core.flops import attention_flops, pairs, step_flops
from anchor.bench.memory import check_bench_memory
from anchor.bench.step import cut_model, time_steps
from anchor.bench.timing import Heads, time_variants
from anchor.bench.windows import (
    DISTRIBUTIONS,
    corpus_pack,
    corpus_source,
    describe,
    doc_lengths,
    layout_seg,
    remove_stale_temporaries,
    synthetic_seg,
)
from anchor_core.data.batch import make_batch
from anchor_core.data.packed import Loader, PackedData
from anchor_core.data.pipeline import PackConfig, pack_corpus
from anchor_core.errors import InputError
from anchor_core.machine import machine
from anchor_core.outdir import rmtree, staging_prefix
from anchor_core.paths import cache_dir
from anchor_core.progress import ProgressBar
from anchor_core.variants import VARIANTS
from anchor_core.weights import load_spec
from torchtrain.attention.engines import ENGINES

PAPER_SAVING = ("AnchorAttention needs less than 50% of full attention's training time "
                "(paper, Figure 6: Llama-2-7B, 8 A100s, DeepSpeed-Ulysses, 1B tokens)")


def _check_list(values: list, known: tuple, flag: str) -> None:
    if not values:
        raise InputError(f"{flag}: empty selection")
    for v in values:
        if v not in known:
            raise InputError(f"{flag}: unknown value {v!r} (known: {', '.join(known)})")


def check_options(*, seq_lens: list[int], variants: list[str], engines: list[str], distributions: list[str],
                  windows: int, repeats: int, step_layers: int, step_steps: int, gpus: int,
                  estimate_lengths: list[int], estimate_model: str, gpu: str) -> None:
    _check_list(variants, VARIANTS, "--variants")
    _check_list(engines, ENGINES, "--engines")
    _check_list(distributions, DISTRIBUTIONS, "--distributions")
    if not seq_lens:
        raise InputError("--seq-len: empty selection")
    for T in [*seq_lens, *estimate_lengths]:
        if T < 16 or T > 1 << 20:
            raise InputError(f"lengths must be in [16, 1048576], got {T}")
    for flag, v in (("--windows", windows), ("--repeats", repeats), ("--step-layers", step_layers),
                    ("--step-steps", step_steps), ("--gpus", gpus)):
        if v < 1:
            raise InputError(f"{flag} must be >= 1, got {v}")
    if estimate_model not in est.SHAPES:
        raise InputError(f"--estimate-model: unknown model {estimate_model!r} (known: {', '.join(est.SHAPES)})")
    if gpu not in est.GPUS:
        raise InputError(f"--gpu: unknown GPU {gpu!r} (known: {', '.join(est.GPUS)})")


def resolve_device(device: str | None = None, dtype: str | None = None) -> tuple[str, str]:
    """(device, dtype) as run_bench uses them: CUDA in bf16 where there is one, else the CPU in fp32."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, dtype or ("bfloat16" if device == "cuda" else "float32")


def check_memory(*, model: str, seq_lens: list[int], variants: list[str], engines: list[str] | None, windows: int,
                 attention: bool, step: bool, step_seq_len: int | None, step_layers: int, device: str | None = None,
                 dtype: str | None = None) -> None:
    """The sizes' estimated memory against the memory available here (anchor.bench.memory), before any
    work: InputError naming the option and the estimate."""
    device, dtype = resolve_device(device, dtype)
    engines = list(engines or (["varlen", "flex", "sdpa"] if device == "cuda" else ["varlen"]))
    check_bench_memory(load_spec(model), model=model, seq_lens=list(seq_lens), engines=engines,
                       variants=list(variants), windows=windows, attention=attention, step=step,
                       step_seq_len=step_seq_len, step_layers=step_layers, device=device, dtype=dtype)


@contextlib.contextmanager
def work_folder(work_dir: str | Path | None = None) -> Iterator[Path]:
    """A folder for the temporary files, removed at the end: `work_dir` (created), else a new
    `cache_dir()/bench/.work.tmp-<pid>-<random>/` (those of dead processes removed first)."""
    if work_dir is not None:
        work = Path(work_dir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        root = cache_dir() / "bench"
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(root)
        work = Path(tempfile.mkdtemp(prefix=staging_prefix(root / "work"), dir=root))
    try:
        yield work
    finally:
        rmtree(work)


def _ratios(rows: list[dict[str, Any]], key: str, group: tuple[str, ...]) -> None:
    """flop_ratio and time_ratio of each row against the `full` row of its group."""
    full = {tuple(r[g] for g in group): r for r in rows if r["variant"] == "full"}
    for r in rows:
        f = full.get(tuple(r[g] for g in group))
        r["flop_ratio"] = round(r["flops"] / f["flops"], 4) if f else None
        ok = f is not None and r.get(key) and f.get(key)
        r["time_ratio"] = round(r[key] / f[key], 4) if ok else None
        r["time_over_flop"] = round(r["time_ratio"] / r["flop_ratio"], 3) if ok and r["flop_ratio"] else None


def run_bench(*, model: str = "default", seq_lens: list[int] = (2048, 4096, 8192, 16384),
              variants: list[str] = ("full", "intra_doc", "anchor"), engines: list[str] | None = None,
              distributions: list[str] = DISTRIBUTIONS, data: str | None = None, windows: int = 2, repeats: int = 2,
              attention: bool = True, step: bool = True, step_seq_len: int | None = None, step_layers: int = 2,
              step_steps: int = 3, step_variants: list[str] | None = None, estimate_model: str = "llama2-7b",
              estimate_lengths: list[int] = (65536, 131072), gpus: int = 8, gpu: str = "a100-80gb",
              device: str | None = None, dtype: str | None = None, seed: int = 0, progress: bool = True,
              work_dir: str | Path | None = None) -> dict[str, Any]:
    """The whole benchmark, as `anchor bench` runs it: attention alone (`_bench_attention`), training steps of
    the model cut to `step_layers` layers with the estimate they calibrate (`_bench_steps`), and the paper's
    setting at assumed GPU rates (`_paper_estimate`). Returns bench.json's content. Temporary files go to
    `work_dir` (module docstring)."""
    import torch


    t_start = time.perf_counter()
    device, dtype = resolve_device(device, dtype)
    engines = list(engines or (["varlen", "flex", "sdpa"] if device == "cuda" else ["varlen"]))
    variants = list(dict.fromkeys(["full", *variants]))  # full: the reference of every ratio
    seq_lens, distributions = list(seq_lens), list(distributions)
    check_options(seq_lens=seq_lens, variants=variants, engines=engines, distributions=distributions,
                  windows=windows, repeats=repeats, step_layers=step_layers, step_steps=step_steps, gpus=gpus,
                  estimate_lengths=list(estimate_lengths), estimate_model=estimate_model, gpu=gpu)
    check_memory(model=model, seq_lens=seq_lens, variants=variants, engines=engines, windows=windows,
                 attention=attention, step=step, step_seq_len=step_seq_len, step_layers=step_layers, device=device,
                 dtype=dtype)
    spec = load_spec(model)
    heads = Heads(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    result: dict[str, Any] = {
        "benchmark": "anchor bench", "machine": machine(torch_threads=torch.get_num_threads()),
        "settings": {"model": model, "device": device, "dtype": dtype, "engines": engines, "variants": variants,
                     "seq_lens": seq_lens, "distributions": distributions, "data": data, "windows": windows,
                     "repeats": repeats, "seed": seed, "heads": heads.__dict__},
        "distributions": {d: describe(d) for d in distributions},
        "attention": [], "step": [], "estimate": [], "paper": PAPER_SAVING,
    }
    if attention:
        result["attention"] = _bench_attention(model, data, seq_lens, distributions, engines, variants, heads,
                                               windows=windows, repeats=repeats, device=device, dtype=dtype,
                                               seed=seed, progress=progress)
    if step:
        _bench_steps(result, model=model, data=data, T=step_seq_len or min(8192, max(seq_lens)),
                     step_variants=list(dict.fromkeys(
                         ["full", *(step_variants or [v for v in variants if v in ("anchor",)])])),
                     engine="varlen" if "varlen" in engines else engines[0], step_layers=step_layers,
                     step_steps=step_steps, device=device, dtype=dtype, progress=progress, work_dir=work_dir)
    _paper_estimate(result, est.SHAPES[estimate_model], est.GPUS[gpu], estimate_lengths, variants, gpus, seed)
    result["runtime_s"] = round(time.perf_counter() - t_start, 1)
    return result


def _bench_attention(model: str, data: str | None, seq_lens: list[int], distributions: list[str],
                     engines: list[str], variants: list[str], heads, *, windows: int, repeats: int, device: str,
                     dtype: str, seed: int, progress: bool) -> list[dict[str, Any]]:
    """Attention alone, forward and backward, of every engine × variant on the same windows per length and
    distribution; each row with its ratios against `full`."""
    rows: list[dict[str, Any]] = []
    bar = ProgressBar("bench attention", len(seq_lens) * len(distributions) * len(engines), progress)
    for T in seq_lens:
        for dist in distributions:
            seg = layout_seg(dist, T, windows, model=model, data=data, seed=seed, progress=False)
            n_pairs = {v: int(pairs(make_batch(seg, seg, np.zeros_like(seg), v).doc_ids, v).sum()) for v in variants}
            lengths = doc_lengths(seg)
            for engine in engines:
                bar.describe(f"{engine} T={T} {dist}")
                timed = time_variants(engine, variants, seg, heads, device=device, dtype=dtype,
                                      repeats=repeats, seed=seed)
                for v in variants:
                    row = {"engine": engine, "variant": v, "seq_len": T, "distribution": dist, "pass": "fwd+bwd",
                           "windows": int(seg.shape[0]), "documents": [len(x) for x in lengths],
                           "longest_document": [max(x) if x else 0 for x in lengths], "pairs": n_pairs[v],
                           "flops": float(attention_flops(n_pairs[v], heads.heads, heads.head_dim)),
                           **timed[v]}
                    rows.append(row)
                bar.advance(1)
    bar.close()
    _ratios(rows, "ms", ("engine", "seq_len", "distribution"))
    return rows


def step_pack(folder: Path, T: int, pack: Path, *, model: str, data: str | None) -> Path:
    """The corpus packed at T with the cut model's own tokenizer (the trainer checks it) into `pack`."""
    try:
        pack_corpus(str(folder), corpus_pack(T, model=model, data=data), pack, PackConfig(seq_len=T))
    except InputError:  # its tokenizer's identity differs from the model's: tokenize again
        pack_corpus(str(folder), corpus_source(data), pack, PackConfig(seq_len=T))
    return pack


def _bench_steps(result: dict[str, Any], *, model: str, data: str | None, T: int, step_variants: list[str],
                 engine: str, step_layers: int, step_steps: int, device: str, dtype: str, progress: bool,
                 work_dir: str | Path | None = None) -> None:
    """Training steps of the model cut to its first `step_layers` layers, on windows of T packed from the
    corpus: rows into result["step"], then the calibration they give and its estimate per variant."""
    import torch


    bar = ProgressBar("bench step", len(step_variants), progress)
    with work_folder(work_dir) as tmp:
        folder, cut = cut_model(model, step_layers, T, Path(tmp) / "model")
        pack = step_pack(folder, T, Path(tmp) / "data", model=model, data=data)
        packed = PackedData.open(pack)
        for v in step_variants:
            bar.describe(f"{v} T={T}")
            row = {"engine": engine, "variant": v, "seq_len": T, "model": model, "layers": step_layers,
                   "dtype": dtype, "steps": step_steps}
            try:
                row.update(time_steps(folder, pack, T, v, engine, Path(tmp) / f"run-{v}", steps=step_steps,
                                      dtype=dtype, device=device))
            except torch.OutOfMemoryError:
                row["error"] = f"out of memory at T={T}"
            # the windows the steps trained on: the loader's first `steps` (seed 0), as the trainer draws them
            loader = Loader(packed, batch_size=1, variant=v, seed=0)
            n_pairs = sum(int(pairs(next(loader).doc_ids, v).sum()) for _ in range(step_steps))
            row.update({k: v_ / step_steps for k, v_ in step_flops(cut, n_pairs, T * step_steps).items()})
            row["flops"] = row.pop("total")
            row["dense_flops"], row["attention_flops"] = row.pop("dense"), row.pop("attention")
            result["step"].append(row)
            bar.advance(1)
    bar.close()
    _ratios(result["step"], "step_s", ("engine", "seq_len"))
    _calibrated_estimate(result, cut, T, model, step_layers)


def _calibrated_estimate(result: dict[str, Any], cut, T: int, model: str, step_layers: int) -> None:
    """The GPU rates calibrated on the measured steps (result["calibration"]) and, for each timed step, the
    estimate of the cut model at T with them (into result["estimate"])."""
    cal = est.calibrate(result["step"])
    if cal is None:
        return
    result["calibration"] = {**cal, "machine": "this one", "model": f"{model}, first {step_layers} layers"}
    here = est.shape_of(cut, f"{model} ({step_layers} layers)")
    for r in result["step"]:
        if r.get("step_s"):
            e = est.estimate(here, T, 1, r["attention_flops"] / (
                est.BWD_FACTOR * 4 * cut.num_layers * cut.num_heads * cut.head_dim), est.GPUS["a100-80gb"],
                rates=cal["rates_flops_per_s"])
            e.update(variant=r["variant"], distribution="corpus", measured_step_s=r["step_s"])
            result["estimate"].append(e)


def _paper_estimate(result: dict[str, Any], shape, g, estimate_lengths: list[int], variants: list[str], gpus: int,
                    seed: int) -> None:
    """The estimate: the paper's setting with assumed GPU rates, on synthetic windows of each length (into
    result["estimate"], with each variant's saving against full), and its assumptions."""
    for T in estimate_lengths:
        for dist in ("long_upsampled", "slimpajama"):
            seg = synthetic_seg(dist, T, 8, seed)
            per_variant = {}
            for v in variants:
                p = float(pairs(make_batch(seg, seg, np.zeros_like(seg), v).doc_ids, v).mean())
                per_variant[v] = est.estimate(shape, T, gpus, p, g)
            for v, e in per_variant.items():
                e.update(variant=v, distribution=dist,
                         saving_vs_full=round(1 - e["days_per_1b_tokens"] / per_variant["full"]["days_per_1b_tokens"], 4))
                result["estimate"].append(e)
    result["estimate_assumptions"] = est.assumptions(g)
