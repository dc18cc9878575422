"""FP8 linear layers (`model.float8`): torchao's float8 training on the decoder layers' projections.

`convert(model, recipe, emulate)` swaps every `nn.Linear` of the decoder layers (q, k, v, o, gate, up, down) for
torchao's `Float8Linear` under one of its recipes (`torchao.float8.Float8LinearConfig.from_recipe_name`):

  rowwise     e4m3 operands and gradients, one power-of-two scale per row (AXISWISE)
  tensorwise  e4m3 operands, e5m2 gradients, one scale per tensor (torchao's default)

The lm-head stays in the model's dtype, as the recipes leave it (torchtitan converts every linear but the output
projection). Attention and RoPE are unchanged. The oracle's emulation of a recipe is the engine's bf16 policy with
the recipe's FP8 stages, `<policy>+float8_<recipe>` (jaxref.policy.FLOAT8_RECIPES, jaxref.fp8: the same casts,
scales and backward products).

FP8 matmuls need a GPU with FP8 tensor cores (compute capability 8.9: Ada, Hopper, Blackwell). Elsewhere, torchao's
emulation (`emulate`: the same casts, the product of the dequantized values in float32) trains the same numbers
slower; `check` refuses a device without FP8 unless emulation is asked for (`model.float8_emulation`).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from anchor_core.errors import InputError

RECIPES: tuple[str, ...] = ("rowwise", "tensorwise")
FP8_CAPABILITY = (8, 9)
"""The CUDA compute capability from which `torch._scaled_mm` runs FP8 (Ada Lovelace; Hopper is 9.0)."""
def available() -> bool:
    """Whether torchao (the `fp8` extra) is installed."""
    return importlib.util.find_spec("torchao") is not None


def device_has_fp8(device: str | torch.device) -> bool:
    """Whether `device` runs FP8 matmuls: a CUDA device of compute capability 8.9 or later."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def check(recipe: str | None, device: str | None, emulate: bool, *, where: str = "model.float8") -> None:
    """InputError (one line, naming `where`) where `recipe` cannot train on `device` ("cuda", "cpu" or None: any):
    an unknown recipe, torchao missing, or a device without FP8 matmuls and no emulation asked for."""
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise InputError(f"{where}: unknown recipe {recipe!r} (valid: {', '.join(RECIPES)})")
    if not available():
        raise InputError(f"{where}: {recipe} needs torchao (pip install 'anchor-toolkit[fp8]')")
    if device is None or emulate:
        return
    if device == "cpu" or (device == "cuda" and torch.cuda.is_available() and not device_has_fp8("cuda")):
        what = "the CPU" if device == "cpu" else f"this GPU (compute capability " \
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}, FP8 needs 8.9)"
        raise InputError(f"{where}: {what} has no FP8 matmuls; set model.float8_emulation=true to train "
                         "torchao's emulation of them (the same numbers, slower)")


def _in_decoder_layers(module: nn.Module, fqn: str) -> bool:
    """torchao's module filter: the linears inside `model.layers` (not the lm-head)."""
    return ".layers." in f".{fqn}" and isinstance(module, nn.Linear)


def convert(model: nn.Module, recipe: str, emulate: bool) -> nn.Module:
    """Swap the decoder layers' linears of `model` for torchao's Float8Linear under `recipe` (in place; the
    weights and their names stay: state dicts, checkpoints and exports are those of the model without FP8).
    Returns the model."""
    check(recipe, None, emulate)
    import logging

    # torchao's import warns where its CUDA kernels cannot load (a CPU torch) and registers enums torch now
    # handles itself: lines on every run that say nothing about FP8 training
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=_in_decoder_layers)
    return model


def converted(model: nn.Module) -> int:
    """How many of `model`'s modules are torchao's Float8Linear (0 without FP8)."""
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())
