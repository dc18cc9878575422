"""Continued pre-training on DeepSpeed (docs/DESIGN.md §8): the launch and the training loop.

    train(cfg, "runs/tiny")                   # prepare_run + parallel.nproc workers (or this process)

The components it drives: torchtrain.training.run_folder (the run folder, checked and prepared before any
process group starts), torchtrain.training.optim (AdamW groups, the learning rate schedule, the DeepSpeed
config), torchtrain.training.checkpoint (save, resume, RNG states), torchtrain.training.metrics (metrics.jsonl,
gradient diagnostics).

One optimizer step (every rank):
  1. the loader gives this data-parallel rank its `micro_batch x grad_accum` windows of the step
     (anchor_core.data.packed.Loader: the global batch of step k is the same set of windows whatever
     the split across processes and micro-steps);
  2. the number of counted targets of the whole global batch is summed across all ranks;
  3. per micro-batch: forward on this rank's slice of the sequence (Ulysses: all of it without
     SP; torchtrain.parallel.ulysses.shard), cross-entropy summed over the counted targets of the
     slice (torchtrain.parallel.ulysses.next_token_loss_shard), and backward of
     `sum * world / global_count` (DeepSpeed averages gradients over the world, so the update
     is the gradient of the mean over all counted targets: never a mean of per-rank means);
  4. DeepSpeed's step (clipping, AdamW, ZeRO), the learning rate schedule, metrics, checkpoint.

Resume: the newest checkpoint whose manifest verifies, and whose steps metrics.jsonl logs whole, restores model,
optimizer, scheduler, the loader's position and every rank's RNG states; metrics.jsonl is cut back to that step
(what it drops named on stderr), so it holds steps 1, 2, 3, ... with no gap (torchtrain.training.metrics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from anchor_core.data.packed import Loader, PackedData
from anchor_core.errors import InputError, RunFailed
from anchor_core.outdir import guard_out, missing_folders, out_lock, remove_created
from torchtrain.config import TrainConfig, check_world
from torchtrain.config.deepspeed_json import deepspeed_config
from torchtrain.model import float8
from torchtrain.model.build import build_model, set_rope
from torchtrain.model.loss import final_hidden_states
from torchtrain.model.tiling import tile_mlps
from torchtrain.parallel import ulysses as sp
from torchtrain.parallel.context import enable_context_parallel, take_slots, window_groups
from torchtrain.parallel.distributed import (ParallelGroups, Watchdog, World, check_same_config, init_world,
                                             launch_local, launched_externally,
                                             stop_for_lost_peer)
from torchtrain.parallel.sharded_build import build_partitioned
from torchtrain.training import checkpoint as ckpt
from torchtrain.training.data import data_dir
from torchtrain.training.fit import check_model, model_spec, resolved_engine
from torchtrain.training.heldout import HeldOut, heldout_loss, heldout_set
from torchtrain.training.metrics import Logged, dump_grads, grad_norm, read_log
from torchtrain.training.optim import allocate_state, build_optimizer, load_cpu_adam
from torchtrain.training.report import StepReport, rank_peaks
from torchtrain.training.resume import CONFIG_FILE, load_run_config
from torchtrain.training.run_folder import prepare_run
from torchtrain.training.phases import Phase, PhasedLoader, phase_at, run_phases
from torchtrain.training.throughput import batch_flops, device_peak

if TYPE_CHECKING:
    from anchor_core.data.batch import Batch
    from anchor_core.spec import ModelSpec


# ---------------------------------------------------------------------------------------------
# Launch


def train(cfg: TrainConfig, run: str | Path, *, progress: bool = True) -> int:
    """`anchor train`: prepare the run, then train in `parallel.nproc` local processes (or this one).
    Returns the last step trained."""
    run = Path(run).resolve()
    if cfg.parallel.offload_optimizer:  # built (or found) before any work: where it cannot be, one line
        load_cpu_adam()
    if launched_externally():  # torchrun / deepspeed launcher: every rank runs this
        return _train_external(cfg, run, progress)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    guard_out(run, "train", inputs=[cfg.data.path, cfg.model.name], replace=False)  # before the lock file beside it
    created = missing_folders(run)  # the run folder and the parents this first attempt makes
    unprepared = True
    try:
        with out_lock(run, "train"):  # a second trainer on the same --out exits 2 naming this one
            try:
                prepare_run(cfg, run, progress=progress)
                unprepared = False
                release_memory()  # the packing's and the weight check's leftovers, not held while the ranks train
            finally:
                if unprepared and created:  # failed before config.yaml: the run folder goes, under the lock
                    remove_created(created[:1])
            handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                if cfg.parallel.nproc == 1:
                    return worker(str(run), progress)
                launch_local(cfg.parallel.nproc, _launched_worker, str(run), progress)
            except SignalException as e:
                # The elastic agent took SIGINT/SIGTERM over and stopped the workers; hand the signal
                # to whoever handled it before (the CLI: "interrupted", exit 130/143).
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)
                signal.raise_signal(e.sigval)
                raise
            finally:
                ckpt.clear_staging(run)  # a checkpoint an interrupted run was writing
    finally:
        if unprepared and created:
            remove_created(created[1:])  # and the parents it made, once the lock file beside it is gone
    return _last_step(run)


def _train_external(cfg: TrainConfig, run: Path, progress: bool) -> int:
    """Under an outside launcher (torchrun, on one node or several): every rank checks that it was started with rank
    0's config (`check_same_config`), rank 0 prepares the run folder while the others wait, then every rank checks
    that it sees what rank 0 prepared (`check_shared_run`). A rank whose peers stopped or cannot be reached (a dead
    node) stops with one line naming the node, within a minute (torchtrain.parallel.distributed.Watchdog), or, where no
    watchdog runs, within `parallel.timeout_s`."""
    world = init_world(cfg.sequence_degree(), cfg.parallel.timeout_s, cp=cfg.parallel.context_parallel)
    watchdog, done = None, False
    try:
        check_same_config(cfg.to_dict(), world)  # before rank 0 prepares anything
        watchdog = Watchdog.start(world)
        error = None
        if world.is_main:
            try:
                prepare_run(cfg, run, world=world.size, progress=progress)
            except InputError as e:
                error = str(e)
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise InputError(box[0])
        check_shared_run(run, world)
        step = worker(str(run), progress)
        done = True
        return step
    except RuntimeError as e:  # torch.distributed's DistError is one
        if not peer_lost(e):
            raise
        stop_for_lost_peer(world, watchdog, e)
    except KeyboardInterrupt:  # a launcher that lost its rendezvous store with a dead node stops its ranks (SIGTERM)
        if watchdog is not None:
            watchdog.name_lost_node()  # ends the process where a node was lost
        done = True  # left on an interrupt, which this rank reports: its peers do not count its silence
        raise
    finally:
        if watchdog is not None:
            watchdog.close(done)


def peer_lost(e: BaseException) -> bool:
    """Whether `e` says a collective's peer is gone: torch.distributed's own errors, or gloo's and NCCL's words
    for a closed connection or a collective that timed out."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return any(w in text for w in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                   "Timed out", "timed out", "NCCL communicator was aborted"))


