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

Under ZeRO-3 (parameters partitioned by DeepSpeed, `ds_id` on each) the weights exist whole only inside their
module's call, where ZeRO-3's hooks gather them, and again in that module's backward: a tile computed
outside it would see empty tensors, and gradients returned for a partitioned parameter do not have its shape.
There `_TiledMLPZero3` runs every tile, forward and recomputation alike, through the MLP's own submodule
calls (so each gathers and releases its weights as in an untiled step) and runs each tile's backward with
`torch.autograd.backward`, which accumulates the weights' gradients into `param.grad` where ZeRO-3's
reduction hooks take them; `ds_grad_is_ready` (read by those hooks) holds the reduction back until the last
tile, so a weight's gradient is reduced once, the sum of its tiles' in the same order as `_TiledMLP`'s. This
is the algorithm of DeepSpeed's own `deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP` (ALST); it is
written here rather than called so that every ZeRO stage cuts the same tiles (`tile_ranges`, rows per tile,
checked to cover the rows once: DeepSpeed's cuts a given number of chunks with `torch.chunk`), and ZeRO 0-2
keep `_TiledMLP`, which needs no DeepSpeed flags.
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


def _forward_by_tiles(ctx: Any, x: torch.Tensor, fn: Any, tile: int) -> torch.Tensor:
    """fn over x's rows, tile by tile, without gradients (the backward recomputes each tile); x kept for it and
    `ctx.fn`, `ctx.ranges` set. x [..., h] -> [..., out]."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    ranges = tile_ranges(flat.shape[0], tile)
    _check_cover(ranges, flat.shape[0])
    with torch.no_grad():
        out = torch.cat([fn(flat[s:e]) for s, e in ranges], dim=0)
    ctx.save_for_backward(x)
    ctx.fn, ctx.ranges = fn, ranges
    return out.reshape(*shape[:-1], out.shape[-1])


class _TiledMLP(torch.autograd.Function):
    """fn(x) row-tile by row-tile; the backward recomputes each tile and returns the parameters' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Any, tile: int, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.params = params
        return _forward_by_tiles(ctx, x, fn, tile)

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


class _TiledMLPZero3(torch.autograd.Function):
    """fn(x) row-tile by row-tile for an MLP whose weights ZeRO-3 partitions (module docstring): `fn` calls the
    MLP's submodules, whose hooks gather their weights; the backward recomputes each tile with gradients and
    runs its backward, the weights' gradients accumulating in `param.grad` and reduced after the last tile.
    Each tile's gathers are collectives over the ranks, so every rank must cut as many tiles: the trainer's ranks
    hold the same rows (micro_batch windows of T / sequence_parallel slots)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Any, tile: int, params: tuple[torch.Tensor, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.params = [p for p in params if p.requires_grad]
        return _forward_by_tiles(ctx, x, fn, tile)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        g = grad_out.reshape(-1, grad_out.shape[-1])
        want_x = ctx.needs_input_grad[0]
        grad_x = torch.empty_like(flat) if want_x else None
        last = len(ctx.ranges) - 1
        try:
            for k, (s, e) in enumerate(ctx.ranges):
                for p in ctx.params:  # ZeRO-3's hook reduces a gradient only once it is ready: after the last tile
                    p.ds_grad_is_ready = k == last
                piece = flat[s:e].detach().requires_grad_(want_x)
                with torch.enable_grad():
                    out = ctx.fn(piece)
                if out.requires_grad:
                    torch.autograd.backward(out, g[s:e])
                if grad_x is not None:
                    grad_x[s:e] = piece.grad
        finally:
            for p in ctx.params:
                p.ds_grad_is_ready = True
        return (None if grad_x is None else grad_x.reshape(x.shape), None, None, None)


def _zero3_partitioned(params: tuple[torch.Tensor, ...]) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions these parameters (it marks each with `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in params)


def _tiled_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = tuple(mlp.parameters())
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        return mlp._untiled_forward(x)
    if _zero3_partitioned(params):
        return _TiledMLPZero3.apply(x, mlp._untiled_forward, mlp._tile_rows, params)
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
