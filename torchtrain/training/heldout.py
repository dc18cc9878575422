"""The held-out loss while a run trains: the loss on windows training never sees, overall and by slot range
(the paper's loss-by-position view), every `eval.every` steps.

    held = heldout_set(cfg, data)              # None when eval.heldout_windows and eval.heldout_data are unset
    row.update(heldout_loss(cfg, world, engine, held))   # every rank calls (ZeRO-3 gathers in the forward)

The windows: `eval.heldout_windows` chosen from the packed data by seed (anchor_core.data.packed.heldout_windows;
the Loader leaves the same ones out of every batch), or the windows of another `anchor pack` folder
(`eval.heldout_data`: its first `eval.heldout_windows`, or all). The loss is the run's own (docs/DESIGN.md §1:
the variant's mask and positions, its loss mask), in the run's dtype, without gradients: the mean cross-entropy
over the counted predictions of all held-out windows, and per bucket of `eval.heldout_buckets` equal slot
ranges the mean over the predictions made at those slots (None where a bucket counts none). Each data-parallel
rank takes every dp-th window (a rank with one window fewer repeats one at weight 0, so that every rank runs the
same forwards); a sequence-parallel group shares its windows as in training.

Cost: one forward per held-out window, about a third of a training step's work per window (no backward): the
pass takes about heldout_windows / (3 x data.global_batch x eval.every) of the training time, logged as
`heldout_s` (benchmarks/bench_heldout.py measures it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from anchor_core.data.packed import PackedData, heldout_windows
from anchor_core.errors import InputError
from torchtrain.config import TrainConfig
from torchtrain.model.loss import final_hidden_states
from torchtrain.parallel import ulysses as sp

if TYPE_CHECKING:
    from torchtrain.parallel.distributed import World


@dataclass(frozen=True)
class HeldOut:
    data: PackedData
    indices: np.ndarray  # the held-out windows of `data`
    edges: np.ndarray  # bucket b holds the predictions made at slots [edges[b], edges[b + 1])


def heldout_set(cfg: TrainConfig, data: PackedData) -> HeldOut | None:
    """The held-out windows of this run (module docstring), None when it holds out none."""
    other = check_heldout_data(cfg, data.seq_len)
    if other is not None:
        n = other.num_windows if not cfg.eval.heldout_windows else min(cfg.eval.heldout_windows, other.num_windows)
        held, indices = other, np.arange(n)
    elif cfg.eval.heldout_windows:
        held, indices = data, heldout_windows(data.num_windows, cfg.eval.heldout_windows, cfg.data.seed)
    else:
        return None
    edges = np.linspace(0, data.seq_len, cfg.eval.heldout_buckets + 1).round().astype(np.int64)
    return HeldOut(held, indices, edges)


def heldout_loss(cfg: TrainConfig, world: World, engine: Any, held: HeldOut) -> dict[str, Any]:
    """{"heldout_loss", "heldout_loss_by_position", "heldout_tokens", "heldout_s"} over the held-out windows;
    every rank calls it and gets the same."""
    t0 = time.perf_counter()
    k = len(held.edges) - 1
    sums = torch.zeros(2 * k, dtype=torch.float64)  # per bucket: cross-entropy summed, predictions counted
    mine = held.indices[world.dp_rank::world.dp]
    was_training = engine.module.training
    engine.module.eval()
    try:
        with torch.no_grad():
            for i in range(math.ceil(len(held.indices) / world.dp)):
                index, weight = (mine[i], 1.0) if i < len(mine) else (held.indices[0], 0.0)
                sums += weight * _window_sums(cfg, world, engine, held, int(index))
    finally:
        engine.module.train(was_training)
    y = sums.to(world.device)
    dist.all_reduce(y)
    ce, count = y.cpu()[:k], y.cpu()[k:]
    total = float(count.sum())
    return {"heldout_loss": float(ce.sum()) / total if total else None,
            "heldout_loss_by_position": [float(c / n) if n else None for c, n in zip(ce.tolist(), count.tolist())],
            "heldout_tokens": int(total), "heldout_s": time.perf_counter() - t0}


def _window_sums(cfg: TrainConfig, world: World, engine: Any, held: HeldOut, index: int) -> torch.Tensor:
    """[2k]: this rank's slots of one window, cross-entropy summed and predictions counted per bucket."""
    batch = held.data.batch(np.array([index]), cfg.model.variant, mask_cross_doc_loss=cfg.model.mask_cross_doc_loss)
    tokens = torch.as_tensor(batch.tokens, dtype=torch.long)
    slots = world.slots(tokens.shape[1])
    inputs = sp.rank_inputs(batch, tokens, slice(None), world.sp_rank, world.sp, world.device, cfg.model.variant, slots)
    states = final_hidden_states(engine, engine.module, **inputs)
    ce, counted, _ = sp.next_token_ce_shard(states, tokens, torch.as_tensor(batch.loss_mask), world.sp_rank, world.sp,
                                            lm_head=engine.module.get_output_embeddings(),  # training's own loss
                                            slots=slots)
    counted = counted.double().cpu()
    ce = (ce.double().cpu() * counted).sum(0)
    bucket = torch.as_tensor(np.searchsorted(held.edges, slots, side="right") - 1)
    k = len(held.edges) - 1
    return torch.cat([torch.bincount(bucket, weights=ce, minlength=k),
                      torch.bincount(bucket, weights=counted.sum(0), minlength=k)])


def check_heldout_data(cfg: TrainConfig, seq_len: int) -> PackedData | None:
    """eval.heldout_data, opened: an `anchor pack` folder of windows of the run's length (None when not given)."""
    if cfg.eval.heldout_data is None:
        return None
    where = cfg.where("eval.heldout_data")
    folder = Path(cfg.eval.heldout_data).expanduser()
    if not (folder / "pack.json").is_file():
        raise InputError(f"eval.heldout_data {folder} is not an `anchor pack` output folder (no pack.json)", path=where)
    held = PackedData.open(folder)
    if held.seq_len != seq_len:
        raise InputError(f"eval.heldout_data {folder} holds windows of {held.seq_len} slots, the run trains on "
                         f"{seq_len}", path=where)
    if cfg.eval.heldout_windows > held.num_windows:
        raise InputError(f"eval.heldout_windows {cfg.eval.heldout_windows} is more than the {held.num_windows} "
                         f"windows of eval.heldout_data {folder} (0: all of them)",
                         path=cfg.where("eval.heldout_windows", "eval.heldout_data"))
    return held
