"""One rank of the attention-level context-parallel tests (tests/torchtrain/test_context_parallel.py).

`run_pool(C, folder, cases)` spawns C gloo processes on the CPU; every rank runs every case in the same
order (the collectives must match): its queries, keys and values are its slots of one whole window
(`window`, the same on every rank), `ContextParallel.attend` runs one layer's attention, and the
backward takes the rank's slots of one upstream gradient. Each rank saves its slots, its output and
its dq, dk, dv to `folder/rank<r>.pt`; the test puts them back into slot order.

Planted defects (Case.defect): "anchor_not_summed", the anchor's key and value gradients keep rank
0's own part instead of the group's sum; "order_not_undone", rank 1 uses the all-gathered keys and
values in rank order instead of slot order.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

B, N, K, D = 2, 6, 2, 16
T = 1028  # 514 slots a rank at degree 2, 257 (odd halves 128 + 129) at degree 4
PAD = 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORWARD_ONLY = ("flex",)  # FlexAttention has no backward on the CPU: its output alone is held


@dataclass(frozen=True)
class Case:
    degree: int
    dtype: str
    variant: str
    engine: str
    defect: str = ""  # "" | "anchor_not_summed" | "order_not_undone"

    @property
    def key(self) -> str:
        return "/".join(str(v) for v in asdict(self).values() if v != "")


def doc_ids(variant: str) -> torch.Tensor:
    """int64 [B, T]. Row 0: short documents at both ends around one of 907 slots that crosses every rank
    boundary at degree 2 and 4; row 1: documents of odd lengths (1 to 211) that fall across the
    boundaries anywhere. Both end in PAD padding slots. Slot 0 is the anchor (doc 0) under the anchor
    variant, else the first slot of the first document."""
    rows = [[3, 1, 27, 907, 9, 1, 75], [97, 131, 1, 211, 59, 3, 173, 7, 1, 89, 241, 5, 1, 3, 1]]
    out = []
    for lengths in rows:
        assert sum(lengths) == T - 1 - PAD, sum(lengths)
        ids = [0] + [d + 1 for d, n in enumerate(lengths) for _ in range(n)] + [-1] * PAD
        if variant != "anchor":
            ids[0] = 1
        out.append(ids)
    return torch.tensor(out, dtype=torch.long)


def window(dtype: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """q [B,N,T,D], k/v [B,K,T,D] (rotated as a layer's would be) and the upstream gradient dout [B,T,N,D],
    drawn in float64 and rounded to `dtype`. The first slot's key is scaled up: as in a pretrained model,
    most queries then attend to it (an attention sink), so its gradients are the largest."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, K, T, D, generator=g, dtype=torch.float64)
    k[:, :, 0] *= 4
    v = torch.randn(B, K, T, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, T, N, D, generator=g, dtype=torch.float64)
    dt = DTYPES[dtype]
    return {name: x.to(dt) for name, x in {"q": q, "k": k, "v": v, "dout": dout}.items()}


def plant(cp, defect: str, rank: int) -> None:
    from torchtrain.parallel.context import ContextParallel

    if defect == "anchor_not_summed":  # slot 0 is the first of rank 0's slots and of the rank order
        def reduce_to_owner(grad):
            own = grad[:, :, 0].clone()
            out = ContextParallel.reduce_to_owner(cp, grad)
            if rank == 0:
                out[:, :, 0] = own
            return out

        cp.reduce_to_owner = reduce_to_owner
    elif defect == "order_not_undone" and rank == 1:
        cp.to_slot_order = lambda x: x


def run_case(case: Case, group, rank: int) -> dict[str, torch.Tensor]:
    from torchtrain.attention.engines import prepare_meta
    from torchtrain.parallel.context import ContextParallel

    cp = ContextParallel(group, case.degree, rank)
    plant(cp, case.defect, rank)
    slots = torch.as_tensor(cp.slots(T))
    x = window(case.dtype)
    meta = prepare_meta(case.engine, doc_ids(case.variant), case.variant, rows=slots)
    q, k, v = (x[n].index_select(2, slots) for n in ("q", "k", "v"))
    if case.engine in FORWARD_ONLY:
        return {"slots": slots, "out": cp.attend(case.engine, q, k, v, meta, D**-0.5)}
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = cp.attend(case.engine, q, k, v, meta, D**-0.5)
    out.backward(x["dout"].index_select(1, slots))
    return {"slots": slots, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def worker(rank: int, C: int, folder: str, cases: list[Case]) -> None:
    torch.set_num_threads(1)
    out: dict = {"results": {}}
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=C,
                                timeout=timedelta(seconds=120))
        group = dist.new_group(list(range(C)))
        for case in cases:
            out["results"][case.key] = run_case(case, group, rank)
        dist.destroy_process_group()
    except BaseException:
        out["traceback"] = traceback.format_exc()
        torch.save(out, Path(folder) / f"rank{rank}.pt")
        raise
    torch.save(out, Path(folder) / f"rank{rank}.pt")


def run_pool(C: int, folder: Path, cases: list[Case]) -> dict[str, dict[str, torch.Tensor]]:
    """Spawn C ranks over `cases`; per case the output [B,T,N,D] and dq [B,N,T,D], dk/dv [B,K,T,D] in slot order
    (the output alone for an engine of FORWARD_ONLY)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(worker, args=(C, str(folder), cases), nprocs=C, join=True, start_method="spawn")
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(C)]
    for r in ranks:
        assert "traceback" not in r, r["traceback"]
    whole = {}
    for case in cases:
        parts = [r["results"][case.key] for r in ranks]
        slots = torch.cat([p["slots"] for p in parts])
        assert sorted(slots.tolist()) == list(range(T))
        inverse = torch.empty_like(slots)
        inverse[slots] = torch.arange(T)
        whole[case.key] = {
            "out": torch.cat([p["out"] for p in parts], dim=1).index_select(1, inverse),
            **{g: torch.cat([p[g] for p in parts], dim=2).index_select(2, inverse) for g in ("dq", "dk", "dv")
               if g in parts[0]},
        }
    return whole
