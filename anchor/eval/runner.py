"""`anchor eval`: RULER at exact lengths over checkpoints, averaged, with perplexity beside it (docs/DESIGN.md §9).

    result = run_eval(checkpoints=[("step-40", "runs/x/checkpoints/step-40"), ...], tasks=["niah_single_1"],
                      lengths=[1024, 2048], samples=10)
    write_eval(result, "runs/x-eval")      # eval.json, samples.jsonl, report.md, score_vs_length.png

What runs, per checkpoint (a model of docs/DESIGN.md §6 or a training checkpoint's `hf/`):
  RULER     every task × length: the same `samples` prompts for every checkpoint (generated once with
            the model's tokenizer, `anchor.eval.ruler`), the BOS in front where the model has one (the
            prompt is generated one token shorter so prompt + BOS + answer budget fit the length),
            greedy generation with a KV cache (`anchor.eval.generate`), RULER's score 0–100
            (`anchor.eval.scoring`: string-match-all, or string-match-part for QA)
  perplexity  per length, on held-out packed windows (`anchor.eval.perplexity`; `perplexity_docs="long"`:
            one long held-out document per window), with the mean NLL per bucket of `perplexity_bucket`
            positions (`buckets` of each perplexity row)
Each RULER row carries its samples' scores (`sample_scores`, RULER's metric per sample) and their standard
error (`se`, the standard deviation over samples / sqrt(n)). Then per task × length: mean and standard
deviation over the checkpoints (the paper averages five checkpoints of the last 50 steps), and the standard
error over samples of the checkpoint mean (`se`: each sample's score averaged over the checkpoints, which
all read the same prompts). The model runs on CUDA where torch sees it (`settings.device`), else on the CPU.

Nothing finished is lost when an evaluation is killed: with `parts` (`parts_dir(out)`, the CLI's and the
demo's), each checkpoint's rows, perplexity and samples are written there (one JSON file, atomically) as
soon as it is done, and a later call with the same settings, checkpoints and model files reuses them;
`write_eval` removes the folder once `out` is published.

Which checkpoints of a run (`checkpoints_of_run`): by default those of the run's evaluation schedule
(`eval.every` / `eval.window` of its config.yaml: the last five, every 10 steps), else the names given
(`step-40` or `40`). Every checkpoint must verify against its manifest before it is read
(`anchor_core.weights.model_folder`, which a checkpoint folder given as a model goes through too).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from anchor.eval import generate, ruler, scoring
from anchor.eval.dtype import dtype_choice
from anchor.eval.generate import eval_model_source
from anchor.eval.harness import render_table
from anchor.eval.perplexity import heldout_windows, perplexity
from anchor_core import __version__
from anchor_core.atomic import publish, staging_dir
from anchor_core.errors import InputError
from anchor_core.machine import machine
from anchor_core.parts import Parts, parts_dir, remove_parts
from anchor_core.parts import files_id as _files_id
from anchor_core.parts import normal as _normal
from anchor_core.parts import plain as _plain
from anchor_core.progress import ProgressBar
from anchor_core.tokenizer import load_tokenizer
from anchor_core.weights import load_spec, model_folder, model_identity
from torchtrain.training import checkpoint as ckpt
from torchtrain.attention import engines
from torchtrain.training.memory import forward_memory
from torchtrain.training.resume import load_run_config
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "vt", "cwe", "fwe")
DEFAULT_LENGTHS = (1024, 2048)
PERPLEXITY_DOCS = ("packed", "long")  # held-out windows: packed documents, or one long document per window


def checkpoints_of_run(run: str | Path, names: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """[(label "step-N", its folder)] of a training run, oldest first: the run's evaluation-schedule
    checkpoints, or those named. A missing run, checkpoint or `hf/` folder, or one failing its
    manifest, is a one-line InputError."""
    run = Path(run)
    if not (run / "config.yaml").is_file():
        raise InputError("not a training run (no config.yaml; give the --out of `anchor train`)", path=run)
    steps = ckpt.list_steps(run)
    if not steps:
        raise InputError("the run has no published checkpoint", path=run)
    if names:
        chosen = []
        for n in names:
            s = n.removeprefix("step-")
            if not s.isdigit() or int(s) not in steps:
                raise InputError(f"--checkpoints: no checkpoint {n!r} in the run (has: "
                                 f"{', '.join(f'step-{x}' for x in sorted(steps))})", path=run)
            chosen.append(int(s))
    else:
        cfg = load_run_config(run)
        chosen = [s for s in steps if cfg.is_eval_step(s)]
        if not chosen:
            raise InputError("the run has no checkpoint of its evaluation schedule (eval.every/eval.window); "
                             "name them with --checkpoints", path=run)
    return [(f"step-{s}", str(model_folder(ckpt.step_dir(run, s)))) for s in sorted(set(chosen))]


def _prompts(tok, samples) -> list[list[int]]:
    ids = tok.encode_batch([s.prompt for s in samples])
    bos = tok.first_token_id
    return [([bos] if bos is not None else []) + x for x in ids]


def resolve_dtype(dtype: str) -> str:
    """The evaluation dtype for `--dtype` (auto, bfloat16, float32): `anchor.eval.dtype.dtype_choice`'s."""
    return dtype_choice(dtype)["dtype"]


