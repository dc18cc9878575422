"""`anchor plan`: the longest window a run config trains on a device, predicted term by term before any work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from anchor.cli import app

if TYPE_CHECKING:
    from anchor_core.spec import ModelSpec
    from torchtrain.config import TrainConfig
    from torchtrain.training.memory import PlanRow


SUMMARY = "The longest window a run config fits on a device, term by term."
MAX_GIB = 1e6  # --memory and --host-memory: a million GiB is beyond any machine


@app.command(short_help=SUMMARY)
def plan(
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="YAML run config, or a shipped one by name (tiny, smollm2_2k, paper/<name>); key=value "
                         "arguments override it, as for anchor train.")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(
        help="section.key=value overrides (model.activation_checkpointing=true, model.tiled_mlp=true, "
             "parallel.zero_stage=3, parallel.sequence_parallel=8).", show_default=False)] = None,
    device: Annotated[str, typer.Option(
        "--device", help="here (this machine's available memory: the CUDA device where torch sees one, else "
                         "the host's), or a GPU by name: a100-40gb, a100-80gb, h100, h200, b200.")] = "here",
    shape: Annotated[Optional[str], typer.Option(
        "--shape", help="Plan this shape instead of model.name, without its weights (anchor_core.hardware)."
    )] = None,
    memory: Annotated[Optional[float], typer.Option(
        "--memory", help="Plan for this many GiB per device instead of what --device has (another machine, or "
                         "this one as it is when nothing else runs); at most 1000000.", show_default=False)] = None,
    host_memory: Annotated[Optional[float], typer.Option(
        "--host-memory", help="With model.offload_checkpoints on a GPU: the host's GiB the processes' offloaded "
                              "checkpoints share (default: this machine's available memory where it has the GPU; "
                              "for a named --device, unchecked); at most 1000000.", show_default=False)] = None,
    start: Annotated[int, typer.Option("--start", help="The first window length; each next one doubles it, up to "
                                                       "16777216 (2^24) slots, where the plan stops.")] = 8192,
    window: Annotated[Optional[int], typer.Option(
        "--window", help="Instead of doubling windows: the smallest split of a window of this many slots over "
                         "ranks (parallel.sequence_parallel x parallel.context_parallel) that fits the device, "
                         "and why each smaller one does not.", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Predict one training step's peak memory (torchtrain.training.memory.step_memory, the model `anchor train` refuses
    a run by) term by term, for window lengths doubling from --start, and name the longest that fits the device
    and the term that stops the next; the plan stops at 2^24 slots. On the CPU the config's local processes share
    the host's memory; on a GPU each process has its own device. A config `anchor train` refuses on that device
    (bf16 at ZeRO-0, an engine it lacks, checkpoints offloaded from a CPU) is refused in the same words."""
    import torch

    from anchor_core.hardware import SHAPES
    from anchor_core.weights import load_spec
    from torchtrain.config import check_world, load_train_config
    from torchtrain.parallel.context import check_context_parallel
    from torchtrain.parallel.ulysses import check_sequence_parallel
    from torchtrain.training.memory import PLAN_STOP, check_device, plan_windows, step_of

    _check_options(start, memory, host_memory, shape, device, window)
    cfg = load_train_config(config, overrides or [])
    check_world(cfg, cfg.parallel.nproc)
    spec = SHAPES[shape].spec if shape else load_spec(cfg.model.name)
    cp = cfg.parallel.context_parallel
    if window is None:  # every doubling of start then divides too
        check_sequence_parallel(spec, start // check_context_parallel(start, cp), cfg.parallel.sequence_parallel)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    on_gpu = device != "here" or torch.cuda.is_available()
    # what anchor train refuses on this device (dtype, engine, offloading), refused by the same check
    engine = check_device(cfg, "cuda" if on_gpu else "cpu", here=device == "here")
    budget, device_name = _budget(memory, device)
    procs = 1 if on_gpu else cfg.parallel.nproc
    p = cfg.parallel  # offloading on a GPU: on the CPU the host's memory is the one planned for (step_of)
    offload = on_gpu and (cfg.model.offload_checkpoints or p.offload_optimizer or p.offload_params)
    host_budget = _host_budget(host_memory, offload, device)
    step = step_of(cfg, engine=engine, dtype=dtype, procs=procs, world=cfg.parallel.nproc, on_gpu=on_gpu)
    if window is not None:
        return _echo_split(cfg, spec, window, budget, device_name, step, as_json, shape or cfg.model.name)
    rows = plan_windows(spec, budget=budget, start=start, host_budget=host_budget, host_procs=cfg.parallel.nproc,
                        **step)
    phases = _plan_phases(cfg, spec, budget=budget, host_budget=host_budget, **step)
    fitting = [r for r in rows if r.fits]
    longest = fitting[-1].seq_len if fitting else None
    stopped = rows[-1] if not rows[-1].fits else None
    capped = stopped is None and rows[-1].seq_len * 2 > PLAN_STOP  # every window fits up to the plan's limit
    model = shape or cfg.model.name
    if as_json:
        return _echo_json(cfg, rows, phases, model=model, device=device, budget=budget, engine=engine, procs=procs,
                          longest=longest, host_budget=host_budget, capped=capped)
    g = 2**30
    typer.echo(f"{model}: {cfg.model.variant}, {engine}, {cfg.model.dtype}, activation checkpointing "
               f"{'on' if cfg.model.activation_checkpointing else 'off'}, tiled MLP "
               f"{'on' if cfg.model.tiled_mlp else 'off'}, ZeRO-{cfg.parallel.zero_stage}, sequence parallel "
               f"{cfg.parallel.sequence_parallel}{f', context parallel {cp}' if cp > 1 else ''}, "
               f"{cfg.parallel.nproc} process(es), {procs} per device, micro-batch "
               f"{cfg.data.micro_batch}")
    typer.echo(f"device: {device_name}, {budget / g:.1f} GiB")
    typer.echo(f"GiB per process, term by term; total: the device's, all {procs} process(es) on it"
               + (f"; host: what all {cfg.parallel.nproc} process(es) offload" if offload else ""))
    _echo_table(rows, offload)
    if offload:
        against = (f"against {host_budget / g:.1f} GiB of host memory" if host_budget is not None
                   else "not checked: give --host-memory GIB")
        typer.echo(f"host: what {cfg.parallel.nproc} process(es) offload, {against}")
    elif host_memory is not None:
        typer.echo("host: nothing offloaded (model.offload_checkpoints, parallel.offload_optimizer or "
                   "parallel.offload_params on a GPU), --host-memory not used")
    if longest is not None:
        typer.echo(f"longest window that fits: {longest} ({fitting[-1].need.total / g:.1f} of {budget / g:.1f} GiB)")
    else:
        typer.echo(f"no window from {start} fits")
    if stopped is not None:
        typer.echo(_why_not(stopped, budget, host_budget, cfg.parallel.nproc))
    elif capped:
        typer.echo(f"the plan stops at {PLAN_STOP} (2^24) slots: longer windows are not planned")
    _echo_phases(phases, budget)


def _echo_json(cfg: TrainConfig, rows: list, phases: list, *, model: str, device: str, budget: int, engine: str,
               procs: int, longest: int | None, host_budget: int | None, capped: bool) -> None:
    """The plan as JSON (`--json`)."""
    from torchtrain.training.memory import PLAN_STOP

    cp = cfg.parallel.context_parallel
    typer.echo(json.dumps({
        "model": model, "device": device, "budget_bytes": budget, "dtype": cfg.model.dtype, "engine": engine,
        "activation_checkpointing": cfg.model.activation_checkpointing, "tiled_mlp": cfg.model.tiled_mlp,
        "zero_stage": cfg.parallel.zero_stage, "sequence_parallel": cfg.parallel.sequence_parallel,
        "context_parallel": cp,
        "procs": procs, "world": cfg.parallel.nproc, "micro_batch": cfg.data.micro_batch, "longest": longest,
        "offload_checkpoints": cfg.model.offload_checkpoints, "offload_optimizer": cfg.parallel.offload_optimizer,
        "offload_params": cfg.parallel.offload_params, "host_budget_bytes": host_budget, "stop": PLAN_STOP,
        "capped": capped,
        "rows": [{"seq_len": r.seq_len, "fits": r.fits, "total_bytes": r.need.total, "procs": r.need.procs,
                  "terms_bytes": r.need.terms(), "host_bytes": r.need.host, "host_total_bytes": r.host_total,
                  "host_fits": r.host_fits} for r in rows], **_phases_json(phases)}, indent=1))


def _echo_split(cfg: TrainConfig, spec: ModelSpec, window: int, budget: int, device_name: str,
                step: dict, as_json: bool, model: str) -> None:
    """`--window`: the smallest split of one window that fits (torchtrain.training.window_split), by number of ranks:
    each one's best split that runs, then why the other splits over a number of ranks that divides the window
    cannot run."""
    from torchtrain.training.window_split import propose_split

    step = {k: v for k, v in step.items() if k not in ("sequence_parallel", "context_parallel")}
    plan = propose_split(spec, window, budget=budget, **step)
    best = plan.proposal
    if as_json:
        typer.echo(json.dumps({
            "model": model, "window": window, "budget_bytes": budget, "engine": step["engine"],
            "zero_stage": cfg.parallel.zero_stage, "dtype": cfg.model.dtype,
            "proposal": None if best is None else {"sequence_parallel": best.ulysses, "context_parallel": best.context,
                                                   "ranks": best.ranks, "total_bytes": best.need.total},
            "splits": [{"ranks": d, "sequence_parallel": x.ulysses, "context_parallel": x.context,
                        "refused": x.refused or None, "fits": x.fits,
                        "total_bytes": None if x.need is None else x.need.total}
                       for d, xs in plan.by_ranks.items() for x in xs]}, indent=1))
        return
    g = 2**30
    typer.echo(f"{model}: a window of {window} slots, {cfg.model.variant}, {step['engine']}, {cfg.model.dtype}, "
               f"ZeRO-{cfg.parallel.zero_stage}; device: {device_name}, {budget / g:.1f} GiB")
    typer.echo(f"  {'ranks':>5}  {'split':<34}  {'GiB per process':>15}  fits")
    refused = []
    for d, splits in plan.by_ranks.items():
        runs = [x for x in splits if not x.refused]
        refused += [x for x in splits if x.refused and window % d == 0]  # not the many that do not divide it
        if not runs:
            continue
        x = next((r for r in runs if r.fits), min(runs, key=lambda r: r.need.total))
        name = f"sequence_parallel {x.ulysses} x context_parallel {x.context}"
        typer.echo(f"  {d:>5}  {name:<34}  {x.need.total / g:>15.2f}  {'yes' if x.fits else 'no'}")
    for x in refused[:12]:
        typer.echo(f"  refused: sequence_parallel {x.ulysses} x context_parallel {x.context}: {x.refused}")
    if len(refused) > 12:
        typer.echo(f"  refused: {len(refused) - 12} more splits")
    if best is None:
        typer.echo(f"no split over up to {max(plan.by_ranks)} ranks fits")
    else:
        typer.echo(f"proposed: parallel.sequence_parallel={best.ulysses} parallel.context_parallel={best.context} "
                   f"({best.ranks} rank(s) a window; {best.need.total / g:.1f} of {budget / g:.1f} GiB)")


def _plan_phases(cfg: TrainConfig, spec: ModelSpec, *, budget: int, host_budget: int | None,
                 **step: object) -> list[tuple[int, PlanRow]]:
    """(phase, its plan row) for each phase of `schedule.phases` (none without): one step's memory at the phase's
    length, each length checked against sequence parallelism as `anchor train` checks it, a failure naming the
    phase as `anchor train` names it."""
    from torchtrain.training.memory import plan_row
    from torchtrain.parallel.ulysses import check_sequence_parallel
    from torchtrain.training.phases import named_phase, run_phases

    out = []
    for phase in run_phases(cfg) if cfg.schedule.phases else []:
        with named_phase(phase, cfg):
            check_sequence_parallel(spec, phase.seq_len, cfg.parallel.sequence_parallel)
        out.append((phase.index, plan_row(spec, phase.seq_len, budget=budget, host_budget=host_budget,
                                          host_procs=cfg.parallel.nproc, **step)))
    return out


def _largest(phases: list[tuple[int, PlanRow]]) -> int | None:
    """The phase whose step needs the most memory (the first of equals); None without phases."""
    return max(phases, key=lambda s: (s[1].need.total, -s[0]))[0] if phases else None


def _phases_json(phases: list[tuple[int, PlanRow]]) -> dict[str, object]:
    return {"phases": [{"phase": i, "seq_len": r.seq_len, "fits": r.fits, "total_bytes": r.need.total,
                        "host_total_bytes": r.host_total} for i, r in phases], "largest_phase": _largest(phases)}


def _echo_phases(phases: list[tuple[int, PlanRow]], budget: int) -> None:
    from torchtrain.training.memory import largest_term

    if not phases:
        return
    g = 2**30
    typer.echo("schedule.phases, one step of each:")
    for i, r in phases:
        typer.echo(f"  phase {i}: {r.seq_len} slots, {r.need.total / g:.2f} GiB, "
                   f"{'fits' if r.fits else 'does not fit'}")
    i, r = next(s for s in phases if s[0] == _largest(phases))
    typer.echo(f"phase {i} needs the most memory: {r.need.total / g:.2f} of {budget / g:.1f} GiB"
               + ("" if r.fits else f"; it does not fit ({largest_term(r.need)[0]} the largest term)"))


def _check_options(start: int, memory: float | None, host_memory: float | None, shape: str | None,
                   device: str, window: int | None = None) -> None:
    """The options' values in their ranges and among the known shapes and devices, before any work."""
    from anchor_core.errors import InputError
    from anchor_core.hardware import GPUS, SHAPES
    from anchor_core.limits import check_float, check_int, excerpt
    from torchtrain.training.memory import PLAN_STOP

    check_int(start, "--start", lo=1, hi=PLAN_STOP)
    if window is not None:
        check_int(window, "--window", lo=1, hi=PLAN_STOP)
    if memory is not None:
        check_float(memory, "--memory", lo=0.001, hi=MAX_GIB)
    if host_memory is not None:
        check_float(host_memory, "--host-memory", lo=0.001, hi=MAX_GIB)
    if shape is not None and shape not in SHAPES:
        raise InputError(f"--shape: unknown shape {excerpt(shape)} (known: {', '.join(SHAPES)})")
    if device != "here" and device not in GPUS:
        raise InputError(f"--device: unknown device {excerpt(device)} (here, or one of {', '.join(GPUS)})")


def _budget(memory: float | None, device: str) -> tuple[int, str]:
    """The bytes a process may use on the device planned for, and how the plan names where they come from."""
    import torch

    from anchor_core.errors import InputError
    from torchtrain.attention import engines
    from anchor_core.hardware import GPUS

    if memory is not None:
        return int(memory * 2**30), f"{memory:g} GiB given (--memory)"
    if device != "here":
        return GPUS[device].memory_bytes, device
    where = "cuda" if torch.cuda.is_available() else "cpu"
    budget = engines.available_memory(where)
    if budget is None:
        raise InputError("--device here: this machine's available memory cannot be read; name a --device")
    return budget, f"this machine's {'GPU' if where == 'cuda' else 'memory'}"


def _echo_table(rows: list, offload: bool) -> None:
    """The plan's rows: GiB per process by term, the total of the processes on the device, every process's
    offloaded checkpoints on the host where they are offloaded."""
    g = 2**30
    # the union of every row's terms in the order they first appear: the peak moves between terms with the
    # window (the optimizer step at short windows, the activations at long ones), and with it the parts it names
    names = list(dict.fromkeys(n for r in rows for n in r.need.terms()))
    host_head = f"  {'host':>8}" if offload else ""
    typer.echo("  " + f"{'window':>9}  " + "  ".join(f"{n:>11}" for n in names) + f"  {'total':>8}{host_head}  fits")
    for r in rows:
        terms = r.need.terms()
        host_cell = f"  {r.host_total / g:>8.2f}" if offload else ""
        typer.echo("  " + f"{r.seq_len:>9}  " + "  ".join(f"{terms[n] / g:>11.2f}" if n in terms else f"{'-':>11}"
                                                          for n in names)
                   + f"  {r.need.total / g:>8.2f}{host_cell}  {'yes' if r.fits else 'no'}")


def _why_not(stopped, budget: int, host_budget: int | None, nproc: int) -> str:
    """Why the first window that does not fit does not: the host's memory where only it is short, else the
    device's, with the term that weighs most."""
    from torchtrain.training.memory import largest_term

    g = 2**30
    if stopped.host_fits is False and stopped.need.total <= budget:
        return (f"{stopped.seq_len} does not fit: what it offloads needs {stopped.host_total / g:.1f} GiB "
                f"of host memory ({nproc} process(es)), {host_budget / g:.1f} GiB there")
    name, size = largest_term(stopped.need)
    return (f"{stopped.seq_len} does not fit: {stopped.need.total / g:.1f} GiB, {name} the largest term "
            f"({size / g:.1f} GiB per process)")


def _host_budget(host_memory: float | None, offload: bool, device: str) -> int | None:
    """The host memory what every process offloads shares: `--host-memory`, else this machine's
    available memory where the plan is for the GPU it is on; None where nothing is offloaded or it is unknown."""
    from torchtrain.attention import engines

    if host_memory is not None:
        return int(host_memory * 2**30) if offload else None
    return engines.available_memory("cpu") if offload and device == "here" else None
