"""Context parallelism at the attention level (torchtrain.parallel.context) against the fp64 oracle.

At degree 2 and 4 (gloo on the CPU), in float32 and bfloat16, for every variant and the CPU engines
with a backward (varlen among them: its calls skip the chunks of a segment that hold only keys), one layer's output
and its dq, dk, dv (the anchor's dk and dv among them) are held
against jaxref's attention in float64 on the same rounded inputs, under the 2x-baseline rule: the
relative L2 error of the context-parallel result is at most twice that of the same engine in one
process in the same dtype (its error against the same truth). The window (tests/torchtrain/cp_worker.py)
has 1028 slots, documents of odd lengths, one of them crossing every rank boundary, and padding.
FlexAttention, which has no backward on the CPU, is held by its output alone. Two planted defects (the anchor's key and value gradients not summed back to their owner; one rank's
gathered keys left in rank order) fail the same rule.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
import torch

from anchor_core.errors import InputError
from tests.torchtrain import cp_worker
from tests.torchtrain.cp_worker import D, FORWARD_ONLY, T, Case, doc_ids, window
from torchtrain.attention import engines
from torchtrain.parallel.context import balanced_slots, check_context_parallel, slot_order

VARIANTS = ("full", "intra_doc", "intra_doc_reset", "anchor")
ENGINES = ("sdpa", "eager", "flash_varlen_emulated", "varlen", *FORWARD_ONLY)
DEGREES = (2, 4)
# make test's: degree 2 (a pool of 2 processes); degree 4 starts 4 processes on 2 cores and runs in make test-all
FAST = {Case(2, dt, "anchor", "sdpa") for dt in ("float32", "bfloat16")}
CASES = [pytest.param(c, marks=() if c in FAST else pytest.mark.slow, id=c.key)
         for c in (Case(C, dt, v, e) for C in DEGREES for dt in ("float32", "bfloat16") for v in VARIANTS for e in ENGINES)]
DEFECTS = [pytest.param(c, marks=() if c.degree == 2 and c.dtype == "float32" else pytest.mark.slow, id=c.key)
           for c in (Case(C, dt, "anchor", "sdpa", d) for C in DEGREES for dt in ("float32", "bfloat16")
                     for d in ("anchor_not_summed", "order_not_undone"))]
FACTOR = 2.0  # the rule: rel_l2 <= FACTOR * the one-process baseline's rel_l2


def _case_of(item) -> Case | None:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get("case")


@pytest.fixture(scope="module")
def pools(request, tmp_path_factory):
    """The context-parallel results of every case this session selected in this module, one pool per degree
    (a case alone selected runs alone)."""
    selected = {case for item in request.session.items
                if item.path == request.path and (case := _case_of(item)) is not None}
    results = {}
    for C in DEGREES:
        cases = sorted((c for c in selected if c.degree == C), key=lambda c: c.key)
        if cases:
            results.update(cp_worker.run_pool(C, tmp_path_factory.mktemp(f"cp{C}"), cases))
    return results


def _parts(out, dq=None, dk=None, dv=None) -> dict[str, torch.Tensor]:
    """The parts held: the output, and the gradients where the engine has a backward."""
    if dq is None:
        return {"out": out}
    return {"out": out, "dq": dq, "dk": dk, "dv": dv, "dk_anchor": dk[:, :, 0], "dv_anchor": dv[:, :, 0]}


@functools.cache
def _oracle():
    """jaxref's attention in float64 and its VJP, compiled once per variant."""
    from jaxref.attention import attention
    from jaxref.policy import get_policy

    policy = get_policy("fp64")

    @functools.partial(jax.jit, static_argnums=0)
    def out_and_grads(variant, q, k, v, ids, dout):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, ids, variant, policy, D**-0.5), q, k, v)
        return out, *vjp(dout)

    return out_and_grads


@functools.cache
def truth(dtype: str, variant: str) -> dict[str, torch.Tensor]:
    """jaxref's float64 attention and its gradients on the window rounded to `dtype`."""
    x = {n: t.double().numpy() for n, t in window(dtype).items()}
    q, k, v = (np.ascontiguousarray(x[n].transpose(0, 2, 1, 3)) for n in ("q", "k", "v"))  # [B,T,H,D]
    out, dq, dk, dv = _oracle()(variant, q, k, v, jax.numpy.asarray(doc_ids(variant).numpy()), x["dout"])

    def heads_second(a):  # [B,T,H,D] -> [B,H,T,D]
        return torch.from_numpy(np.asarray(a).transpose(0, 2, 1, 3).copy())

    return _parts(torch.from_numpy(np.array(out)), heads_second(dq), heads_second(dk), heads_second(dv))


