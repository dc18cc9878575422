"""One rank of the whole-model context-parallel tests (tests/torchtrain/test_context_parallel_model.py).

`run_pool(U, C, folder, cases)` spawns U·C gloo processes; rank `c·U + u` holds the slots `rank_slots(T, C, c, U, u)`
of every window, its attention Ulysses-parallel over the U ranks of its `c` and context-parallel over the C ranks
of its `u`. Every rank runs every case (the collectives must match) and compares the logits (gathered into slot
order), the mean next-token loss and every parameter gradient (all-reduced over all ranks) with one process on the
whole window; rank 0 saves the comparisons. The windows are tests/torchtrain/sp_worker.py's (the real packer:
documents cut by the window, one-slot documents, padding, domain tags, interleaved chunks).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.torchtrain.sp_worker import batch, compare, compare_grads, reference, weights


@dataclass(frozen=True)
class Case:
    model: str
    engine: str
    variant: str
    layout: str
    seq_len: int
    broken: str = ""  # "" | "contiguous_inputs": the ranks feed contiguous shards while the attention expects balanced slots

    @property
    def key(self) -> str:
        return "/".join(str(v) for v in asdict(self).values() if v != "")


def groups(U: int, C: int) -> tuple[object, object, int, int]:
    """(Ulysses group, context group, u, c) of this rank; every rank creates every group in the same order."""
    rank = dist.get_rank()
    mine = {}
    for c in range(C):
        g = dist.new_group([c * U + u for u in range(U)])
        if rank // U == c:
            mine["ulysses"] = g
    for u in range(U):
        g = dist.new_group([c * U + u for c in range(C)])
        if rank % U == u:
            mine["context"] = g
    return mine["ulysses"], mine["context"], rank % U, rank // U


def split_run(model, b: dict[str, torch.Tensor], case: Case, U: int, C: int, u: int, c: int):
    from torchtrain.parallel.context import rank_slots
    from torchtrain.parallel.ulysses import next_token_loss_shard

    T = case.seq_len
    slots = rank_slots(T, C, c, U, u)
    fed = slots if case.broken != "contiguous_inputs" else np.arange(T)[(c * U + u) * len(slots):][:len(slots)]
    model.zero_grad(set_to_none=True)
    idx = torch.as_tensor(fed)
    out = model(input_ids=b["tokens"][:, idx], position_ids=b["positions"][:, idx], doc_ids=b["doc_ids"],
                variant=case.variant)
    ce_sum, count = next_token_loss_shard(out.logits, b["tokens"], b["loss_mask"], 0, 1, slots=fed)
    (ce_sum / count).backward()
    total = ce_sum.detach().clone()
    dist.all_reduce(total)
    params = list(model.named_parameters())
    flat = torch.cat([p.grad.reshape(-1) for _, p in params])
    dist.all_reduce(flat)
    grads = {n: g.view_as(p) for (n, p), g in zip(params, flat.split([p.numel() for _, p in params]))}
    world = dist.get_world_size()
    parts = [torch.empty_like(out.logits) for _ in range(world)]
    dist.all_gather(parts, out.logits.detach().contiguous())
    where = [torch.as_tensor(rank_slots(T, C, r // U, U, r % U)) for r in range(world)]
    logits = torch.empty(out.logits.shape[0], T, out.logits.shape[2])
    for w, p in zip(where, parts):
        logits[:, w] = p
    return logits, total / count, int(count), grads


def worker(rank: int, U: int, C: int, folder: str, cases: list[Case]) -> None:
    from torchtrain.model import model_from_weights, set_engine
    from torchtrain.parallel.context import enable_context_parallel
    from torchtrain.parallel.ulysses import enable_sequence_parallel

    torch.set_num_threads(1)
    out: dict = {"results": {}}
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=U * C,
                                timeout=timedelta(seconds=180))
        ulysses, context, u, c = groups(U, C)
        models: dict[str, tuple] = {}
        for case in cases:
            if case.model not in models:
                spec, state = weights(case.model)
                split = model_from_weights(spec, state, engine="sdpa", dtype="float32")
                enable_sequence_parallel(split, ulysses if U > 1 else None)
                enable_context_parallel(split, context)
                models[case.model] = (model_from_weights(spec, state, engine="sdpa", dtype="float32"), split)
            ref, split = (set_engine(m, case.engine) for m in models[case.model])
            b = batch(case.layout, case.variant, case.seq_len)
            got_logits, got_loss, got_count, got_grads = split_run(split, b, case, U, C, u, c)
            if rank == 0:
                logits, loss, count, grads, _ = reference(ref, b, case.variant)
                out["results"][case.key] = {
                    "count": (got_count, count), "loss_values": (float(got_loss), float(loss)),
                    "logits": compare(got_logits, logits), "loss": compare(got_loss, loss),
                    "grads": compare_grads(got_grads, grads)}
        dist.destroy_process_group()
    except BaseException:
        out["traceback"] = traceback.format_exc()
        torch.save(out, Path(folder) / f"rank{rank}.pt")
        raise
    torch.save(out, Path(folder) / f"rank{rank}.pt")


def run_pool(U: int, C: int, folder: Path, cases: list[Case]) -> dict[str, dict]:
    """Spawn U·C ranks over `cases`; rank 0's comparisons by case key."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(worker, args=(U, C, str(folder), cases), nprocs=U * C, join=True, start_method="spawn")
    first = torch.load(folder / "rank0.pt", weights_only=True)
    assert "traceback" not in first, first["traceback"]
    return first["results"]
