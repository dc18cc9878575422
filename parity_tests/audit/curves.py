"""The audit's three curves and the forward passes they are measured from.

`shift_curve` measures D(X, Δ1, Δ2) for each shift Δ1 (with the per-token and per-layer difference at
Δ1 = 0 and D_logit per shift) and `length_curve` D_logit against the sequence length, each window with as many
shifts in one call as fit the memory budget (`shifts_per_call`), on a `maps.MapsRunner`. `run_pairs` is the
same measurement through `jaxref.forward` with the audit's probe, whose numbers the runner's are bitwise, and
`restrict_vocab` cuts the logits' vocabulary to the tokens the windows use (the maps do not depend on it).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import jax.numpy as jnp
import numpy as np

from anchor_core.spec import ModelSpec
from jaxref import kernels
from jaxref.executor import forward
from jaxref.policy import DtypePolicy
from jaxref.reference import Params
from parity_tests.audit import metrics
from parity_tests.audit.maps import MAP_MEMORY_BUDGET, MEM_BYTES_PER_MAP_ENTRY, MapsRunner, make_probe
from parity_tests.audit.settings import AuditSettings

# ---------------------------------------------------------------------------------------------
# Probes and forward passes


def run_pairs(params: Params, spec: ModelSpec, tokens_nT: np.ndarray, shifts: Sequence[int], ref_shift: int,
              policy: DtypePolicy) -> dict[str, np.ndarray]:
    """One forward call: each of the `n` windows under `ref_shift` and every shift of `shifts`.

    Args: tokens_nT int [n, T]; shifts: S values. Returns float64 `col` and `first`, each [L, n, S, T].
    The maps are formed as the batched pass forms them (`maps.make_probe`: the fused kernel's probe
    where the user's switch allows the kernels and it covers the policy, else `maps.group_probe`).
    """
    n, T = tokens_nT.shape
    group = len(shifts) + 1
    deltas = np.asarray([ref_shift, *shifts], dtype=np.int64)
    tokens = np.repeat(tokens_nT, group, axis=0)
    positions = (np.arange(T, dtype=np.int64)[None, :] + np.tile(deltas, n)[:, None])
    doc_ids = np.ones_like(tokens, dtype=np.int32)
    fused = kernels.enabled()
    probe = make_probe(group, False, policy, fused)
    _, taps = forward(params, spec, tokens, positions=positions, doc_ids=doc_ids, variant="full",
                      policy=policy, probe=probe, fused=fused)
    return {k: np.asarray(v, np.float64) for k, v in taps["probe"].items()}


def shifts_per_call(spec: ModelSpec, T: int, n_shifts: int) -> int:
    """How many shifts (besides the reference) one call holds within the memory budget (≥ 1)."""
    per_elem = MEM_BYTES_PER_MAP_ENTRY * spec.num_heads * T * T
    return int(max(1, min(n_shifts, MAP_MEMORY_BUDGET // per_elem - 1)))


def restrict_vocab(params: Params, spec: ModelSpec, windows: Iterable[np.ndarray]) -> tuple[Params, Callable]:
    """Params whose embedding (and lm-head) keep only the rows the windows use, and the id map.

    The attention maps are unchanged (each used row is the same); only the unused logits go.
    """
    used = np.unique(np.concatenate([np.asarray(w).ravel() for w in windows]))
    out = dict(params)
    out["embed"] = jnp.asarray(np.asarray(params["embed"])[used])
    if not spec.tie_embeddings:
        out["lm_head"] = jnp.asarray(np.asarray(params["lm_head"])[used])
    return out, lambda toks: np.searchsorted(used, toks).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# The three curves


def shift_curve(params: Params, spec: ModelSpec, windows: np.ndarray, policy: DtypePolicy, shifts: Sequence[int],
                ref_shift: int, tick: Callable[[int], None] = lambda n: None, *,
                maps: MapsRunner | None = None) -> dict[str, Any]:
    """D(X, Δ1, ref) for each Δ1 (mean over windows), per-token and per-layer D at Δ1 = 0, D_logit per Δ1, and
    per Δ1 the first key token's share of the per-token difference (mean over windows).

    Each window goes through one call with the reference and every shift (as many shifts as fit in
    memory; `shifts_per_call`), on `maps` (a MapsRunner over the same params; one is made if None).

    Args: windows int [n, T] (already mapped to the params' vocabulary).
    """
    n, T = windows.shape
    shifts = list(shifts)
    maps = maps or MapsRunner(params, spec, background=False)
    k = shifts_per_call(spec, T, len(shifts))
    D = np.zeros((n, len(shifts)))
    d_logit = np.zeros((n, len(shifts)))
    first = np.zeros((n, len(shifts)))  # the first key token's share of the per-token difference, per shift
    per_token = np.zeros((n, T))
    by_layer = np.zeros((n, spec.num_layers))
    zero = shifts.index(0)
    for s in range(n):
        for c in range(0, len(shifts), k):
            chunk = shifts[c:c + k]
            padded = chunk + [chunk[-1]] * (k - len(chunk))  # one compiled shape per run
            r = maps.run(windows[s:s + 1], [ref_shift, *padded], policy)
            for b, delta in enumerate(chunk):
                col = r["col"][:, 0, b]  # [L, T]
                D[s, c + b] = metrics.d_from_colsums(col)
                d_logit[s, c + b] = metrics.d_logit_from_rows(r["first"][:, 0, b].sum(axis=0))
                pt = metrics.per_token_from_colsums(col)
                first[s, c + b] = pt[0] / pt.sum() if pt.sum() > 0 else 0.0
                if c + b == zero:
                    per_token[s] = metrics.per_token_from_colsums(col)
                    by_layer[s] = (col * metrics.column_norm(T)).sum(axis=1)
            tick(len(padded) + 1)
    return {
        "shifts": [int(x) for x in shifts], "ref_shift": int(ref_shift), "seq_len": int(T), "num_seqs": int(n),
        "D": D.mean(axis=0).tolist(), "D_per_seq": D.tolist(), "D_logit": d_logit.mean(axis=0).tolist(),
        "first_token_share": first.mean(axis=0).tolist(),
        "_per_token": per_token.mean(axis=0), "_by_layer": by_layer.mean(axis=0),
    }


def length_curve(params: Params, spec: ModelSpec, windows: np.ndarray, policy: DtypePolicy, lengths: Sequence[int],
                 delta1: int, delta2: int, tick: Callable[[int], None] = lambda n: None, *,
                 maps: MapsRunner | None = None) -> dict[str, Any]:
    """D_logit(Δ1, Δ2) for each length (≤ the windows' T), mean over windows.

    Only the first-key logits are probed (no T×T softmax or column sums): one call per window.
    """
    n, T = windows.shape
    maps = maps or MapsRunner(params, spec, background=False)
    vals = np.zeros((n, len(lengths)))
    for s in range(n):
        r = maps.run(windows[s:s + 1], [delta2, delta1], policy, first_only=True)
        rows = r["first"][:, 0, 0].sum(axis=0)  # [T]
        vals[s] = [metrics.d_logit_from_rows(rows, L) for L in lengths]
        tick(2)
    return {"lengths": [int(x) for x in lengths], "delta1": int(delta1), "delta2": int(delta2), "num_seqs": int(n),
            "D_logit": vals.mean(axis=0).tolist(), "D_logit_per_seq": vals.tolist()}


def _shift_programs(settings: AuditSettings, k: int) -> list[tuple[int, int, int, bool, int]]:
    """(B, T, group, first_only, max position) of each distinct call `shift_curve` makes (see its chunks)."""
    shifts, T = list(settings.shifts), settings.seq_len
    calls = []
    for c in range(0, len(shifts), k):
        chunk = shifts[c:c + k]
        padded = chunk + [chunk[-1]] * (k - len(chunk))
        call = (k + 1, T, k + 1, False, T - 1 + max(settings.ref_shift, *padded))
        if call not in calls:
            calls.append(call)
    return calls