@functools.cache
def baseline(dtype: str, variant: str, engine: str) -> dict[str, torch.Tensor]:
    """The engine in one process on the whole window, in `dtype`."""
    x = window(dtype)
    meta = engines.prepare_meta(engine, doc_ids(variant), variant)
    if engine in FORWARD_ONLY:
        return _parts(engines.attend(engine, x["q"], x["k"], x["v"], meta, D**-0.5))
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out = engines.attend(engine, q, k, v, meta, D**-0.5)
    out.backward(x["dout"])
    return _parts(out.detach(), q.grad, k.grad, v.grad)


def rel_l2(x: torch.Tensor, truth: torch.Tensor) -> float:
    x, truth = x.double(), truth.double()
    return float((x - truth).norm() / truth.norm())


def judge(case: Case, got: dict) -> dict[str, tuple[float, float, bool]]:
    """Per part: (context-parallel rel_l2, baseline rel_l2, within the rule)."""
    got = _parts(got["out"], got.get("dq"), got.get("dk"), got.get("dv"))
    t, b = truth(case.dtype, case.variant), baseline(case.dtype, case.variant, case.engine)
    rows = {}
    for part in got:
        err, base = rel_l2(got[part], t[part]), rel_l2(b[part], t[part])
        rows[part] = (err, base, err <= FACTOR * base)
    return rows


def _show(case: Case, rows: dict) -> str:
    return f"{case.key}: " + ", ".join(f"{p} {e:.2e}/{b:.2e}{'' if ok else ' FAIL'}" for p, (e, b, ok) in rows.items())


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_attention_holds_against_fp64(pools, case):
    rows = judge(case, pools[case.key])
    print(_show(case, rows))
    assert all(ok for _, _, ok in rows.values()), _show(case, rows)


@pytest.mark.parametrize("case", DEFECTS)
def test_planted_defects_fail_the_rule(pools, case):
    rows = judge(case, pools[case.key])
    print(_show(case, rows))
    broken = {"anchor_not_summed": ("dk_anchor", "dv_anchor"), "order_not_undone": ("out", "dq", "dk", "dv")}
    assert not any(rows[p][2] for p in broken[case.defect]), _show(case, rows)


def test_the_window_crosses_every_rank_boundary():
    """Row 0's document of 907 slots (doc 4) holds slots of every rank at degree 2 and 4."""
    row = doc_ids("anchor").numpy()[0]
    for C in DEGREES:
        owner = np.empty(T, dtype=int)
        for r in range(C):
            owner[balanced_slots(T, C, r)] = r
        assert set(owner[row == 4].tolist()) == set(range(C))


@pytest.mark.parametrize("T_,C", [(1028, 4), (1028, 2), (97, 1), (515, 5), (1030, 4)])
def test_the_layout_covers_the_window_once_and_balances_the_causal_work(T_, C):
    if T_ % C:
        with pytest.raises(InputError, match=rf"context_parallel {C} does not split seq_len {T_} .*use 2 or 5"):
            check_context_parallel(T_, C)
        return
    order, inverse = slot_order(T_, C)
    assert sorted(order.tolist()) == list(range(T_)) and np.array_equal(order[inverse], np.arange(T_))
    shares = [balanced_slots(T_, C, r) for r in range(C)]
    assert all(np.all(np.diff(s) > 0) and len(s) == T_ // C for s in shares)
    work = [int(s.sum()) for s in shares]  # causal work of a rank's queries: the sum of its slots
    s = T_ // C
    assert max(work) - min(work) <= (0 if s % 2 == 0 else s * (C - 1)), work


@pytest.mark.parametrize("C", DEGREES)
def test_a_ranks_varlen_calls_skip_the_chunks_of_keys_alone(C):
    """The varlen engine under context parallelism computes each rank's own query rows and fewer than CHUNK more
    per segment, where running every segment whole would compute all its keys' rows (the whole prefix of a
    document before the rank's queries)."""
    from torchtrain.attention.varlen_plan import CHUNK

    ids = doc_ids("anchor")
    for rank in range(C):
        meta = engines.prepare_meta("varlen", ids, "anchor", rows=balanced_slots(T, C, rank))
        computed = sum(c.n * c.lq for c in meta.plan.calls)
        segments = len(meta.segments.cu_seqlens_q) - 1
        keys = int(meta.segments.cu_seqlens_k[-1])
        R = ids.shape[0] * T // C
        print(f"degree {C} rank {rank}: {R} query rows, {computed} computed, {keys} key rows, {segments} segments")
        assert R <= computed < R + CHUNK * segments and computed < keys
