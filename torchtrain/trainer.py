"""Continued pre-training on DeepSpeed (CONTRACT §8): the run folder, the loop, resume.

    plan = prepare_run(cfg, "runs/tiny")      # checks everything, packs data, writes config.yaml
    train(cfg, "runs/tiny")                   # prepare_run + nproc workers (or this process)

One optimizer step (every rank):
  1. the loader gives this data-parallel rank its `micro_batch x grad_accum` windows of the step
     (anchor.data.packed.Loader: the global batch of step k is the same set of windows whatever
     the split across processes and micro-steps);
  2. the number of counted targets of the whole global batch is summed across all ranks;
  3. per micro-batch: forward on this rank's slice of the sequence (Ulysses: all of it without
     SP), cross-entropy summed over the counted targets of the slice, and backward of
     `sum * world / global_count` (DeepSpeed averages gradients over the world, so the update
     is the gradient of the mean over all counted targets: never a mean of per-rank means);
  4. DeepSpeed's step (clipping, AdamW, ZeRO), the learning rate schedule, metrics, checkpoint.

Resume: the newest checkpoint whose manifest verifies restores model, optimizer, scheduler, the
loader's position and every rank's RNG states; metrics.jsonl is cut back to that step.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anchor.atomic import write_text_atomic
from anchor.errors import InputError
from torchtrain import checkpoint as ckpt
from torchtrain.config import RESUMABLE_CHANGES, TrainConfig, check_world, validate

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
DS_CONFIG_FILE = "deepspeed.json"
DATA_DIR = "data"


# ---------------------------------------------------------------------------------------------
# Learning rate and DeepSpeed config


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Multiplier of `lr` for the update of optimizer step `step` (0-based): linear warmup from
    lr/warmup_steps, then constant, cosine or linear decay to `min_lr_ratio * lr` at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1.0 + math.cos(math.pi * t)) if cfg.schedule == "cosine" else 1.0 - t
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def deepspeed_config(cfg: TrainConfig, world: int) -> dict[str, Any]:
    """The DeepSpeed JSON of a run of `world` processes.

    DeepSpeed's data-parallel world is every rank (see torchtrain.distributed), so its batch is
    counted in per-rank slices: `train_batch_size = micro_batch * grad_accum * world`. Clipping is
    always explicit (DeepSpeed's default is 1.0, not off).
    """
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    return {
        "train_batch_size": cfg.micro_batch * cfg.grad_accum(world) * world,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum(world),
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def step_arrays(batch):
    """`(tokens, targets, mask)` of a batch as torch tensors [B, T]: slot t predicts token t+1 of the
    whole window (the last slot's target is a placeholder that its mask never counts)."""
    import torch

    tokens = torch.as_tensor(batch.tokens, dtype=torch.long)
    return tokens, torch.roll(tokens, -1, dims=1), torch.as_tensor(batch.loss_mask, dtype=torch.float32)


def loss_multiplier(local_count, global_count, world: int):
    """What each rank's sum of cross-entropies is multiplied by before its backward: DeepSpeed
    averages gradients over all `world` ranks, so `world / global_count` makes the update the
    gradient of the mean over every counted target of the global batch (never `1 / local_count`,
    the mean of per-rank means, which weighs a rank's targets by how few it has)."""
    return world / global_count.clamp_min(1.0)


def param_groups(model, cfg: TrainConfig) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on every parameter except those whose name contains a `no_decay` entry."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if any(s in name for s in cfg.no_decay) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


# ---------------------------------------------------------------------------------------------
# The run folder, checked and prepared before any process group starts


@dataclass(frozen=True)
class RunPlan:
    """What prepare_run found: the packed data folder, the model spec (RoPE overrides applied)."""

    run: Path
    data: Path
    spec: Any


def _model_spec(cfg: TrainConfig):
    from anchor.weights import load_spec

    spec = load_spec(cfg.model)
    if cfg.rope:
        try:
            spec = spec.with_rope(**cfg.rope_overrides())
        except TypeError as e:
            raise InputError(f"rope: {e}", path=cfg.source) from None
    return spec


def resolved_engine(cfg: TrainConfig) -> str:
    """The engine `cfg.engine` runs as on this machine (`auto` resolved by
    torchtrain.engines.resolve_engine for the device init_world picks: CUDA where torch sees one)."""
    import torch

    from torchtrain.engines import resolve_engine

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    return resolve_engine(cfg.engine, "cuda" if torch.cuda.is_available() else "cpu", dtype)


def check_model(cfg: TrainConfig, spec, seq_len: int, *, here: bool = True, memory: bool = True) -> Any:
    """Length, sequence parallelism and (`here`: on this machine) the engine against the model, and
    (`memory`) a dense engine's T x T tensors against the memory free here; returns the spec to train
    (with `max_position` raised to `seq_len` when the RoPE is overridden for a longer context)."""
    import torch

    from torchtrain.engines import check_engine
    from torchtrain.sequence_parallel import check_sequence_parallel

    if seq_len > spec.max_position:
        if not cfg.rope:
            raise InputError(
                f"seq_len {seq_len} is beyond the model's {spec.max_position} positions; extend its RoPE for the "
                f"longer context (e.g. rope.theta: the paper uses 1e6 at 32K, 5e6 at 64K, 1e7 at 128K, 5e7 at 256K)",
                path=cfg.source)
        spec = spec.replace(max_position=seq_len)
    try:
        check_sequence_parallel(spec, seq_len, cfg.sequence_parallel)
    except InputError as e:
        raise InputError(str(e), path=cfg.source) from None
    if cfg.dtype == "bfloat16" and cfg.zero_stage == 0:
        # DeepSpeed's stage-0 bf16 optimizer departs from the fp32 update (tiny.yaml, 5 steps: 4% in
        # the loss, where ZeRO 1-3 in bf16 stay within 1e-3 of fp32); ZeRO-1 on one process is the
        # same memory as stage 0.
        raise InputError("dtype bfloat16 needs zero_stage >= 1 (DeepSpeed's stage-0 bf16 optimizer drifts "
                         "from the fp32 update; ZeRO-1 costs nothing extra on one process)", path=cfg.source)
    if not here:
        return spec
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    engine = resolved_engine(cfg)
    check_engine(engine, dtype)
    if engine == "flex" and not torch.cuda.is_available():
        raise InputError("engine 'flex' has no backward on CPU (FlexAttention); train with varlen, sdpa, eager "
                         "or flash_varlen_emulated on CPU", path=cfg.source)
    if memory:
        check_dense_memory(cfg, spec, seq_len, engine, dtype)
    return spec


def check_dense_memory(cfg: TrainConfig, spec, seq_len: int, engine: str, dtype) -> None:
    """eager and sdpa hold T x T tensors (torchtrain.engines.dense_attention_bytes, per micro-batch):
    refuse before any work when they exceed the memory free here (on the CPU the local processes
    share it; on CUDA each has its device)."""
    import torch

    from torchtrain import engines
    from torchtrain.distributed import launched_externally

    cuda = torch.cuda.is_available()
    need = engines.dense_attention_bytes(engine, seq_len=seq_len, batch=cfg.micro_batch,
                                         layers=1 if cfg.activation_checkpointing else spec.num_layers,
                                         heads=-(-spec.num_heads // cfg.sequence_parallel), dtype=dtype)
    procs = 1 if cuda else int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched_externally() else cfg.nproc
    need *= procs
    free = engines.available_memory("cuda" if cuda else "cpu")
    if not need or free is None or need <= free:
        return
    what = "mask" if engine == "sdpa" else "mask and attention scores"
    linear = engines.resolve_engine(engines.AUTO, "cuda" if cuda else "cpu", dtype)
    raise InputError(f"engine {engine!r} needs about {need / 2**30:.1f} GiB for its dense T x T {what} at "
                     f"seq_len={seq_len} (micro_batch={cfg.micro_batch}{f', {procs} processes' if procs > 1 else ''}); "
                     f"{free / 2**30:.1f} GiB available: use engine: auto ({linear}, linear in T) or a shorter seq_len",
                     path=cfg.source)


def _resolve_data(cfg: TrainConfig, run: Path, progress: bool) -> Path:
    """The packed folder to train on: `data` itself when it is an `anchor pack` output (checked
    against the config), else `RUN/data`, packed from the corpus once and reused on resume."""
    from anchor.data.packed import PackedData

    data = Path(cfg.data)
    if (data / "pack.json").is_file():
        packed = PackedData.open(data)
        layout = packed.meta.get("layout", {})
        if cfg.seq_len is not None and cfg.seq_len != packed.seq_len:
            raise InputError(f"seq_len {cfg.seq_len} differs from the packed data's {packed.seq_len}", path=data)
        for key in ("tags", "interleave"):
            if bool(layout.get(key)) != getattr(cfg, key):
                raise InputError(f"{key}: the config says {getattr(cfg, key)}, the packed data was made with "
                                 f"{bool(layout.get(key))}", path=data)
        _check_tokenizer(cfg, packed.meta, data)
        return data
    if cfg.seq_len is None:
        raise InputError("seq_len is required when data is a corpus packed on the fly", path=cfg.source)
    target = run / DATA_DIR
    if (target / "pack.json").is_file():
        return target
    from anchor.data.mixture import MixtureSpec
    from anchor.data.packing import Layout
    from anchor.data.pipeline import PackConfig, pack_corpus

    source: str | Path = cfg.data
    if cfg.data == "corpus":
        from anchor.data.corpus import CORPUS_FILE, write_default_corpus

        write_default_corpus(run / "corpus", progress=progress)
        source = run / "corpus" / CORPUS_FILE
    p = cfg.pack
    mix_keys = ("budget", "long_threshold", "upsample_factor")
    mixture = MixtureSpec(kind=p.get("mixture", "original"), seed=p.get("seed", cfg.seed),
                          **{k: p[k] for k in mix_keys if k in p})
    pack_cfg = PackConfig(seq_len=cfg.seq_len, mixture=mixture,
                          layout=Layout(tags=cfg.tags, interleave=cfg.interleave, mean_chunk=p.get("mean_chunk", 0)),
                          seed=p.get("seed", cfg.seed), text_field=p.get("text_field", "text"),
                          domain_field=p.get("domain_field"), skip_bad=p.get("skip_bad", False))
    pack_corpus(cfg.model, source, target, pack_cfg, progress=progress)
    return target


def _check_tokenizer(cfg: TrainConfig, meta: dict[str, Any], where: Path) -> None:
    from anchor.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.model)
    ident = (meta.get("tokenizer") or {}).get("identity")
    if ident is not None and ident != tok.identity:
        raise InputError(f"the packed data was tokenized with another tokenizer than the model {cfg.model!r}'s",
                         path=where)


def _saved_config(run: Path) -> dict[str, Any] | None:
    path = run / CONFIG_FILE
    if not path.is_file():
        return None
    from torchtrain.config import read_yaml

    return read_yaml(path)


def prepare_run(cfg: TrainConfig, run: str | Path, *, world: int | None = None, progress: bool = True,
                log=print) -> RunPlan:
    """Check the config against the model, the data and the run folder, pack data on the fly if
    needed, and write RUN/config.yaml; nothing distributed starts before this returns."""
    from anchor.outdir import guard_out, write_marker

    run = Path(run)
    check_world(cfg, world if world is not None else cfg.nproc)
    asked = cfg.engine
    cfg = cfg.replace(engine=resolved_engine(cfg))  # `auto` resolved: config.yaml records the engine that runs
    spec = _model_spec(cfg)
    data_path = Path(cfg.data)
    seq_len = cfg.seq_len
    if seq_len is None and (data_path / "pack.json").is_file():
        from anchor.data.packed import PackedData

        seq_len = PackedData.open(data_path).seq_len
    if seq_len is not None:
        check_model(cfg, spec, seq_len)  # before packing and before the run folder: a bad length fails fast
    if cfg.data != "corpus" and not data_path.exists():
        raise InputError("no such data file or folder (an `anchor pack` output, a corpus, or `corpus`)",
                         path=data_path)
    guard_out(run, "train", inputs=[cfg.data, cfg.model], replace=False)
    saved = _saved_config(run)
    if saved is not None:
        _check_resume_config(cfg, saved, run, asked_engine=asked)
    run.mkdir(parents=True, exist_ok=True)
    write_marker(run, "train")
    ckpt.clear_staging(run)
    data = _resolve_data(cfg, run, progress)
    from anchor.data.packed import PackedData

    packed = PackedData.open(data)
    if cfg.seq_len is None:
        cfg = cfg.replace(seq_len=packed.seq_len)
    spec = check_model(cfg, spec, packed.seq_len, memory=seq_len is None)
    vocab = (packed.meta.get("tokenizer") or {}).get("vocab_size")
    if vocab is not None and vocab > spec.vocab_size:
        raise InputError(f"the packed data's tokenizer has {vocab} tokens, the model only {spec.vocab_size}", path=data)
    if packed.num_windows < cfg.global_batch:
        raise InputError(f"{packed.num_windows} windows are fewer than one global batch of {cfg.global_batch}; "
                         "pack more data or lower global_batch", path=data)
    import yaml

    resolved = {**cfg.to_dict(), "seq_len": packed.seq_len}
    write_text_atomic(run / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False))
    (run / DS_CONFIG_FILE).write_text(json.dumps(deepspeed_config(cfg, world or cfg.nproc), indent=1))
    return RunPlan(run=run, data=data, spec=spec)


def _check_resume_config(cfg: TrainConfig, saved: Any, run: Path, *, asked_engine: str | None = None) -> None:
    """A rerun with the same --out must train the same thing (only RESUMABLE_CHANGES may differ).
    `cfg.engine` is already resolved, so `auto` equals the engine it resolves to here (`asked_engine`:
    the name the config gave, for the message)."""
    if not isinstance(saved, dict):
        raise InputError("not a run's config (not a mapping)", path=run / CONFIG_FILE)
    mine = cfg.to_dict()
    for key, value in mine.items():
        if key in RESUMABLE_CHANGES or (key == "seq_len" and value is None):
            continue
        old = saved.get(key)
        if isinstance(old, list):
            value = list(value) if isinstance(value, (tuple, list)) else value
        if old != value:
            if key == "engine" and asked_engine not in (None, value):
                value = f"{value} ({asked_engine} here)"
            raise InputError(f"{key} is {value!r} but the run was started with {old!r}; resume with the same "
                             f"config or choose another --out", path=run / CONFIG_FILE)


# ---------------------------------------------------------------------------------------------
# Launch


def train(cfg: TrainConfig, run: str | Path, *, progress: bool = True) -> int:
    """`anchor train`: prepare the run, then train in `nproc` local processes (or this one).
    Returns the last step trained."""
    from torchtrain.distributed import launch_local, launched_externally

    from anchor.outdir import out_lock

    run = Path(run).resolve()
    if launched_externally():  # torchrun / deepspeed launcher: every rank runs this
        return _train_external(cfg, run, progress)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    with out_lock(run, "train"):  # a second trainer on the same --out exits 2 naming this one
        prepare_run(cfg, run, progress=progress)
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if cfg.nproc == 1:
                return worker(str(run), progress)
            launch_local(cfg.nproc, _launched_worker, str(run), progress)
        except SignalException as e:
            # The elastic agent took SIGINT/SIGTERM over and stopped the workers; hand the signal
            # to whoever handled it before (the CLI: "interrupted", exit 130/143).
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            signal.raise_signal(e.sigval)
            raise
        finally:
            ckpt.clear_staging(run)  # a checkpoint an interrupted run was writing
    return _last_step(run)


def _train_external(cfg: TrainConfig, run: Path, progress: bool) -> int:
    """Under an outside launcher: rank 0 prepares the run folder while the others wait."""
    import torch.distributed as dist

    from torchtrain.distributed import init_world

    world = init_world(cfg.sequence_parallel)
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
    return worker(str(run), progress)


def _last_step(run: Path) -> int:
    steps = ckpt.list_steps(run)
    return steps[0] if steps else 0


# ---------------------------------------------------------------------------------------------
# The worker: one rank's loop


def _restore_rope_buffers(model, saved: dict[str, Any]) -> None:
    """DeepSpeed's bf16 mode casts every buffer to bf16; RoPE frequencies must stay fp32."""
    import torch

    buffers = dict(model.named_buffers())
    for name, value in saved.items():
        buffers[name].data = value.clone()
    if any(b.dtype != torch.float32 for n, b in model.named_buffers() if n.endswith("inv_freq")):
        raise AssertionError("RoPE inv_freq buffers must stay float32")


def _rng_state() -> dict[str, Any]:
    import torch

    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _read_metrics(run: Path, upto: int) -> list[str]:
    """metrics.jsonl lines of steps 1..upto (a killed run may have logged steps past its checkpoint)."""
    path = run / METRICS_FILE
    if not path.is_file():
        return []
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the kill
        if step <= upto:
            lines.append(line)
    return lines


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """RUN/metrics.jsonl as one dict per logged step (CONTRACT §8)."""
    text = (Path(run) / METRICS_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class _Metrics:
    """metrics.jsonl (rank 0): one flushed line per step; TensorBoard beside it when installed."""

    def __init__(self, run: Path, start: int, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        lines = _read_metrics(run, start)
        write_text_atomic(run / METRICS_FILE, "".join(line + "\n" for line in lines))
        self.file = open(run / METRICS_FILE, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run / "tensorboard"), purge_step=start + 1)
            except ImportError:
                self.tb = None

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        if self.tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if row.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", row[key], row["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


def _grad_norm(engine) -> float | None:
    """The global gradient norm at an accumulation boundary, where DeepSpeed does not report it
    (ZeRO 0 in fp32 with a torch optimizer): the gradients are averaged and replicated by then."""
    import torch

    grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def _dump_grads(engine, world, path: Path) -> None:
    """The averaged gradient of every parameter (Hugging Face names, float32) at an accumulation
    boundary, before clipping and the optimizer step; gathered under ZeRO 1-3 (all ranks call)."""
    from deepspeed.utils import safe_get_full_grad
    from safetensors.numpy import save_file

    grads = {}
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        if world.is_main and g is not None:
            grads[name] = g.detach().float().cpu().numpy().copy()
    if world.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(grads, str(tmp))
        os.replace(tmp, path)


def _full_state(engine, world) -> dict[str, np.ndarray] | None:
    """Every parameter as float32 numpy (Hugging Face names) on rank 0, gathered under ZeRO-3."""
    import deepspeed
    import torch

    params = list(engine.module.named_parameters())
    gather = engine.zero_optimization_stage() == 3
    ctx = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None) if gather else None
    if ctx is not None:
        ctx.__enter__()
    try:
        if not world.is_main:
            return None
        with torch.no_grad():
            return {name: p.detach().float().cpu().numpy().copy() for name, p in params}
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


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


def worker(run_str: str, progress: bool = True) -> int:
    """Train one rank of the run in `run_str` (prepared by prepare_run). Returns the last step."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from anchor.data.packed import Loader, PackedData
    from anchor.export import export_hf
    from anchor.progress import ProgressBar
    from torchtrain.config import read_yaml
    from torchtrain.distributed import ParallelGroups, init_world, sequence_parallel_group
    from torchtrain.loss import final_hidden_states, head_cross_entropy, token_cross_entropy
    from torchtrain.model import build_model

    run = Path(run_str)
    saved = read_yaml(run / CONFIG_FILE)
    cfg = validate(saved, source=str(run / CONFIG_FILE))
    world = init_world(cfg.sequence_parallel)
    check_world(cfg, world.size)
    if world.device.type == "cpu":
        return_freed_memory()
    torch.manual_seed(cfg.seed + world.rank)
    np.random.seed((cfg.seed + world.rank) % 2**32)
    random.seed(cfg.seed + world.rank)

    data_dir = Path(cfg.data) if (Path(cfg.data) / "pack.json").is_file() else run / DATA_DIR
    data = PackedData.open(data_dir)
    spec = check_model(cfg, _model_spec(cfg), data.seq_len, memory=False)  # prepare_run checked the memory
    model = build_model(cfg.model, engine=resolved_engine(cfg), dtype="float32", rope=spec.rope, seed=cfg.seed)
    model.anchor_spec = spec
    rope_buffers = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    sp_group = sequence_parallel_group(world) if world.sp > 1 else None
    if sp_group is not None:
        from torchtrain.sequence_parallel import enable_sequence_parallel

        enable_sequence_parallel(model, sp_group)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(world.device)
    optimizer = torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    ds_config = deepspeed_config(cfg, world.size)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds_config, mpu=ParallelGroups(world))
    _restore_rope_buffers(engine.module, rope_buffers)

    gas = cfg.grad_accum(world.size)
    loader = Loader(data, batch_size=cfg.micro_batch * gas, variant=cfg.variant, seed=cfg.seed,
                    rank=world.dp_rank, world_size=world.dp, mask_cross_doc_loss=cfg.mask_cross_doc_loss)

    # Resume: every rank verifies the manifest itself before DeepSpeed unpickles anything.
    start, elapsed0 = 0, 0.0
    logs: list[str] = []
    found = ckpt.newest_valid(run, log=logs.append)
    if world.is_main:
        for line in logs:
            print(line, file=sys.stderr, flush=True)
    if found is not None:
        folder = ckpt.step_dir(run, found)
        engine.load_checkpoint(str(folder / "ds"), tag="state", load_optimizer_states=True,
                               load_lr_scheduler_states=True)
        _restore_rope_buffers(engine.module, rope_buffers)
        state = json.loads((folder / "trainer.json").read_text(encoding="utf-8"))
        loader.load_state_dict(state["loader"])
        _set_rng_state(state["rng"][world.rank])
        start, elapsed0 = int(state["step"]), float(state["elapsed_s"])
        if world.is_main and not logs:
            print(f"resuming from {folder}", file=sys.stderr, flush=True)
    dist.barrier()

    metrics = _Metrics(run, start, world.is_main, cfg.tensorboard)
    bar = ProgressBar("train", cfg.steps, progress and world.is_main, unit="steps")
    if start:
        bar.advance(start)
    sp_rank, sp = world.sp_rank, world.sp
    T = data.seq_len
    local_T = T // sp
    sl = slice(sp_rank * local_T, (sp_rank + 1) * local_T)
    stage0_fp32 = cfg.zero_stage == 0 and cfg.dtype == "float32"
    t_start = time.perf_counter() - elapsed0
    step = start
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            lr_now = scheduler.get_last_lr()[0]
            batch = next(loader)
            tokens, targets, mask = step_arrays(batch)
            local_count = mask[:, sl].sum()
            count = _all_reduce_sum(local_count, world.device)  # counted targets of the global batch
            total = torch.zeros((), dtype=torch.float64)
            scale = loss_multiplier(local_count, count, world.size)
            norm = None
            for m in range(gas):
                rows = slice(m * cfg.micro_batch, (m + 1) * cfg.micro_batch)
                inputs = {"input_ids": tokens[rows, sl].to(world.device),
                          "position_ids": torch.as_tensor(batch.positions[rows, sl], dtype=torch.long).to(world.device),
                          "doc_ids": torch.as_tensor(batch.doc_ids[rows], dtype=torch.long).to(world.device),
                          "variant": cfg.variant}
                # The lm-head fused with the loss: no [B, T, V] logits (or their gradient). ZeRO-3
                # partitions the lm-head weight outside its module's forward, and GatheredParameters
                # around the fused loss would not route its gradient back to the partitions: stage 3
                # keeps the logits path, and with it the logits' memory at long context.
                if cfg.zero_stage != 3:
                    hidden = final_hidden_states(engine, engine.module, **inputs)
                    ce = head_cross_entropy(engine.module, hidden, targets[rows, sl].to(world.device))
                else:
                    ce = token_cross_entropy(engine(**inputs).logits, targets[rows, sl].to(world.device))
                local = (ce * mask[rows, sl].to(world.device)).sum()
                engine.backward(local * scale.to(world.device), scale_wrt_gas=False)
                total += local.detach().double().cpu()
                if m == gas - 1:
                    if stage0_fp32:
                        norm = _grad_norm(engine)
                    if step in cfg.dump_grads:
                        _dump_grads(engine, world, run / "grads" / f"step-{step}.safetensors")
                engine.step()
            total = _all_reduce_sum(total, world.device)
            if norm is None:
                reported = engine.get_global_grad_norm()
                norm = None if reported is None else float(reported)
            loss = float(total / count.double().clamp_min(1.0))
            dt = time.perf_counter() - t0
            row = {"step": step, "loss": loss, "tokens": int(count), "lr": lr_now, "grad_norm": norm,
                   "tokens_per_s": cfg.global_batch * T / dt, "elapsed_s": time.perf_counter() - t_start}
            metrics.write(row)
            if cfg.log_every and step % cfg.log_every == 0:
                eta = (cfg.steps - step) * (row["elapsed_s"] - elapsed0) / max(1, step - start)
                bar.advance(1, note=f"step {step} loss {loss:.4f} {row['tokens_per_s']:.0f} tok/s "
                                    f"eta {eta:.0f} s")
            else:
                bar.advance(1)
            if cfg.is_checkpoint_step(step):
                _save(engine, world, cfg, spec, run, step, loader, row["elapsed_s"], export_hf, _full_state)
    finally:
        bar.close()
        metrics.close()
    return step


def _all_reduce_sum(x, device):
    """The sum of a host tensor over all ranks, back on the host (NCCL reduces device tensors only)."""
    import torch.distributed as dist

    y = x.to(device, copy=True)
    dist.all_reduce(y)
    return y.cpu()


def _launched_worker(run_str: str, progress: bool = True) -> int:
    """`worker` in a process of `launch_local`: a failure's traceback reaches the launcher (torch's
    `record` writes it to the elastic error file). Wrapped here, under its own name, so the spawned
    process can unpickle it."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(worker)(run_str, progress)


def _save(engine, world, cfg: TrainConfig, spec, run: Path, step: int, loader, elapsed: float,
          export_hf, full_state) -> None:
    """Write checkpoint `step` (all ranks): staging folder, DeepSpeed state, trainer state, hf/,
    manifest, rename; then prune old regular checkpoints."""
    import torch.distributed as dist

    staging = ckpt.staging_path(run, step)
    if world.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    engine.save_checkpoint(str(staging / "ds"), tag="state", save_latest=False)
    rngs: list[Any] = [None] * world.size
    dist.all_gather_object(rngs, _rng_state())
    state = full_state(engine, world)
    if world.is_main:
        trainer = {"step": step, "loader": loader.state_dict(), "rng": rngs, "elapsed_s": elapsed,
                   "world": world.size}
        (staging / "trainer.json").write_text(json.dumps(trainer), encoding="utf-8")
        export_hf(spec, state, staging / "hf", tokenizer_of=cfg.model)
    dist.barrier()
    if world.is_main:
        ckpt.write_manifest(staging, step, {"config": CONFIG_FILE})
        ckpt.publish(run, step)
        keep = {s for s in ckpt.list_steps(run) if cfg.is_eval_step(s)}
        ckpt.prune(run, cfg.keep_last, keep)
    dist.barrier()