def run_eval(checkpoints: Sequence[tuple[str, str]], *, tasks: Sequence[str] = DEFAULT_TASKS,
             lengths: Sequence[int] = DEFAULT_LENGTHS, samples: int = 10, seed: int = 42,
             haystack: str | None = None, qa_data: dict[str, str] | None = None, engine: str = "sdpa",
             dtype: str = "auto", batch_size: int = 4, perplexity_windows: int = 2,
             perplexity_docs: str = "packed", perplexity_bucket: int = 2048, perplexity_data: str | None = None,
             group_by_budget: bool = False, progress: bool = False,
             parts: str | Path | None = None) -> dict[str, Any]:
    """Evaluate every checkpoint (label, model source) on RULER `tasks` × `lengths` and perplexity.

    `parts`: a folder (`parts_dir(out)`) where each finished checkpoint is kept, and reused from, so a
    killed evaluation resumes at the checkpoint it was on (module docstring).
    `perplexity_docs`: "packed" (held-out documents packed as training windows) or "long" (one held-out
    document of at least the length per window); `perplexity_bucket`: positions per bucket of the NLL by
    position; `perplexity_data`: held-out documents (None: the standard library's test suites).
    `group_by_budget`: the tasks whose answers have the same budget generate together at each length
    (`batch_size` prompts per forward as always; the same answers up to the rounding of other batch shapes).

    Returns eval.json's content: rows (checkpoint, task, length, score, samples, se, sample_scores),
    summary (task, length, mean, std, se, checkpoints), perplexity rows (checkpoint, length, ppl, nll,
    tokens, windows, buckets), the samples with predictions (for samples.jsonl), settings, machine,
    runtime_s.
    """
    choice = dtype_choice(dtype)
    dtype = choice["dtype"]
    if perplexity_docs not in PERPLEXITY_DOCS:
        raise InputError(f"perplexity_docs must be one of {', '.join(PERPLEXITY_DOCS)}, got {perplexity_docs!r}")
    if isinstance(perplexity_bucket, bool) or not isinstance(perplexity_bucket, int) or perplexity_bucket < 1:
        raise InputError(f"perplexity_bucket must be an integer >= 1, got {perplexity_bucket!r}")

    t0 = time.time()
    tok = _check_inputs(checkpoints, tasks, lengths, samples, engine=engine, dtype=dtype, batch_size=batch_size)
    bos = 1 if tok.first_token_id is not None else 0
    qa_data = qa_data or {}
    prompt_sets = _generate_prompts(tok, bos, tasks, lengths, samples, seed, haystack, qa_data)
    windows = _heldout(tok, lengths, perplexity_windows, perplexity_docs, perplexity_data)
    settings = {"tasks": list(tasks), "lengths": list(lengths), "samples": samples, "seed": seed,
                "haystack": haystack or "embedded corpus prose", "engine": engine, "dtype": dtype,
                "batch_size": batch_size, "perplexity_windows": perplexity_windows,
                "perplexity_docs": perplexity_docs, "perplexity_bucket": perplexity_bucket,
                "perplexity_data": perplexity_data or "stdlib test suites", "device": eval_device(),
                "group_by_budget": bool(group_by_budget),
                "bos": bool(bos), "scoring": "RULER: string_match_all; string_match_part for qa_*"}
    rows, ppl_rows, sample_rows, reused_s = _evaluate_checkpoints(
        checkpoints, tok, bos, prompt_sets, windows, settings, haystack=haystack, qa_data=qa_data, parts=parts,
        progress=progress)
    return {
        "rows": rows, "summary": _summary(rows, tasks, lengths), "perplexity": ppl_rows, "samples": sample_rows,
        "checkpoints": [{"label": lb, "source": src} for lb, src in checkpoints],
        "settings": settings, "dtype_choice": choice, "machine": machine(),
        "runtime_s": round(time.time() - t0 + reused_s, 1),
    }


