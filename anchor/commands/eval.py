"""`anchor eval`: RULER offline at exact lengths, averaged over a run's last checkpoints, perplexity beside it (docs/DESIGN.md §9)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from anchor.cli import app


def _split(text: str, option: str) -> list[str]:
    from anchor_core.errors import InputError

    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"{option}: nothing given")
    return list(dict.fromkeys(items))


SUMMARY = "Evaluate checkpoints on RULER and held-out perplexity."


@app.command(name="eval", short_help=SUMMARY)
def eval_(
    out: Annotated[Path, typer.Option("--out", help="Output folder (replaced when complete).")],
    run: Annotated[Optional[Path], typer.Option(
        "--run", help="A training run (the --out of `anchor train`): its evaluation-schedule checkpoints.")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", help="Or one model: HF folder, .gguf file, checkpoint folder, random:<preset> or default.")] = None,
    checkpoints: Annotated[Optional[str], typer.Option(
        "--checkpoints", help="With --run: comma-separated checkpoints (step-40,step-50) instead of the schedule's.")
    ] = None,
    tasks: Annotated[str, typer.Option(
        "--tasks", help="Comma-separated RULER tasks (niah_single_1..3, niah_multikey_1..3, niah_multivalue, "
                        "niah_multiquery, vt, cwe, fwe, qa_1, qa_2).")
    ] = "niah_single_1,niah_single_2,niah_multikey_1,vt,cwe,fwe",
    lengths: Annotated[str, typer.Option("--lengths", help="Comma-separated lengths in tokens.")] = "1024,2048",
    samples: Annotated[int, typer.Option("--samples", help="Prompts per task and length.")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the prompts.")] = 42,
    haystack: Annotated[Optional[str], typer.Option(
        "--haystack", help="Prose for the essay haystack (text, JSONL with `text`, or an `anchor corpus` folder); "
                        "default: the embedded corpus.")
    ] = None,
    squad: Annotated[Optional[Path], typer.Option("--squad", help="qa_1: SQuAD v2.0 dev JSON.")] = None,
    hotpotqa: Annotated[Optional[Path], typer.Option("--hotpotqa", help="qa_2: HotpotQA dev distractor JSON.")] = None,
    engine: Annotated[str, typer.Option("--engine", help="torchtrain engine of the prefill and perplexity.")] = "sdpa",
    dtype: Annotated[str, typer.Option(
        "--dtype", help="auto (bfloat16 with CUDA; on a CPU the faster of bfloat16 and float32 in a matmul "
                        "measured once on this machine), bfloat16 or float32; eval.json records the one used "
                        "and why (dtype_choice).")] = "auto",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts per forward.")] = 4,
    perplexity_windows: Annotated[int, typer.Option(
        "--perplexity-windows", help="Held-out windows per length for perplexity (0: none).")] = 2,
    harness: Annotated[Optional[str], typer.Option(
        "--harness", help="Also run lm-evaluation-harness's own tasks on the same model: lm-eval.")] = None,
    harness_tasks: Annotated[str, typer.Option(
        "--harness-tasks", help="With --harness: its offline RULER tasks (niah_single_1, niah_multikey_2, "
                                "niah_multikey_3, vt, cwe, fwe) and local-data tasks (mmlu, hellaswag, longbench).")
    ] = "niah_single_1,niah_multikey_2,niah_multikey_3,vt,cwe,fwe",
    harness_data: Annotated[Optional[Path], typer.Option(
        "--harness-data", help="Folder with mmlu.jsonl, hellaswag.jsonl, longbench.jsonl (configs/eval/*.yaml).")
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Generate RULER's prompts with the model's tokenizer (no downloads), decode greedily with a KV cache,
    score as RULER does (0-100), for every checkpoint; mean and std over checkpoints per task and length;
    perplexity on held-out windows beside it. Writes eval.json, samples.jsonl, report.md and a PNG."""
    from anchor_core.outdir import guard_out, out_lock

    task_list, length_list, qa = _check_options(run=run, model=model, checkpoints=checkpoints, tasks=tasks,
                                                lengths=lengths, samples=samples, seed=seed, squad=squad,
                                                hotpotqa=hotpotqa, dtype=dtype, batch_size=batch_size,
                                                perplexity_windows=perplexity_windows)
    harness_list, lm_harness = _check_harness(harness, harness_tasks, harness_data)
    if haystack is not None:
        from anchor.eval.ruler.common import load_haystack

        load_haystack(haystack)  # read (and kept) before any work: a file that is no haystack is refused now
    from anchor.eval.generate import eval_model_source
    from anchor.eval.runner import checkpoints_of_run, parts_dir, run_eval, write_eval

    # every checkpoint verified against its manifest before any work (a --model folder as well)
    if run is not None:
        sources = checkpoints_of_run(run, _split(checkpoints, "--checkpoints") if checkpoints else None)
    else:
        eval_model_source(model)
        sources = [(str(model), str(model))]
    out = guard_out(out, "eval", inputs=tuple(str(p) for p in (run, model, haystack, squad, hotpotqa, harness_data)
                                              if p))
    with out_lock(out, "eval"):
        result = run_eval(sources, tasks=task_list, lengths=length_list, samples=samples, seed=seed, haystack=haystack,
                          qa_data={t: str(f) for t, f in qa.items() if f is not None}, engine=engine, dtype=dtype,
                          batch_size=batch_size, perplexity_windows=perplexity_windows, progress=progress,
                          parts=parts_dir(out))
        if lm_harness is not None:
            result["harness"] = lm_harness.run_harness(
                sources, tasks=harness_list, lengths=length_list, limit=samples, data_dir=harness_data,
                engine=engine, dtype=dtype, batch_size=batch_size, progress=progress)
        path = write_eval(result, out)
    from anchor.eval.runner import render_report

    typer.echo(render_report(result, None))
    typer.echo(f"wrote {path / 'eval.json'}, {path / 'samples.jsonl'}, {path / 'report.md'}")