def check_shared_run(run: Path, world: World) -> None:
    """Every rank sees the run folder rank 0 prepared (a folder every node shares): rank 0 writes a token there,
    every rank reads it back; a rank that cannot (a node-local path) stops every rank with one line naming it."""
    import socket
    import uuid

    token = run / ".anchor-shared-check"
    box = [uuid.uuid4().hex if world.is_main else None]
    if world.is_main:
        token.write_text(box[0], encoding="utf-8")
    dist.broadcast_object_list(box, src=0)
    try:
        seen = token.read_text(encoding="utf-8") == box[0]
    except OSError:
        seen = False
    views: list[Any] = [None] * world.size
    dist.all_gather_object(views, (seen, socket.gethostname(), str(run)))
    dist.barrier()
    if world.is_main:
        token.unlink(missing_ok=True)
    blind = [(r, host, path) for r, (ok, host, path) in enumerate(views) if not ok]
    if blind:
        r, host, path = blind[0]
        more = f" (and {len(blind) - 1} more rank{'s' if len(blind) > 2 else ''})" if len(blind) > 1 else ""
        raise InputError(f"rank {r} on {host} does not see the run folder rank 0 prepared on {views[0][1]}{more}: "
                         f"--out must name one folder every node shares (a shared filesystem; a node-local path such "
                         f"as /tmp is not)", path=path)