def _check_inputs(checkpoints: Sequence[tuple[str, str]], tasks: Sequence[str], lengths: Sequence[int],
                  samples: int, *, engine: str = "sdpa", dtype: str = "float32", batch_size: int = 4):
    """Check what `run_eval` was given before any work (one-line InputErrors), the memory of each length
    included (torchtrain.training.memory.forward_memory against the memory free here); returns the tokenizer of the
    first checkpoint's model (every checkpoint reads the same prompts)."""
    if not checkpoints:
        raise InputError("nothing to evaluate (no checkpoint or model)")
    for t in tasks:
        ruler.task_config(t)  # unknown tasks: one line naming the valid ones
    if samples < 1:
        raise InputError(f"--samples must be >= 1, got {samples}")
    first_source = eval_model_source(checkpoints[0][1])
    spec = load_spec(first_source)
    for L in lengths:
        if L < 64:
            raise InputError(f"--lengths: {L} is too short for a RULER prompt (at least 64 tokens)")
        if L > spec.max_position:
            raise InputError(f"--lengths: {L} is longer than the model's {spec.max_position} positions "
                             f"(max_position_embeddings of {checkpoints[0][1]})")
    _check_memory(spec, max(lengths, default=0), engine=engine, dtype=dtype, batch_size=batch_size)
    return load_tokenizer(first_source)


