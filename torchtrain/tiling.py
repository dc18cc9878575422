"""A decoder layer's MLP computed in tiles over the sequence, so a long window never holds its whole intermediate.

    tile_mlps(model)            # every layer's mlp; rows per tile: the hidden size (as ALST's TiledMLP)
    tile_mlps(model, rows=512)

An MLP's intermediate is 4 i values per slot in the backward (gate, up, act(gate), their product: for
SmolLM2 i = 1536, 2.7 times the hidden size), the largest term of one layer's recomputation under
activation checkpointing. Tiled, the forward runs tile by tile without recording a graph and keeps only its
input; the backward recomputes one tile at a time with gradients, so a tile's intermediate is the most
ever alive. Each slot's output is the same arithmetic as untiled (rows are independent); the weights'
gradient is the sum of the tiles' contributions, a different order of the same sum (within rounding;
tests/torchtrain/test_tiling.py). The gradients of the MLP's weights are returned through autograd like any
other, so DeepSpeed's reduction hooks fire once per step.

DeepSpeed ships the same algorithm (`deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`, from ALST);
it accumulates into `param.grad` from inside the backward and needs DeepSpeed's own flags to keep ZeRO's
hooks from firing per tile, and it is not part of the base install. This one returns the gradients, names
its tiles explicitly (`tile_ranges`, checked to cover the rows once) and needs torch only.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn


def tile_ranges(rows: int, tile: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most `tile` rows covering 0..rows once, in order."""
    if tile < 1:
        raise ValueError(f"rows per tile must be at least 1, not {tile}")
    return [(s, min(s + tile, rows)) for s in range(0, rows, tile)]


def _check_cover(ranges: list[tuple[int, int]], rows: int) -> None:
    end = 0
    for s, e in ranges:
        if s != end or e <= s:
            raise AssertionError(f"tiles {ranges[:4]}... do not cover 0..{rows} once: a gap or overlap at {end}")
        end = e
    if end != rows:
        raise AssertionError(f"tiles end at {end}, not at {rows}")


class _TiledMLP(torch.autograd.Function):
    """fn(x) row-tile by row-tile; the backward recomputes each tile and returns the parameters' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Any, tile: int, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ranges = tile_ranges(flat.shape[0], tile)
        _check_cover(ranges, flat.shape[0])
        with torch.no_grad():
            out = torch.cat([fn(flat[s:e]) for s, e in ranges], dim=0)
        ctx.save_for_backward(x)
        ctx.fn, ctx.ranges, ctx.params = fn, ranges, params
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        g = grad_out.reshape(-1, grad_out.shape[-1])
        wanted = [p for p in ctx.params if p.requires_grad]
        grad_x = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        grads: list[torch.Tensor | None] = [None] * len(wanted)
        for s, e in ctx.ranges:
            piece = flat[s:e].requires_grad_(grad_x is not None)
            with torch.enable_grad():
                out = ctx.fn(piece)
            inputs = ([piece] if grad_x is not None else []) + wanted
            got = torch.autograd.grad(out, inputs, g[s:e], allow_unused=True)
            if grad_x is not None:
                grad_x[s:e] = got[0]
                got = got[1:]
            for k, gp in enumerate(got):
                if gp is not None:
                    grads[k] = gp if grads[k] is None else grads[k].add_(gp)
        by_param = iter(grads)
        param_grads = [next(by_param) if p.requires_grad else None for p in ctx.params]
        return (None if grad_x is None else grad_x.reshape(x.shape), None, None, *param_grads)


def _tiled_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = tuple(mlp.parameters())
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        return mlp._untiled_forward(x)
    return _TiledMLP.apply(x, mlp._untiled_forward, mlp._tile_rows, *params)


def tile_mlps(model: nn.Module, rows: int | None = None) -> int:
    """Make every decoder layer's `mlp` compute in tiles of `rows` slots (default: the hidden size); the number
    of MLPs tiled. Inference (no gradients) runs the MLP as before."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    hidden = model.config.hidden_size
    tiled = 0
    for layer in layers:
        mlp = layer.mlp
        if not hasattr(mlp, "_untiled_forward"):
            mlp._untiled_forward = mlp.forward
            mlp.forward = types.MethodType(_tiled_forward, mlp)
        mlp._tile_rows = int(rows or hidden)
        tiled += 1
    return tiled