def _check_options(*, run: Path | None, model: str | None, checkpoints: str | None, tasks: str, lengths: str,
                   samples: int, seed: int, squad: Path | None, hotpotqa: Path | None, dtype: str, batch_size: int,
                   perplexity_windows: int) -> tuple[list[str], list[int], dict[str, Path | None]]:
    """The evaluation's options checked before any work (one-line InputErrors): returns the tasks, the
    lengths and the QA files by task."""
    from anchor_core.errors import InputError
    from anchor_core.limits import check_int, check_seed

    if (run is None) == (model is None):
        raise InputError("give exactly one of --run (a training run) and --model")
    if checkpoints and run is None:
        raise InputError("--checkpoints selects checkpoints of --run")
    check_seed(seed)
    check_int(samples, "--samples", lo=1)
    check_int(batch_size, "--batch-size", lo=1)
    check_int(perplexity_windows, "--perplexity-windows", lo=0)
    from anchor.eval.runner import resolve_dtype

    resolve_dtype(dtype)  # checked (and auto's measurement made) before any work; run_eval records why
    length_list = []
    for x in _split(lengths, "--lengths"):
        if not x.isdigit():
            raise InputError(f"--lengths: {x!r} is not a positive integer")
        length_list.append(int(x))
    task_list = _split(tasks, "--tasks")
    from anchor.eval import ruler

    for t in task_list:
        ruler.task_config(t)
    qa = {"qa_1": squad, "qa_2": hotpotqa}
    for t, f in qa.items():
        if t in task_list and f is None:
            raise InputError(f"--tasks {t} needs its data file: --{'squad' if t == 'qa_1' else 'hotpotqa'} PATH "
                             f"({'SQuAD v2.0 dev JSON' if t == 'qa_1' else 'HotpotQA dev distractor JSON'})")
        if f is not None and not f.is_file():
            raise InputError("no such file", path=f)
    return task_list, length_list, qa


def _check_harness(harness: str | None, harness_tasks: str, harness_data: Path | None):
    """`--harness`, `--harness-tasks` and `--harness-data` checked (lm-eval importable when asked for):
    returns the harness tasks and the module `anchor.eval.harness`, or None without `--harness`."""
    from anchor_core.errors import InputError

    harness_list = _split(harness_tasks, "--harness-tasks")
    if harness is None and harness_data is not None:
        raise InputError("--harness-data is read by --harness lm-eval; give --harness lm-eval too")
    if harness is None:
        return harness_list, None
    from anchor.eval import harness as lm_harness

    if harness not in lm_harness.HARNESSES:
        raise InputError(f"--harness: unknown harness {harness!r} (supported: {', '.join(lm_harness.HARNESSES)})")
    lm_harness.check_tasks(harness_list, harness_data)
    lm_harness.require()
    return harness_list, lm_harness
