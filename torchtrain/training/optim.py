"""The optimizer of a training run (docs/DESIGN.md §8): AdamW's parameter groups and the learning-rate
schedule, which the DeepSpeed config (torchtrain.config.deepspeed_json) carries into the engine.

    optimizer, scheduler = build_optimizer(model, cfg)      # AdamW over param_groups, LambdaLR of lr_factor
                                                            # (parallel.offload_optimizer: DeepSpeed's CPU Adam)
    allocate_state(optimizer)                               # ZeRO-0: the moments held from the start
    deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                         config=deepspeed_config(cfg, world_size), ...)   # torchtrain.config.deepspeed_json
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from anchor_core.errors import UnavailableError
from anchor_core.limits import clip
from torchtrain.config.deepspeed_json import quiet_deepspeed_import
from torchtrain.training.phases import phase_index

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchtrain.config import OptimConfig, TrainConfig


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Multiplier of `optim.lr` for the update of optimizer step `step` (0-based): linear warmup from
    lr/schedule.warmup_steps, then `schedule.kind`: constant, cosine or linear decay to
    `schedule.min_lr_ratio * lr` at the last step; with `schedule.phases`, times the phase's lr / optim.lr for the
    steps of a phase that gives its own lr (the shape spans the whole run: torchtrain.training.phases)."""
    phases = cfg.schedule.phases
    peak = phases[phase_index([p.steps for p in phases], step + 1)].lr if phases else None
    return _shape(cfg, step) * (1.0 if peak is None else peak / cfg.optim.lr)


def _shape(cfg: TrainConfig, step: int) -> float:
    if step < cfg.schedule.warmup_steps:
        return (step + 1) / cfg.schedule.warmup_steps
    if cfg.schedule.kind == "constant":
        return 1.0
    span = max(1, cfg.schedule.steps - cfg.schedule.warmup_steps - 1)
    t = min(1.0, (step - cfg.schedule.warmup_steps) / span)
    shape = 0.5 * (1.0 + math.cos(math.pi * t)) if cfg.schedule.kind == "cosine" else 1.0 - t
    return cfg.schedule.min_lr_ratio + (1.0 - cfg.schedule.min_lr_ratio) * shape


def param_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """AdamW groups: weight decay (`optim.weight_decay`) on every parameter except those whose name contains
    an `optim.no_decay` entry. Takes the optim section alone (any object with those two fields)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if any(s in name for s in optim.no_decay) else decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `param_groups` (the config's lr, betas and eps) and its schedule: the lr of optimizer
    step s (0-based) is `lr * lr_factor(cfg, s)`."""
    import torch

    if cfg.parallel.offload_optimizer:  # the states live in host memory: DeepSpeed's CPU Adam steps them there
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # it loads its op (train() made sure it builds)

        _cpu_info_once()
        optimizer = DeepSpeedCPUAdam(param_groups(model, cfg.optim), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                     eps=cfg.optim.eps, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(param_groups(model, cfg.optim), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                      eps=cfg.optim.eps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))


def load_cpu_adam() -> None:
    """DeepSpeed's CPU Adam op (`parallel.offload_optimizer`) loaded in this process: compiled from C++ on first
    use (once per TORCH_EXTENSIONS_DIR, about 2-3 minutes on 2 cores), then read from there. A machine that cannot
    build it (no C++ compiler, no ninja, a CPU DeepSpeed does not support) gets a one-line UnavailableError: the
    trainer calls this before the run folder is touched."""
    quiet_deepspeed_import()
    _cpu_info_once()
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        builder = CPUAdamBuilder()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError("DeepSpeed says it is not compatible with this machine")
        builder.load(verbose=False)
    except Exception as e:  # the build's own error, whatever DeepSpeed or torch's cpp_extension raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(": [1/", 1)[0]  # not ninja's log
        raise UnavailableError(f"parallel.offload_optimizer needs DeepSpeed's CPU Adam, which cannot be built here "
                               f"({clip(first, 200)}); a C++ compiler and ninja build it, or set "
                               "parallel.offload_optimizer: false") from None


def _cpu_info_once() -> None:
    """py-cpuinfo's `get_cpu_info` remembered in this process: DeepSpeed's op builder asks it for the compiler flags
    on every load (three times per CPU Adam), each time a Python subprocess of 1-2 s (more on a busy machine)."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then reads lscpu
        return
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state allocated now, as its first step would allocate it (AdamW: both moments zero,
    the step count 0), so that the first step's peak memory is every step's: a window that cannot fit fails
    in its first step, not after it, and `torchtrain.training.memory.step_memory` (which counts the moments) is
    the peak of a run of any length. Allocated by the optimizer itself: one step at learning rate 0 on zero
    gradients (AdamW's decay multiplies the weights by exactly 1, its update is exactly 0), after which the
    learning rates and gradients are put back and every state tensor is zeroed, so the run's arithmetic is
    unchanged bit for bit; it holds no more memory than any later step. Nothing is done when a state exists
    (a resumed run's is loaded over it). For a torch optimizer over the model's own parameters (ZeRO-0):
    DeepSpeed's ZeRO optimizers keep their own partitions."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(optimizer.state.get(p) for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    with torch.no_grad():
        try:
            for group in optimizer.param_groups:
                group["lr"] = 0.0
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
        finally:
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
            for p, grad in zip(params, grads):
                p.grad = grad
        for p in params:
            for value in optimizer.state[p].values():
                if torch.is_tensor(value):
                    value.zero_()