def _check_memory(spec, length: int, *, engine: str, dtype: str, batch_size: int) -> None:
    """The longest length's forward (a batch of prompts with their KV cache) against the memory free here."""
    import torch


    if length <= 0:
        return
    cuda = torch.cuda.is_available()
    need = forward_memory(spec, seq_len=length, batch=batch_size, engine=engine,
                          dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    free = engines.available_memory("cuda" if cuda else "cpu")
    if free is not None and need.total > free:
        hint = ("most of it is the engine's dense T x T mask: --engine varlen is linear in T"
                if need.dense > need.activations else "shorter --lengths or a smaller --batch-size")
        raise InputError(f"--lengths {length} needs about {need.describe()} to evaluate (--batch-size {batch_size}, "
                         f"engine {engine}, {dtype}); {free / 2**30:.1f} GiB available here: {hint}")


def _generate_prompts(tok, bos: int, tasks: Sequence[str], lengths: Sequence[int], samples: int, seed: int,
                      haystack: str | None, qa_data: dict[str, str]) -> dict[tuple[str, int], list]:
    """The prompts of every task × length: once, for every checkpoint (one token shorter with a BOS)."""
    prompt_sets: dict[tuple[str, int], list] = {}
    for t in tasks:
        for L in lengths:
            prompt_sets[(t, L)] = ruler.generate(t, L - bos, tok, samples, seed=seed, haystack=haystack,
                                                 qa_data=qa_data.get(t))
    return prompt_sets


def tasks_that_do_not_fit(tok, tasks: Sequence[str], lengths: Sequence[int], samples: int, seed: int,
                          haystack: str | None = None) -> dict[str, str]:
    """{task: why} for each RULER task whose prompts (made as `run_eval` makes them) do not fit one of
    `lengths` with this tokenizer; seconds of tokenizing, no model. The qa tasks (which read files) are
    not checked here."""
    bos = 1 if tok.first_token_id is not None else 0
    out: dict[str, str] = {}
    for t in tasks:
        if t.startswith("qa_"):
            continue
        for L in lengths:
            try:
                ruler.generate(t, L - bos, tok, samples, seed=seed, haystack=haystack)
            except InputError as e:
                out[t] = str(e)
                break
    return out


def _heldout(tok, lengths: Sequence[int], perplexity_windows: int, docs: str = "packed",
             data: str | None = None) -> dict[int, Any]:
    """{length: held-out windows} for perplexity ({} when `perplexity_windows` is 0)."""
    if not perplexity_windows:
        return {}
    return {L: heldout_windows(tok, L, perplexity_windows, data or None, whole_documents=docs == "long")
            for L in lengths}


def eval_device() -> str:
    """Where the evaluated models run: CUDA where torch sees it, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def standard_error(values: Sequence[float]) -> float | None:
    """The standard error of the mean of `values` (sample standard deviation / sqrt(n)); 0.0 for one value,
    None for none."""
    if len(values) == 0:
        return None
    if len(values) == 1:
        return 0.0
    return float(np.std(np.asarray(values, dtype=np.float64), ddof=1) / np.sqrt(len(values)))


def part_key(settings: dict[str, Any], label: str, source: str, haystack: str | None,
             qa_data: dict[str, str]) -> dict[str, Any]:
    """What a checkpoint's kept part was computed from: the settings, the model's bytes (`model_identity` of
    the folder or file `source` loads: `default` is the GGUF it resolves to, so a changed file keys anew
    whatever its name, size or modification time), the haystack and QA files."""
    return {"anchor": __version__, "settings": settings, "label": label, "source": str(source),
            "files": model_identity(eval_model_source(source)), "haystack": _files_id(haystack) if haystack else None,
            "qa_data": {t: _files_id(f) for t, f in sorted(qa_data.items())}}


def _evaluate_checkpoints(checkpoints: Sequence[tuple[str, str]], tok, bos: int,
                          prompt_sets: dict[tuple[str, int], list], windows: dict[int, Any],
                          settings: dict[str, Any], *, haystack: str | None, qa_data: dict[str, str],
                          parts: str | Path | None, progress: bool) -> tuple[list, list, list, float]:
    """Every checkpoint in turn: its part from `parts` when a killed evaluation finished it with these
    settings, else evaluated and its part saved. Returns (rows, perplexity rows, sample rows, the seconds
    the reused parts took)."""
    per_checkpoint = (len(settings["tasks"]) * len(settings["lengths"]) * settings["samples"]
                      + len(windows) * settings["perplexity_windows"])
    store = Parts(parts, "eval")
    bar = ProgressBar("eval", len(checkpoints) * per_checkpoint, progress, unit="prompts")
    rows, ppl_rows, sample_rows = [], [], []
    reused_s = 0.0
    try:
        for i, (label, source) in enumerate(checkpoints):
            key = None if parts is None else part_key(settings, label, source, haystack, qa_data)

            def evaluate(label=label, source=source) -> dict[str, Any]:
                t_ckpt = time.time()
                mine = _evaluate_checkpoint(label, source, tok, bos, prompt_sets, windows, settings, bar)
                # as a reused part reads back (anchor_core.parts.normal): the same result either way
                return _normal({**mine, "seconds": round(time.time() - t_ckpt, 1)})

            mine, taken = store.kept(f"part-{i}", key, evaluate)
            if taken:
                bar.describe(f"{label}: evaluated before, reused")
                reused_s += float(mine["seconds"])
                bar.advance(per_checkpoint)
            rows += mine["rows"]
            ppl_rows += mine["perplexity"]
            sample_rows += mine["samples"]
    finally:
        bar.close()
    return rows, ppl_rows, sample_rows, reused_s


def _evaluate_checkpoint(label: str, source: str, tok, bos: int, prompt_sets: dict[tuple[str, int], list],
                         windows: dict[int, Any], settings: dict[str, Any], bar: ProgressBar) -> dict[str, list]:
    """One checkpoint: greedy answers to every prompt, scored, and perplexity on the held-out windows."""
    mine: dict[str, list] = {"rows": [], "perplexity": [], "samples": []}
    bar.describe(f"{label}: loading")
    model = generate.load_eval_model(source, engine=settings["engine"], dtype=settings["dtype"])
    if settings.get("device", "cpu") != "cpu":
        model = model.to(settings["device"])  # the device only: the RoPE buffers stay float32
    generated = _generate_groups(model, tok, prompt_sets, settings, bar, label)
    for (t, L), ss in prompt_sets.items():
        outs = generated[(t, L)]
        preds = [tok.decode(o) for o in outs]
        per_sample = [scoring.score(t, [p], [s.answers]) for p, s in zip(preds, ss)]
        mine["rows"].append({"checkpoint": label, "task": t, "length": L,
                             "score": scoring.score(t, preds, [s.answers for s in ss]), "samples": len(ss),
                             "se": standard_error(per_sample), "sample_scores": per_sample})
        for s, p, o in zip(ss, preds, outs):
            mine["samples"].append({"checkpoint": label, "task": t, "length": L, "index": s.index,
                                    "input": s.input, "answer_prefix": s.answer_prefix, "answers": s.answers,
                                    "prediction": p, "prompt_tokens": s.prompt_tokens + bos,
                                    "generated_tokens": len(o)})
    for L, w in windows.items():
        bar.describe(f"{label}: perplexity at {L}")
        r = perplexity(model, w, "full", bucket=settings.get("perplexity_bucket", 2048))
        mine["perplexity"].append({"checkpoint": label, "length": L, "ppl": r.ppl, "nll": r.nll,
                                   "tokens": r.tokens, "windows": r.windows, "bucket": r.bucket,
                                   "buckets": [dict(b) for b in r.buckets]})
        bar.advance(settings["perplexity_windows"])
    del model
    return mine


def _generate_groups(model, tok, prompt_sets: dict[tuple[str, int], list], settings: dict[str, Any], bar: ProgressBar,
                     label: str) -> dict[tuple[str, int], list[list[int]]]:
    """Greedy answers to every prompt set, {(task, length): generated ids per sample}: one `greedy_generate`
    call per set, or with `settings["group_by_budget"]` one per length and answer budget, the tasks that share
    both in the same batches (a batch runs until its longest answer is done: the needle tasks' 128 tokens
    then pass once per length instead of once per task)."""
    groups: dict[Any, list[tuple[str, int]]] = {}
    for (t, L), ss in prompt_sets.items():
        budgets = {s.tokens_to_generate for s in ss}
        key = (L, budgets.pop()) if settings.get("group_by_budget") and len(budgets) == 1 else (t, L)
        groups.setdefault(key, []).append((t, L))
    out: dict[tuple[str, int], list[list[int]]] = {}
    for members in groups.values():
        bar.describe(f"{label}: {', '.join(t for t, _ in members)} at {members[0][1]}")
        sets = [prompt_sets[m] for m in members]
        outs = generate.greedy_generate(model, tok, [p for ss in sets for p in _prompts(tok, ss)],
                               [s.tokens_to_generate for ss in sets for s in ss],
                               batch_size=settings["batch_size"], progress=False)
        for m, ss in zip(members, sets):
            out[m], outs = outs[:len(ss)], outs[len(ss):]
        bar.advance(sum(len(ss) for ss in sets))
    return out


def _summary(rows: list[dict[str, Any]], tasks: Sequence[str], lengths: Sequence[int]) -> list[dict[str, Any]]:
    """Per task × length: the mean and standard deviation of the score over the checkpoints, and the
    standard error over samples of that mean (each sample's score averaged over the checkpoints)."""
    summary = []
    for t in tasks:
        for L in lengths:
            mine = [r for r in rows if r["task"] == t and r["length"] == L]
            vals = [r["score"] for r in mine]
            summary.append({"task": t, "length": L, "mean": float(np.mean(vals)),
                            "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                            "se": sample_mean_se([r.get("sample_scores") for r in mine]),
                            "checkpoints": [r["checkpoint"] for r in mine]})
    return summary


def sample_mean_se(per_checkpoint: Sequence[Sequence[float] | None]) -> float | None:
    """The standard error over samples of a score averaged over checkpoints that read the same prompts:
    each sample's score averaged over the checkpoints, then `standard_error` of those (None when a
    checkpoint's per-sample scores are missing or their counts differ)."""
    if not per_checkpoint or any(s is None for s in per_checkpoint) or len({len(s) for s in per_checkpoint}) != 1:
        return None
    return standard_error(np.mean(np.asarray(per_checkpoint, dtype=np.float64), axis=0).tolist())


def _table(result: dict[str, Any]) -> list[str]:
    """Rows: checkpoints, then their mean ± std; columns: lengths (mean over tasks), as the paper's tables."""
    lengths = result["settings"]["lengths"]
    labels = [c["label"] for c in result["checkpoints"]]
    lines = ["| checkpoint | " + " | ".join(str(L) for L in lengths) + " | avg |", "|---" * (len(lengths) + 2) + "|"]
    per = {}
    for lb in labels:
        vals = [float(np.mean([r["score"] for r in result["rows"] if r["checkpoint"] == lb and r["length"] == L]))
                for L in lengths]
        per[lb] = vals
        lines.append(f"| {lb} | " + " | ".join(f"{v:.1f}" for v in vals) + f" | {np.mean(vals):.1f} |")
    if len(labels) > 1:
        arr = np.array([per[lb] for lb in labels])
        lines.append("| **mean ± std** | " + " | ".join(f"{m:.1f} ± {s:.1f}" for m, s in zip(arr.mean(0), arr.std(0, ddof=1)))
                     + f" | {arr.mean():.1f} |")
    return lines


def _bucket_table(result: dict[str, Any]) -> list[str]:
    """The held-out NLL by position bucket at the longest length, a row per checkpoint ([] without buckets)."""
    rows = [r for r in result["perplexity"] if r.get("buckets")]
    if not rows:
        return []
    L = max(r["length"] for r in rows)
    rows = [r for r in rows if r["length"] == L]
    spans = [(b["start"], b["end"]) for b in rows[0]["buckets"]]
    head = " | ".join(f"{a}-{e}" for a, e in spans)
    lines = ["", f"### Held-out NLL by position at {L} (mean over the targets predicted at those positions)", "",
             f"| checkpoint | {head} |", "|---" * (len(spans) + 1) + "|"]
    for r in rows:
        by = {(b["start"], b["end"]): b["nll"] for b in r["buckets"]}
        lines.append(f"| {r['checkpoint']} | " + " | ".join(f"{by[k]:.3f}" if k in by else "-" for k in spans) + " |")
    return lines


def render_report(result: dict[str, Any], figure: str | None) -> str:
    s = result["settings"]
    lines = ["# RULER evaluation", "",
             f"{len(result['checkpoints'])} checkpoint(s), tasks {', '.join(s['tasks'])}, lengths "
             f"{', '.join(map(str, s['lengths']))}, {s['samples']} samples each (seed {s['seed']}), greedy decoding on "
             f"engine `{s['engine']}` in {s['dtype']}; scores 0–100 ({s['scoring']}). Runtime {result['runtime_s']:.0f} s.",
             "", "## Score by length (mean over tasks)", "", *_table(result), "",
             "## Per task (mean ± std over checkpoints; SE: standard error over samples)", "",
             "| task | " + " | ".join(str(L) for L in s["lengths"]) + " |", "|---" * (len(s["lengths"]) + 1) + "|"]
    for t in s["tasks"]:
        cells = []
        for L in s["lengths"]:
            e = next(x for x in result["summary"] if x["task"] == t and x["length"] == L)
            se = f" (SE {e['se']:.1f})" if e.get("se") is not None else ""
            cells.append(f"{e['mean']:.1f} ± {e['std']:.1f}{se}")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    if result["perplexity"]:
        lines += ["", "## Perplexity on held-out windows", "", "| checkpoint | " + " | ".join(str(L) for L in s["lengths"])
                  + " |", "|---" * (len(s["lengths"]) + 1) + "|"]
        for c in result["checkpoints"]:
            vals = {r["length"]: r["ppl"] for r in result["perplexity"] if r["checkpoint"] == c["label"]}
            lines.append(f"| {c['label']} | " + " | ".join(f"{vals[L]:.2f}" if L in vals else "-" for L in s["lengths"]) + " |")
        lines += _bucket_table(result)
    if figure:
        lines += ["", f"![score against length]({figure})"]
    text = "\n".join(lines) + "\n"
    if result.get("harness"):
        text += "\n" + render_table(result["harness"])
    return text


def plot(result: dict[str, Any], path: Path) -> None:
    """Score (mean over tasks) against length, one line per checkpoint and the mean ± std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = result["settings"]["lengths"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    arr = []
    for c in result["checkpoints"]:
        vals = [float(np.mean([r["score"] for r in result["rows"] if r["checkpoint"] == c["label"] and r["length"] == L]))
                for L in lengths]
        arr.append(vals)
        ax.plot(lengths, vals, "-o", ms=3, lw=1, alpha=0.6, label=c["label"])
    a = np.array(arr)
    if len(arr) > 1:
        m, sd = a.mean(0), a.std(0, ddof=1)
        ax.plot(lengths, m, "-", color="black", lw=2, label="mean")
        ax.fill_between(lengths, m - sd, m + sd, color="black", alpha=0.1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("RULER score (mean over tasks)")
    ax.set_ylim(-2, 102)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_eval(result: dict[str, Any], out: str | Path) -> Path:
    """eval.json (without the samples), samples.jsonl, report.md, score_vs_length.png into `out`, atomically;
    then the finished checkpoints kept for a resume (`parts_dir(out)`) are removed."""
    out = Path(out).resolve()
    with staging_dir(out, "eval") as tmp:
        work = tmp / "eval"
        work.mkdir()
        body = {k: v for k, v in result.items() if k != "samples"}
        (work / "eval.json").write_text(json.dumps(body, indent=1, default=_plain))
        with open(work / "samples.jsonl", "w", encoding="utf-8") as f:
            for s in result["samples"]:
                f.write(json.dumps(s, ensure_ascii=False) + "\n")
        plot(result, work / "score_vs_length.png")
        (work / "report.md").write_text(render_report(result, "score_vs_length.png"))
        publish(work, out, "eval")
    remove_parts(parts_dir(out), "eval")
    return out


__all__ = ["DEFAULT_LENGTHS", "DEFAULT_TASKS", "checkpoints_of_run", "parts_dir", "resolve_dtype", "render_report", "run_eval", "write_eval"]

