"""`anchor demo`: the paper's experiment end to end on the embedded default."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from anchor.cli import app


SUMMARY = "Run the paper's experiment end to end; writes index.html."
GPU_PROFILES = ("paper-gpu", "paper-gpu-short")  # refused where torch sees no CUDA device (a merge runs anywhere)


@app.command(short_help=SUMMARY)
def demo(
    out: Annotated[Path, typer.Option("--out", help="The demo folder: finished jobs are kept and reused by the "
                                                    "next run (see docs/verbs/index.md: what --out may replace).")] = Path("runs/demo"),
    model: Annotated[str, typer.Option("--model", help="HF folder, .gguf file, 'default' or random:<preset>.")] = "default",
    jobs: Annotated[Optional[str], typer.Option(
        "--jobs", help="Comma-separated jobs: top5,corpus,pack,audit,train,parity,eval,bench (the jobs they "
                       "need come along; default: the profile's, every job but for the paper-gpu ones)."),
    ] = None,
    old_steps: Annotated[Optional[str], typer.Option(
        "--steps", hidden=True, help="The name of --jobs in earlier releases (accepted, with a warning).")] = None,
    profile: Annotated[str, typer.Option(
        "--profile", help="Settings: demo (minutes on a CPU), paper-small (the paper's four variants, RULER "
                          "1K-4K over five checkpoints; hours on a CPU), paper-gpu (SmolLM2 at 16K in bf16, "
                          "the four variants and two fp32 runs, RULER 4K-16K; made for one GPU) or paper-gpu-short "
                          "(a quick check of a GPU machine before paper-gpu: its four bf16 runs, 100 steps each, "
                          "evaluated at their last checkpoint; under 10 minutes on one H100 by estimate).")] = "demo",
    fresh: Annotated[bool, typer.Option("--fresh", help="Redo every selected job instead of reusing it.")] = False,
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt for the next-token comparison.")] = "",
    policy: Annotated[str, typer.Option("--policy", help="Oracle dtype policy of top5: preset name or YAML file.")] = "fp32",
    seq_len: Annotated[Optional[int], typer.Option(
        "--seq-len", help="Window size of pack and train (default: the profile's).")] = None,
    train_steps: Annotated[Optional[int], typer.Option(
        "--train-steps", help="Optimizer steps per training run (default: the profile's).")] = None,
    heldout: Annotated[Optional[Path], typer.Option(
        "--heldout", help="Held-out documents for the held-out loss (a corpus file `anchor pack` reads; default: "
                          "this Python's test suites, which the embedded corpus leaves out).")] = None,
    runs: Annotated[Optional[str], typer.Option(
        "--runs", help="Comma-separated training runs of the profile (e.g. full,intra_doc or intra_doc@fp32): "
                       "train and evaluate only these, a part to join with --merge (default: every run).")] = None,
    merge: Annotated[Optional[list[Path]], typer.Option(
        "--merge", help="A demo folder that ran some of the runs (--runs); give it once per part: no job "
                        "runs, --out becomes one demo of all their runs (anchor/demo/merge.py); --out is a new "
                        "folder or an earlier merge, never a demo that ran its jobs.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
) -> None:
    """Run the paper's experiment on the embedded default (or --model): corpus, packing, audit, training with
    anchor and full attention, parity of the trained checkpoint, RULER averaged over checkpoints, speed; writes
    index.html and summary.png under --out. A second run reuses every job whose settings did not change."""
    jobs = _jobs_or_old_steps(jobs, old_steps)
    from anchor_core.extras import require
    for extra in ("train", "oracle", "eval"):  # every job's, before anything is read or written
        require(extra)
    from anchor.demo import DEFAULT_PROMPT, PROFILES, check_jobs, run_demo
    from anchor_core.data.pipeline import check_pack_size
    from anchor_core.errors import InputError
    from anchor_core.limits import check_int

    if profile not in PROFILES:
        raise InputError(f"--profile: unknown profile {profile!r} (profiles: {', '.join(PROFILES)})")
    if merge:
        # what a merge would ignore is refused (the parts ran with their own model and settings); --profile
        # names the profile the parts ran with (the summary JSON they carry)
        given = (("--runs", runs is not None), ("--jobs", jobs is not None), ("--model", model != "default"),
                 ("--train-steps", train_steps is not None), ("--seq-len", seq_len is not None),
                 ("--heldout", heldout is not None), ("--prompt", bool(prompt)), ("--policy", policy != "fp32"),
                 ("--fresh", fresh))
        _merge(merge, out, profile, [name for name, g in given if g])
        return
    job_list = check_jobs(PROFILES[profile].jobs if jobs is None else jobs,
                          "--jobs" if old_steps is None else "--steps")
    overrides = {"prompt": prompt or DEFAULT_PROMPT, "policy": policy}
    if seq_len is not None:
        check_int(seq_len, "--seq-len", lo=2, hi=1 << 31)
        check_pack_size(seq_len)
        overrides["seq_len"] = seq_len
    if train_steps is not None:
        check_int(train_steps, "--train-steps", lo=1, hi=1 << 31)
        overrides["train_steps"] = train_steps
    if policy.endswith((".yaml", ".yml")) and not Path(policy).is_file():
        raise InputError("no such policy file", path=policy)
    if runs is not None:
        from anchor.demo.settings import check_runs

        overrides["only_runs"] = check_runs(PROFILES[profile], runs)
    if heldout is not None:
        if not heldout.exists():
            raise InputError("no such held-out file", path=heldout)
        from anchor_core.data.packed import is_pack_output
        from anchor_core.data.readers import check_documents
        from anchor_core.data.store import is_store

        if not (is_store(heldout) or is_pack_output(heldout)):
            check_documents(heldout)  # read before the first job, not after training
        overrides["perplexity_data"] = str(heldout.resolve())
    _refuse_a_gpu_profile_without_cuda(profile)
    from anchor_core.outdir import guard_out
    pol_file = policy if policy.endswith((".yaml", ".yml")) else None
    out = guard_out(out, "demo", inputs=(model, pol_file, heldout), replace=False)  # before any work
    record = run_demo(model, out, jobs=job_list, settings=PROFILES[profile], fresh=fresh, progress=progress,
                      say=typer.echo, **overrides)
    typer.echo(f"demo finished in {record['seconds']:.0f} s (ran: {', '.join(record['ran']) or 'nothing'}; "
               f"reused: {', '.join(record['reused']) or 'nothing'}): open {out / 'index.html'}")
    par = record["jobs"].get("parity", {}).get("summary")
    if "parity" in record["ran"] + record["reused"] and par and not par["pass"]:
        typer.echo(f"parity: {par['cases'] - par['passed']} forward and {par['grad_cases'] - par['grad_passed']} "
                   "gradient case(s) failed", err=True)
        raise typer.Exit(1)


def _merge(parts: list[Path], out: Path, profile: str, ignored: list[str]) -> None:
    """`--merge PART ...`: one demo folder of finished parts; an option the merge would ignore is refused."""
    from anchor_core.errors import InputError

    if ignored[:1] in (["--runs"], ["--jobs"]):
        raise InputError("--merge joins finished parts: it takes no --runs or --jobs")
    if ignored:
        raise InputError(f"--merge joins finished parts, which ran with their own settings: it takes no {ignored[0]}")
    from anchor.demo.merge import merge_demos

    merge_demos(parts, out, profile=profile, say=typer.echo)
    typer.echo(f"open {out / 'index.html'}")


def _jobs_or_old_steps(jobs: str | None, old_steps: str | None) -> str | None:
    """`--jobs`, or `--steps` (its name in earlier releases, for one release more) with one warning line on stderr
    naming the new one; both given is a usage error."""
    if old_steps is None:
        return jobs
    from anchor_core.errors import InputError, warn_line

    if jobs is not None:
        raise InputError("--steps is the old name of --jobs: give --jobs alone")
    warn_line("--steps is now --jobs (the demo's jobs to run; --steps means optimizer steps elsewhere): give --jobs, "
              "--steps goes in a later release")
    return old_steps


def _refuse_a_gpu_profile_without_cuda(profile: str) -> None:
    """paper-gpu and paper-gpu-short train SmolLM2 on 16K windows in bf16, several runs of them: on a CPU that is
    days of work before anything would fail, so where torch sees no CUDA device they are refused in one line."""
    if profile in GPU_PROFILES:
        import torch

        if not torch.cuda.is_available():
            from anchor_core.errors import InputError

            raise InputError(f"--profile {profile} is made for one GPU (SmolLM2 at 16K in bf16) and torch sees no "
                             "CUDA device here; on a CPU: --profile demo or paper-small")
