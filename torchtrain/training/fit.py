"""Whether a run fits the model and this machine, checked before any work and again in every worker: the length
against the model's positions, sequence parallelism against its heads, the engine and dtype against the device,
and one step's memory against the memory free here (torchtrain.training.memory's plan).

    spec = model_spec(cfg)                       # the model's spec with the config's RoPE overrides
    spec = check_model(cfg, spec, seq_len)       # one line (InputError) naming the key to change, or the spec to train
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from anchor_core.errors import InputError
from anchor_core.weights import load_spec
from torchtrain.attention import engines
from torchtrain.attention.engines import resolve_engine
from torchtrain.config import TrainConfig
from torchtrain.parallel.distributed import launched_externally
from torchtrain.parallel.context import check_context_parallel
from torchtrain.parallel.ulysses import check_sequence_parallel
from torchtrain.training.memory import check_device, largest_term, step_memory, step_of

if TYPE_CHECKING:
    import torch

    from anchor_core.spec import ModelSpec


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The spec of `model.name` with the config's RoPE overrides (`model.rope`) applied."""
    spec = load_spec(cfg.model.name)
    if cfg.rope_overrides():
        try:
            spec = spec.with_rope(**cfg.rope_overrides())
        except TypeError as e:
            raise InputError(f"model.rope: {e}", path=cfg.where("model.rope")) from None
    return spec


def resolved_engine(cfg: TrainConfig) -> str:
    """The engine `model.engine` runs as on this machine (`auto` resolved by
    torchtrain.attention.engines.resolve_engine for the device init_world picks: CUDA where torch sees one)."""
    import torch


    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    return resolve_engine(cfg.model.engine, "cuda" if torch.cuda.is_available() else "cpu", dtype)


def check_model(cfg: TrainConfig, spec: ModelSpec, seq_len: int, *, here: bool = True,
                memory: bool = True) -> ModelSpec:
    """Length, sequence parallelism and (`here`: on this machine) the engine against the model, and
    (`memory`) a dense engine's T x T tensors against the memory free here; returns the spec to train
    (with `max_position` raised to `seq_len` when the RoPE is overridden for a longer context)."""
    import torch


    if seq_len > spec.max_position:
        if not cfg.rope_overrides():
            raise InputError(
                f"data.seq_len {seq_len} is beyond the model's {spec.max_position} positions; extend its RoPE for "
                f"the longer context (e.g. model.rope.theta: the paper uses 1e6 at 32K, 5e6 at 64K, 1e7 at 128K, 5e7 at 256K)",
                path=cfg.where("data.seq_len", "model.name"))
        spec = spec.replace(max_position=seq_len)
    cp = cfg.parallel.context_parallel
    try:
        check_context_parallel(seq_len, cp)
    except InputError as e:
        raise InputError(str(e), path=cfg.where("parallel.context_parallel", "data.seq_len")) from None
    ulysses = cfg.parallel.sequence_parallel
    try:
        check_sequence_parallel(spec, seq_len // cp, ulysses)
    except InputError as e:
        message, keys = str(e), ("parallel.sequence_parallel", "data.seq_len")
        if cp > 1 and (seq_len // cp) % ulysses:
            share = seq_len // cp
            fits = [d for d in range(2, 2 * ulysses + 1) if share % d == 0 and spec.num_heads % d == 0 and d != ulysses]
            works = f"; parallel.sequence_parallel {min(fits, key=lambda d: abs(d - ulysses))} fits" if fits else ""
            message = (f"parallel.sequence_parallel {ulysses} does not divide the {share} slots of a context-parallel "
                       f"share (data.seq_len {seq_len} / parallel.context_parallel {cp}){works}")
            keys += ("parallel.context_parallel",)
        raise InputError(message, path=cfg.where(*keys)) from None
    # dtype, engine and offloading against the device: the one check anchor plan makes too
    engine = check_device(cfg, ("cuda" if torch.cuda.is_available() else "cpu") if here else None)
    if here and memory:
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        check_step_memory(cfg, spec, seq_len, engine, dtype)
    return spec


def check_step_memory(cfg: TrainConfig, spec: ModelSpec, seq_len: int, engine: str, dtype: torch.dtype) -> None:
    """One step's memory (torchtrain.training.memory.step_memory: the processes, weights and optimizer, activations
    linear in T, a dense engine's T x T tensors) against the memory free here, before any work: on the CPU
    the local processes share it (`parallel.nproc`), on CUDA each has its device. One line naming the key that
    weighs most and the estimate."""
    import torch


    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched_externally() else cfg.parallel.nproc
    procs = 1 if cuda else local  # the processes that share this memory: on CUDA each has its device
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_externally() else cfg.parallel.nproc
    need = step_memory(spec, seq_len=seq_len, **step_of(cfg, engine=engine, dtype=dtype, procs=procs, world=world,
                                                        on_gpu=cuda))
    if need.host:  # offloaded checkpoints (CUDA): every local process's in this host's memory
        host_free = engines.available_memory("cpu")
        if host_free is not None and need.host * local > host_free:
            raise InputError(f"model.offload_checkpoints at data.seq_len={seq_len} needs about "
                             f"{need.host * local / 2**30:.1f} GiB of host memory for the checkpoints of {local} "
                             f"process(es); {host_free / 2**30:.1f} GiB available here: a shorter data.seq_len, or "
                             "more hosts (anchor plan --host-memory shows where it stops)",
                             path=cfg.where("model.offload_checkpoints", "data.seq_len"))
    free = engines.available_memory("cuda" if cuda else "cpu")
    if free is None or need.total <= free:
        return
    if need.dense > need.activations:
        what = "mask" if engine == "sdpa" else "mask and attention scores"
        linear = engines.resolve_engine(engines.AUTO, "cuda" if cuda else "cpu", dtype)
        hint = (f"most of it is the dense T x T {what}: use model.engine: auto ({linear}, linear in T) or a shorter "
                "data.seq_len")
        key = f"model.engine {engine!r} at data.seq_len={seq_len} (data.micro_batch={cfg.data.micro_batch})"
        keys = ("model.engine", "data.seq_len")
    elif procs > 1 and need.base * procs > need.per_process:
        key, hint, keys = f"parallel.nproc={procs}", "fewer processes", ("parallel.nproc",)
    elif need.activations >= need.states:
        key = f"data.seq_len={seq_len} (data.micro_batch={cfg.data.micro_batch})"
        keys = ("data.seq_len",)
        levers = ["a shorter data.seq_len"]
        levers += [f"{k}: true" for k, on in (("model.activation_checkpointing", cfg.model.activation_checkpointing),
                                                ("model.tiled_mlp", cfg.model.tiled_mlp)) if not on]
        levers.append("parallel.sequence_parallel or parallel.context_parallel over more processes")
        name, _ = largest_term(need)
        hint = (f"{name} the largest term; " + ", ".join(levers[:-1]) + f" or {levers[-1]}"
                + " (anchor plan shows each term)")
    else:
        key, hint = ("the model's weights and optimizer",
                     "a higher parallel.zero_stage over more processes, or a smaller model")
        keys = ("model.name",)
    raise InputError(f"{key} needs about {need.describe()} for one training step; {free / 2**30:.1f} GiB "
                     f"available here: {hint}", path=cfg.where(*keys))