def _launched_worker(run_str: str, progress: bool = True) -> int:
    """`worker` in a process of `launch_local`: a failure's traceback reaches the launcher (torch's
    `record` writes it to the elastic error file). Wrapped here, under its own name, so the spawned
    process can unpickle it."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(worker)(run_str, progress)


def _last_step(run: Path) -> int:
    steps = ckpt.list_steps(run)
    return steps[0] if steps else 0


# ---------------------------------------------------------------------------------------------
# The worker: one rank's loop


def worker(run_str: str, progress: bool = True) -> int:
    """Train one rank of the run in `run_str` (prepared by prepare_run). Returns the last step."""
    run = Path(run_str)
    cfg = load_run_config(run)
    world = _start_rank(cfg)
    phases = run_phases(cfg)  # one, without schedule.phases
    specs = [check_model(p.cfg, model_spec(p.cfg), p.seq_len, memory=False) for p in phases]  # memory: prepare_run
    logged, upto = _read_logged(run, world)
    universal = ckpt.universal_step(run, upto, world.size, cfg.parallel.zero_stage) is not None
    release_memory()  # what preparing the run left (prepare_run, in this process with one): not under the step
    engine, scheduler, built = _build_engine(cfg, specs[0], world, universal=universal)
    engine_built = rank_peaks(world)  # and with DeepSpeed's engine beside it, before any step
    if world.is_main:
        ranks = f" (ranks 0-{len(built) - 1})" if len(built) > 1 else ""
        print(f"model built: host memory peak {_gib_list(built)} GiB{ranks}; engine built: "
              f"{_gib_list(engine_built)} GiB", file=sys.stderr, flush=True)
    loader = PhasedLoader(phases, lambda phase: _open_loader(cfg, run, phase, world))
    checkpointer = ckpt.Checkpointer(run, cfg, specs[0], engine, world, loader, config_file=CONFIG_FILE,
                                     max_shard_size=cfg.checkpoint.max_shard_size,
                                     export_dtype=cfg.checkpoint.export_dtype)
    start, elapsed0 = checkpointer.resume(upto=upto)  # no later than the log: it never has a gap
    if start and loader.done != start:
        raise InputError(f"the checkpoint of step {start} holds the loader of step {loader.done}",
                         path=ckpt.step_dir(run, start))

    peak = device_peak(world.device, torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32)
    if world.is_main:
        print(f"mfu: model FLOPs per second over {world.size} x the peak of one process's device, {peak.source}",
              file=sys.stderr, flush=True)
    report = StepReport(cfg, run, world, start=start, elapsed0=elapsed0, logged=logged, peak=peak, built=built,
                        engine_built=engine_built, progress=progress)
    step, phase, held = start, None, None
    try:
        for step in range(start + 1, cfg.schedule.steps + 1):
            if phase is not (phase := phase_at(phases, step)):  # its RoPE after DeepSpeed's initialize and the load
                held, checkpointer = _enter_phase(phases, phase, specs[phase.index - 1], engine, checkpointer, step)
            t0, lr = time.perf_counter(), scheduler.get_last_lr()[0]
            batch = next(loader)
            share = batch_flops(checkpointer.spec, batch.doc_ids, cfg.model.variant) / world.sp  # an SP group's
            loss, count, norm, flops = _train_step(cfg, world, engine, batch, step, run, share)
            check_step(run, step, loss, norm)  # the same on every rank (reduced): all stop before any log or checkpoint
            seconds = time.perf_counter() - t0
            evaluate = held is not None and step % cfg.eval.every == 0
            extra = heldout_loss(phase.cfg, world, engine, held) if evaluate else {}
            row = report.step(step, phase, loss=loss, tokens=count, lr=lr, grad_norm=norm, flops=flops,
                              seconds=seconds, extra=extra)
            if cfg.is_checkpoint_step(step):
                checkpointer.save(step, row["elapsed_s"])
    finally:
        report.close(finished=step == cfg.schedule.steps)
    return step


def check_step(run: Path, step: int, loss: float, norm: float | None) -> None:
    """A loss or a gradient norm that is not a finite number stops the run (RunFailed: one line, exit 1) before the
    step is logged or checkpointed: the update it made (a checkpoint of the step holds the weights after it) put NaN
    or infinite values in the weights, and every later step would train on them. The newest checkpoint stays the
    one to resume from."""
    what = ("training loss", loss) if not math.isfinite(loss) else \
        ("gradient norm", norm) if norm is not None and not math.isfinite(norm) else None
    if what is None:
        return
    kept = ckpt.list_steps(run)
    last = f"its newest checkpoint, step-{kept[0]}, is kept" if kept else "no checkpoint was written"
    raise RunFailed(f"step {step}: the {what[0]} is {what[1]}, not a finite number; the run stops before logging or "
                    f"checkpointing this step ({last})")


def _open_loader(cfg: TrainConfig, run: Path, phase: Phase, world: World) -> Loader:
    """This rank's Loader of a phase's windows (RUN/data, or the phase's RUN/data-<seq_len>), at its first window,
    its held-out windows left out."""
    return Loader(PackedData.open(data_dir(cfg, run, phase.seq_len)), variant=cfg.model.variant,
                  batch_size=cfg.data.micro_batch * cfg.grad_accum(world.size), seed=cfg.data.seed,
                  rank=world.dp_rank, world_size=world.dp, mask_cross_doc_loss=cfg.model.mask_cross_doc_loss,
                  held_out=0 if cfg.eval.heldout_data else cfg.eval.heldout_windows)


def _enter_phase(phases: list[Phase], phase: Phase, spec: ModelSpec, engine: Any,
                 checkpointer: ckpt.Checkpointer, step: int) -> tuple[HeldOut | None, ckpt.Checkpointer]:
    """Before the first step of `phase` this process trains (its first, or the first after a resume): the model's
    RoPE set to the phase's (torchtrain.training.phases), its held-out windows, and the checkpointer's spec (hf/'s config:
    the phase's RoPE and length). Returns the held-out set and the checkpointer."""
    _restore_rope_buffers(engine.module, set_rope(engine.module, spec))
    if checkpointer.world.is_main and checkpointer.cfg.schedule.phases:
        print(f"{phase.describe(len(phases), spec.rope.base)}{' (resumed)' if step > phase.first else ''}", file=sys.stderr,
              flush=True)
    held = heldout_set(phase.cfg, PackedData.open(data_dir(checkpointer.cfg, checkpointer.run, phase.seq_len)))
    return held, dataclasses.replace(checkpointer, spec=spec)


def _gib_list(values: list[float | None]) -> str:
    return ", ".join("?" if v is None else f"{v:.2f}" for v in values)


def _read_logged(run: Path, world: World) -> tuple[Logged | None, int]:
    """metrics.jsonl as rank 0 reads it (`read_log`: prepare_run refused an unreadable one; None on the other
    ranks, which write no log) and the last step it logs whole, the same on every rank: every rank must resume
    from the same checkpoint."""
    logged, box = None, [None]
    if world.is_main:
        try:
            logged = read_log(run)
            box[0] = logged.last
        except InputError as e:  # changed since prepare_run read it: every rank stops with the same line
            box[0] = str(e)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise InputError(box[0])
    return logged, int(box[0])


def _start_rank(cfg: TrainConfig) -> World:
    """Join the run's processes (checked against the config), then seed this rank's RNGs with `seed + rank`."""
    world = init_world(cfg.sequence_degree(), cfg.parallel.timeout_s, cp=cfg.parallel.context_parallel)
    check_world(cfg, world.size)
    if world.device.type == "cpu":
        return_freed_memory()
    ckpt.seed_rng(cfg.data.seed + world.rank)
    return world


def release_memory() -> None:
    """Hand back what this process holds but no longer uses: the objects only reference cycles keep alive, collected
    now rather than whenever the collector next runs (a library's exception caught with its traceback holds every
    frame of the call it was raised in, and whatever those frames hold: matplotlib's mathtext parser, drawing the
    packing's figure in this process, so held the model's GGUF memory map through prepare_run's frame), then the
    heap's free pages returned to the system (glibc's malloc_trim; a no-op elsewhere). Called before the model is
    built, once it is, and once the engine is: a step's peak sits on what is resident when it starts, and the plan
    counts a process at its idle size (torchtrain.training.memory.BASE_PROCESS_BYTES). SmolLM2-135M at T=2048 with its corpus
    packed by the same command: 2.37 GiB resident at the first step without this and with the packing in this
    process. On a GPU torch's CUDA cache is emptied too, so that a later run's memory check (mem_get_info) does not
    count the blocks an earlier run in this process left cached (the demo's runs, one after another)."""
    import ctypes
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def return_freed_memory() -> None:
    """glibc: serve allocations of 1 MiB and more with mmap, so that what the step frees goes back to
    the OS. glibc's default raises that threshold (up to 32 MiB) after the first large free, and a
    CPU step's many mid-size temporaries then pile up in a fragmented heap: tiny.yaml at T=32768
    (micro_batch 2, 3 steps) peaked at 3.16 GB RSS by default, 1.77 GB with this, same losses and
    step times. No-op where the C library is not glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _build_engine(cfg: TrainConfig, spec: ModelSpec, world: World,
                  universal: bool = False) -> tuple[Any, Any, list[float | None]]:
    """The model (the same seed on every rank; Ulysses over the SP group; activation checkpointing as
    configured) under DeepSpeed with AdamW and the schedule: (engine, scheduler, and every rank's host memory
    peak once the model was built, before the engine: `rank_peaks`). Its RoPE buffers, which DeepSpeed's bf16 mode
    casts, are set in float32 before each phase's first step (`_enter_phase`), after the checkpoint's load.
    `universal`: the run resumes from a checkpoint in DeepSpeed's universal format (another process count:
    torchtrain.training.universal)."""
    import deepspeed

    groups = ParallelGroups(world)
    ds_config = deepspeed_config(cfg, world.size)
    if universal:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    dtype = "bfloat16" if cfg.model.dtype == "bfloat16" else "float32"
    if cfg.parallel.zero_stage == 3:  # partitioned as it is built: no rank holds the whole model
        model = build_partitioned(cfg.model.name, engine=resolved_engine(cfg), dtype=dtype, rope=spec.rope,
                                  seed=cfg.data.seed, ds_config=ds_config, group=groups.get_data_parallel_group())
    else:  # float32, which DeepSpeed casts to the run's dtype
        model = build_model(cfg.model.name, engine=resolved_engine(cfg), dtype="float32", rope=spec.rope,
                            seed=cfg.data.seed)
    model.anchor_spec = spec
    release_memory()  # the weights as read (a GGUF's dequantised arrays), freed, not left in the heap
    built = rank_peaks(world)  # the model built (at ZeRO-3 partitioned and filled), before DeepSpeed's engine
    if world.sp > 1:  # Ulysses and context parallelism over the window's ranks (a degree of one: off)
        ulysses, context = window_groups(world)
        sp.enable_sequence_parallel(model, ulysses)
        enable_context_parallel(model, context)
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.model.tiled_mlp:
        tile_mlps(model)
    if cfg.model.float8 is not None:  # torchao's Float8Linear in the decoder layers, before DeepSpeed wraps them
        float8.convert(model, cfg.model.float8, emulate=cfg.model.float8_emulation)
    if cfg.parallel.zero_stage < 3:
        model.to(world.device)
    optimizer, scheduler = build_optimizer(model, cfg)
    if cfg.parallel.zero_stage == 0:  # the first step's peak is every step's (allocate_state)
        allocate_state(optimizer)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds_config, mpu=groups)
    release_memory()  # the build's freed buffers (the moments' allocation, DeepSpeed's setup) not under the step
    return engine, scheduler, built


def _restore_rope_buffers(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """DeepSpeed's bf16 mode casts every buffer to bf16; RoPE frequencies must stay fp32."""
    buffers = dict(model.named_buffers())
    for name, value in saved.items():
        buffers[name].data = value.to(buffers[name].device, copy=True)
    if any(b.dtype != torch.float32 for n, b in model.named_buffers() if n.endswith("inv_freq")):
        raise AssertionError("RoPE inv_freq buffers must stay float32")


def _train_step(cfg: TrainConfig, world: World, engine: Any, batch: Batch, step: int,
                run: Path, flops: float = 0.0) -> tuple[float, int, float | None, float]:
    """Optimizer step `step` on this rank's windows of the global batch (module docstring, 2-4).
    Returns the mean loss over the global batch's counted targets, their number, the gradient norm, and the
    sum over the ranks of `flops` (this rank's share of the step's model FLOPs: torchtrain.training.throughput)."""
    gas = cfg.grad_accum(world.size)
    tokens = torch.as_tensor(batch.tokens, dtype=torch.long)
    mask = torch.as_tensor(batch.loss_mask)
    local_count = take_slots(sp.counted_predictions(mask), world.slots(mask.shape[1])).sum(dtype=torch.float32)
    count = _all_reduce_sum(local_count, world.device)  # counted targets of the global batch
    total = torch.tensor([0.0, flops], dtype=torch.float64)  # the loss summed, the FLOPs: one reduction
    scale = loss_multiplier(local_count, count, world.size)
    norm = None
    for m in range(gas):
        rows = slice(m * cfg.data.micro_batch, (m + 1) * cfg.data.micro_batch)
        local = _micro_batch_loss(cfg, world, engine, batch, tokens, mask, rows)
        engine.backward(local * scale.to(world.device), scale_wrt_gas=False)
        total[0] += local.detach().double().cpu()
        if m == gas - 1:
            if cfg.parallel.zero_stage == 0 and cfg.model.dtype == "float32":
                norm = grad_norm(engine)
            if step in cfg.logging.dump_grads:
                dump_grads(engine, world, run, step)
        engine.step()
    total = _all_reduce_sum(total, world.device)
    if norm is None:
        reported = engine.get_global_grad_norm()
        norm = None if reported is None else float(reported)
    return float(total[0] / count.double().clamp_min(1.0)), int(count), norm, float(total[1])


def _micro_batch_loss(cfg: TrainConfig, world: World, engine: Any, batch: Batch, tokens: torch.Tensor,
                      mask: torch.Tensor, rows: slice, *, fused: bool = True) -> torch.Tensor:
    """The cross-entropy summed over the counted targets of this rank's slice of the windows `rows`
    (`next_token_loss_shard`: the targets are the whole windows' tokens shifted by one, then sharded).
    `fused=False` (tests only: the reference the fused loss is held to) computes it from the whole logits."""
    slots = world.slots(tokens.shape[1])
    inputs = sp.rank_inputs(batch, tokens, rows, world.sp_rank, world.sp, world.device, cfg.model.variant, slots)
    # The lm-head fused with the loss: no [B, T, V] logits (or their gradient), at every ZeRO stage (under
    # ZeRO-3 the fused loss runs as the lm-head's own call, where the weight is gathered: lm_head_cross_entropy).
    # Offloaded checkpoints: every tensor the forward saves for the backward (under activation checkpointing the
    # layer inputs, and the fused loss's hidden states) waits in pinned host memory; the arithmetic is unchanged.
    saved = (torch.autograd.graph.save_on_cpu(pin_memory=True) if cfg.model.offload_checkpoints
             else contextlib.nullcontext())
    with saved:
        if fused:
            states, head = final_hidden_states(engine, engine.module, **inputs), engine.module.get_output_embeddings()
        else:
            states, head = engine(**inputs).logits, None
        local, _ = sp.next_token_loss_shard(states, tokens[rows], mask[rows], world.sp_rank, world.sp, lm_head=head,
                                            slots=slots)
    return local


def loss_multiplier(local_count: torch.Tensor, global_count: torch.Tensor, world: int) -> torch.Tensor:
    """What each rank's sum of cross-entropies is multiplied by before its backward: DeepSpeed
    averages gradients over all `world` ranks, so `world / global_count` makes the update the
    gradient of the mean over every counted target of the global batch (never `1 / local_count`,
    the mean of per-rank means, which weighs a rank's targets by how few it has)."""
    return world / global_count.clamp_min(1.0)


def _all_reduce_sum(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The sum of a host tensor over all ranks, back on the host (NCCL reduces device tensors only)."""
    y = x.to(device, copy=True)
    dist.all_reduce(y)
    return y.cpu()
