"""One rank of the sequence-parallel tests (tests/torchtrain/test_sequence_parallel.py).

`run_pool(P, folder, cases)` spawns P gloo processes on the CPU; every rank runs every case in
the same order (the collectives must match), and writes what it measured to
`folder/rank<r>.pt`. Per case:

  reference  one process, the whole window: logits [B, T, V], the mean next-token loss
             (`torchtrain.next_token_loss`) and the parameter gradients of that loss
  SP         P processes, each on its contiguous shard (`shard`), doc_ids the whole window:
             logits all-gathered along the sequence, the loss as the SUM over ranks of the
             shards' cross-entropy sums divided by the window's count, gradients of each rank's
             `ce_sum / count` all-reduced (SUM) over the group

Rank r computes the reference of the cases with index % P == r and compares it with the SP
results (which every rank holds after the all-gather/all-reduce); only the comparison is saved.
Windows come from the real packer and batch maker (`anchor_core.data.packing.Packer`,
`anchor_core.data.batch.make_batch`): several documents, one-slot documents, documents cut by the
window, padding at the end of the last window, domain-tag slots, interleaved chunks.
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

from torchtrain.model.loss import token_cross_entropy

FIRST, EOS = 1, 2
TAG_TOKENS = [[5, 6], [7], [8, 9, 10]]  # per domain
LAYOUTS = {  # name: (tags, interleave)
    "plain": (False, False),
    "tags": (True, False),
    "interleaved": (False, True),
    "tags_interleaved": (True, True),
}


@dataclass(frozen=True)
class Case:
    model: str  # a random: preset, or "kv1"/"kv3" (6 heads over 1 / 3 kv heads: replicated kv heads)
    engine: str
    variant: str
    layout: str
    seq_len: int
    impl: str = "torch"  # the SP all-to-all: torch | deepspeed
    broken: str = ""  # "" | "reversed_gather" (sequence shards gathered in the wrong order) | "no_sp" (shards as windows)

    @property
    def key(self) -> str:
        return "/".join(str(v) for v in asdict(self).values() if v != "")


# ---------------------------------------------------------------------------------------------
# Data


def windows(layout: str, T: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two packed windows [2, T] (tokens, seg, tag): one from the middle of the stream (documents
    cut at both ends) and the last one (padded)."""
    from anchor_core.data.packing import Layout, Packer
    from anchor_core.data.store import TokenStore

    tags, interleave = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    lengths = [0, 1, 0, 3]  # one-slot documents (EOS only; tag + EOS with tags) early on
    while sum(lengths) + len(lengths) < 2.6 * (T - 1):
        lengths.append(int(rng.choice([0, 1, 2, int(rng.integers(3, T // 2))])))
    docs = [rng.integers(11, 331, size=n) for n in lengths]
    domains = [int(d) for d in rng.integers(0, len(TAG_TOKENS), size=len(docs))]
    store = TokenStore.from_docs(docs, domains, [f"d{i}" for i in range(len(TAG_TOKENS))])
    packer = Packer(store, np.arange(len(docs)), T, first_token=FIRST, eos=EOS,
                    tag_tokens=TAG_TOKENS if tags else None, layout=Layout(interleave=interleave, mean_chunk=9),
                    seed=seed)
    blocks = list(packer.blocks())
    tok, seg, tag = (np.concatenate([getattr(b, k) for b in blocks]) for k in ("tokens", "seg", "tag"))
    pick = [1, len(seg) - 1]
    assert (seg[pick[-1]] < 0).any() and not (seg[pick[0]] < 0).any(), "want one full and one padded window"
    return tok[pick].astype(np.int64), seg[pick], tag[pick]


def batch(layout: str, variant: str, T: int) -> dict[str, torch.Tensor]:
    from anchor_core.data.batch import make_batch

    b = make_batch(*windows(layout, T), variant)
    return {k: torch.from_numpy(np.asarray(v, dtype=np.int64)) for k, v in b.as_dict().items()}


# ---------------------------------------------------------------------------------------------
# Models


def weights(name: str):
    from anchor_core.spec import RANDOM_PRESETS
    from anchor_core.weights import load_weights, random_state

    if name in ("kv1", "kv3"):  # llama with 6 query heads over 1 or 3 kv heads
        spec = RANDOM_PRESETS["llama"].replace(num_kv_heads=int(name[2]))
        return spec, random_state(spec, seed=3)
    return load_weights(f"random:{name}")


class Models:
    """One reference model and one SP model per name (same weights); engines switched in place."""

    def __init__(self, group):
        self.group = group
        self.ref: dict[str, torch.nn.Module] = {}
        self.sp: dict[str, torch.nn.Module] = {}

    def get(self, name: str, engine: str, impl: str):
        from torchtrain.model import model_from_weights, set_engine
        from torchtrain.parallel.ulysses import enable_sequence_parallel

        if name not in self.ref:
            spec, state = weights(name)
            self.ref[name] = model_from_weights(spec, state, engine="sdpa", dtype="float32")
            self.sp[name] = enable_sequence_parallel(model_from_weights(spec, state, engine="sdpa", dtype="float32"),
                                                     self.group)
            enable_sequence_parallel(self.sp[name], self.group)  # idempotent
        ref, sp = set_engine(self.ref[name], engine), set_engine(self.sp[name], engine)  # set_engine keeps SP
        enable_sequence_parallel(sp, self.group, impl=impl)
        return ref, sp


# ---------------------------------------------------------------------------------------------
# Comparison


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float | bool]:
    """Bitwise equality, max abs error, and max error relative to the reference's max magnitude."""
    got, want = got.detach(), want.detach()
    d = (got.double() - want.double()).abs()
    scale = want.double().abs().max().clamp_min(1e-30)
    return {"bitwise": bool(torch.equal(got, want)), "max_abs": float(d.max()), "max_rel": float(d.max() / scale)}


def compare_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict:
    per = {n: compare(got[n], want[n]) for n in want}
    worst = max(per, key=lambda n: per[n]["max_rel"])
    return {"bitwise": all(p["bitwise"] for p in per.values()), "max_abs": max(p["max_abs"] for p in per.values()),
            "max_rel": per[worst]["max_rel"], "worst": worst,
            "bitwise_params": sorted(n for n, p in per.items() if p["bitwise"]),
            "params": sorted(per)}


def reference(model, b: dict[str, torch.Tensor], variant: str):
    from torchtrain import next_token_loss

    model.zero_grad(set_to_none=True)
    out = model(input_ids=b["tokens"], position_ids=b["positions"], doc_ids=b["doc_ids"], variant=variant)
    loss, count = next_token_loss(out.logits, b["tokens"], b["loss_mask"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ce = token_cross_entropy(out.logits[:, :-1], b["tokens"][:, 1:])
    return out.logits.detach(), loss.detach(), int(count), grads, ce.detach()


def sequence_parallel(model, b: dict[str, torch.Tensor], case: Case, rank: int, P: int, group):
    from torchtrain.parallel.ulysses import (Ulysses, disable_sequence_parallel, next_token_loss_shard,
                                             sequence_parallel_of, shard)

    model.zero_grad(set_to_none=True)
    doc_ids = b["doc_ids"]
    if case.broken == "reversed_gather":  # the sequence shards of the gathered window in the wrong order
        sp: Ulysses = sequence_parallel_of(model)
        sp.seq_to_heads = lambda x: torch.cat(Ulysses.seq_to_heads(sp, x).chunk(P, dim=1)[::-1], dim=1)
    if case.broken == "no_sp":  # each shard attends as a window of its own
        disable_sequence_parallel(model)
        doc_ids = shard(doc_ids, rank, P)
    try:
        out = model(input_ids=shard(b["tokens"], rank, P), position_ids=shard(b["positions"], rank, P),
                    doc_ids=doc_ids, variant=case.variant)
    finally:
        if case.broken == "reversed_gather":
            del sp.seq_to_heads
    ce_sum, count = next_token_loss_shard(out.logits, b["tokens"], b["loss_mask"], rank, P)
    (ce_sum / count).backward()
    total = ce_sum.detach().clone()
    dist.all_reduce(total, group=group)
    params = list(model.named_parameters())
    flat = torch.cat([p.grad.reshape(-1) for _, p in params])
    dist.all_reduce(flat, group=group)
    grads = {n: g.view_as(p) for (n, p), g in zip(params, flat.split([p.numel() for _, p in params]))}
    parts = [torch.empty_like(out.logits) for _ in range(P)]
    dist.all_gather(parts, out.logits.detach().contiguous(), group=group)
    return torch.cat(parts, dim=1), total / count, int(count), grads


def run_case(models: Models, case: Case, index: int, rank: int, P: int, group) -> dict | None:
    from torchtrain.parallel.ulysses import enable_sequence_parallel

    b = batch(case.layout, case.variant, case.seq_len)
    ref_model, sp_model = models.get(case.model, case.engine, case.impl)
    sp_logits, sp_loss, sp_count, sp_grads = sequence_parallel(sp_model, b, case, rank, P, models.group)
    if case.broken == "no_sp":
        enable_sequence_parallel(sp_model, models.group)
    if index % P != rank:
        return None
    logits, loss, count, grads, ce = reference(ref_model, b, case.variant)
    return {
        "case": asdict(case), "count": count, "sp_count": sp_count,
        "logits": compare(sp_logits, logits), "loss": compare(sp_loss, loss),
        "loss_values": (float(sp_loss), float(loss)), "grads": compare_grads(sp_grads, grads),
        # the per-slot cross-entropy of the SP logits against the reference's (before any reduction)
        "ce": compare(token_cross_entropy(sp_logits[:, :-1], b["tokens"][:, 1:]), ce),
        "counted_per_rank": [int(b["loss_mask"][:, :-1][:, r * (case.seq_len // P):(r + 1) * (case.seq_len // P)].sum())
                             for r in range(P)],
    }


def error_checks(models: Models, rank: int, P: int, T: int) -> dict[str, str]:
    """One-line errors under SP (the same on every rank, before any collective)."""
    from anchor_core.errors import InputError
    from torchtrain import capture_taps
    from torchtrain.parallel.ulysses import shard

    _, model = models.get("mistral", "sdpa", "torch")
    b = batch("plain", "anchor", T)
    local = {"input_ids": shard(b["tokens"], rank, P), "position_ids": shard(b["positions"], rank, P), "variant": "anchor"}
    found = {}
    for name, call in {
        "local_doc_ids": lambda: model(**local, doc_ids=shard(b["doc_ids"], rank, P)),
        "taps": lambda: _with_taps(capture_taps, model, local, b["doc_ids"]),
    }.items():
        try:
            call()
            found[name] = "no error"
        except InputError as e:
            found[name] = str(e)
    return found


def _with_taps(capture_taps, model, local, doc_ids):
    with torch.no_grad(), capture_taps(model):
        model(**local, doc_ids=doc_ids)


def init_deepspeed_comm() -> None:
    """DeepSpeed's communication over the existing gloo group, without its shared-memory all-reduce
    kernel (a C++ build of about a minute on first use; all-to-all does not use it)."""
    import sys

    import deepspeed

    # `import deepspeed.comm.torch as x` binds torch itself (deepspeed.comm has an attribute `torch`)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def worker(rank: int, P: int, folder: str, cases: list[Case]) -> None:
    torch.set_num_threads(1)
    out: dict = {"results": {}, "errors": {}}
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=P,
                                timeout=timedelta(seconds=120))
        group = dist.new_group(list(range(P)))
        models = Models(group)
        for i, case in enumerate(cases):
            if case.impl == "deepspeed" and not out.get("deepspeed"):
                init_deepspeed_comm()
                out["deepspeed"] = True
            res = run_case(models, case, i, rank, P, group)
            if res is not None:
                out["results"][case.key] = res
        out["errors"] = error_checks(models, rank, P, cases[0].seq_len)
        dist.destroy_process_group()
    except BaseException:
        out["traceback"] = traceback.format_exc()
        torch.save(out, Path(folder) / f"rank{rank}.pt")
        raise
    torch.save(out, Path(folder) / f"rank{rank}.pt")


def run_pool(P: int, folder: Path, cases: list[Case]) -> list[dict]:
    """Spawn P ranks over `cases`; return each rank's saved dict."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(worker, args=(P, str(folder), cases), nprocs=P, join=True, start_method="spawn")
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(P)]
