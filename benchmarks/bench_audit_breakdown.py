"""Where the default `anchor audit`'s time goes: its forward calls against their matrix products.

    .venv/bin/python benchmarks/bench_audit_breakdown.py [--out results/audit/audit_breakdown_cpu.json]

benchmarks/bench_audit_speed.py times the whole command against its matmul floor; this one takes the
calls apart, in one process, on SmolLM2 with the audit's own windows and programs (parity_tests/audit/maps.py):

  shift call     one window of 256 under the reference and the 19 shifts (B = 20 sequences, 5120 tokens),
                 per default policy, timed as the audit runs it (`maps`), and as the same decoder with
                 the attention replaced by v (`projections`: embedding, norms, q/k/v/o projections,
                 RoPE, MLP and the policy's roundings; no q·kᵀ, softmax, p·v or probe);
  length call    one window of 1024 under two shifts, first-key logits only (per policy);
  error budget   its 33 policies' calls (one window of 128 under two shifts each), compiled and run as
                 one program per policy and as the groups that share a program (parity_tests.audit.budget.budget_groups);
  floor          each call's matrix products (bench_audit_speed.audit_forward_flop) at the best rate
                 measured here at the call's MLP shape, of XLA's jitted matmul and numpy's BLAS
                 (`floor_s`, as bench_audit_speed's floor), and at XLA's (`floor_s_xla`); fp32, fp64
                 for a policy whose `act` is fp64;
  compile        seconds to compile each program with no cache, and the first call's extra seconds
                 over the later ones (the audit runs each length program once).

No result is asserted: the numbers say which part of the audit's wall time is matrix products at XLA's
rate, which part is XLA's rate below BLAS's, and which is everything else.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_audit_speed import _rate, audit_forward_flop, matmul_gflops  # noqa: E402


def _projections(params, tokens, pos, *, spec, policy, fused):
    """The audit's decoder with attention replaced by v: what is left is projections, norms and RoPE
    (the projections where the audit runs them: numpy's BLAS on the CPU with `fused`)."""
    import jax
    import jax.numpy as jnp

    from jaxref import rope as rope_lib
    from jaxref.executor import linear
    from jaxref.reference import rms_norm, silu_mul

    act, param, norm = policy.dtype("act"), policy.dtype("param"), policy.dtype("norm")
    N, K, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    cos, sin = rope_lib.rope_tables(spec.rope, spec.head_dim, pos, policy)
    h = params["embed"].astype(param)[tokens].astype(act)
    B, T, _ = h.shape

    def layer(h, lp):
        x = rms_norm(h, lp["attn_norm"], spec.rms_norm_eps, norm, act, param)
        q = linear(x, lp["wq"], lp.get("bq"), act, param, fused).reshape(B, T, N, D)
        k = linear(x, lp["wk"], lp.get("bk"), act, param, fused).reshape(B, T, K, D)
        v = linear(x, lp["wv"], lp.get("bv"), act, param, fused).reshape(B, T, K, D)
        q = rope_lib.apply(q, cos, sin, spec.rope.layout, policy.dtype("rope_apply"))
        k = rope_lib.apply(k, cos, sin, spec.rope.layout, policy.dtype("rope_apply"))
        ctx = jnp.repeat(v, N // K, axis=2).astype(act)
        h = (h + linear(ctx.reshape(B, T, N * D), lp["wo"], None, act, param, fused)).astype(act)
        x = rms_norm(h, lp["mlp_norm"], spec.rms_norm_eps, norm, act, param)
        m = silu_mul(linear(x, lp["w_gate"], None, act, param, fused), linear(x, lp["w_up"], None, act, param, fused), act)
        h = (h + linear(m, lp["w_down"], None, act, param, fused)).astype(act)
        return h, (q[:, :, 0, 0].astype(jnp.float32).sum() + k[:, :, 0, 0].astype(jnp.float32).sum())  # q, k live

    return jax.lax.scan(layer, h, params["layers"])[1]


def _timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(first call's seconds, later calls' seconds)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    later = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        later.append(time.perf_counter() - t0)
    return first, later


def budget_programs(MapsRunner, params, spec, policies, w, ref: int) -> dict:
    """The error budget's calls compiled and run as one program per policy and as `budget_groups`
    (several policies per program), each from nothing; whether every policy's outputs are equal."""
    import numpy as np

    from parity_tests.audit.budget import budget_groups
    from parity_tests.audit.maps import batch_inputs

    n, T = w.shape
    _, positions, _ = batch_inputs(w, np.asarray([ref, 0]))
    out, results = {}, {}
    for label, groups in (("one program per policy", [(p,) for p in policies]),
                          ("grouped (budget_groups)", budget_groups(spec, policies, T, n))):
        maps = MapsRunner(params, spec, background=False)
        t0 = time.perf_counter()
        for g in groups:
            maps.program(g if len(g) > 1 else g[0], 2 * n, T, 2, False, int(positions.max()))
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = [r for g in groups for r in (maps.run_many(w, [ref, 0], g) if len(g) > 1 else [maps.run(w, [ref, 0], g[0])])]
        run_s = time.perf_counter() - t0
        results[label] = res
        out[label] = {"programs": len(groups), "compile_s": round(compile_s, 2), "run_s": round(run_s, 2)}
        print(label, out[label], flush=True)
    a, b = results.values()
    out["policies"] = len(policies)
    out["bitwise_equal"] = all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results/audit/audit_breakdown_cpu.json"))
    ap.add_argument("--repeats", type=int, default=2, help="timed calls after the first (default 2)")
    args = ap.parse_args()

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_enable_compilation_cache", False)  # compile times are measured
    from anchor_core.machine import machine
    from anchor_core.weights import load_weights
    from parity_tests.audit import runner
    from parity_tests.audit.budget import budget_plan, budget_runs
    from parity_tests.audit.maps import MapsRunner, batch_inputs
    from jaxref import kernels
    from jaxref.reference import params_from_state
    from jaxref.policy import get_policy

    spec, state = load_weights("default")
    settings, _, _ = runner.resolve_settings(spec, runner.AuditSettings())
    windows = runner._audit_windows("default", None, settings, spec, [])
    params, remap = runner.restrict_vocab(params_from_state(spec, state), spec,
                                          [windows.shift, windows.length, windows.budget])
    spec_d = dataclasses.asdict(spec)
    maps = MapsRunner(params, spec, background=False)
    ref = settings.ref_shift

    rates: dict[str, dict[str, float]] = {}

    def rate_at(M: int, dt: str) -> dict[str, float]:
        """GFLOP/s of XLA and numpy at [M, H] x [H, F] in dtype dt (cached per shape)."""
        key = f"{dt} M={M}"
        if key not in rates:
            a = np.random.default_rng(0).standard_normal((M, spec.hidden_size)).astype(dt)
            b = np.random.default_rng(1).standard_normal((spec.hidden_size, spec.intermediate_size)).astype(dt)
            ja, jb = jnp.asarray(a), jnp.asarray(b)
            f = jax.jit(lambda x, y: x @ y)
            flop = 2 * M * spec.hidden_size * spec.intermediate_size
            rates[key] = {"xla": round(_rate(lambda: f(ja, jb).block_until_ready(), flop), 1),
                          "numpy_blas": round(_rate(lambda: a @ b, flop), 1)}
        return rates[key]

    def one(kind: str, pol, toks: np.ndarray, deltas: list[int], first_only: bool, with_projections: bool) -> dict:
        tokens, positions, _ = batch_inputs(toks, np.asarray(deltas))
        B, T = tokens.shape
        t0 = time.perf_counter()
        maps.program(pol, B, T, len(deltas), first_only, int(positions.max()))
        compile_s = time.perf_counter() - t0
        first, later = _timed(lambda: maps.run(toks, deltas, pol, first_only=first_only), args.repeats)
        dt = "float64" if pol.act == "float64" else "float32"
        r = rate_at(B * T, dt)
        flop = B * audit_forward_flop(spec_d, T)
        row = {"call": kind, "policy": pol.name, "B": B, "T": T, "tflop": round(flop / 1e12, 4),
               "compile_s": round(compile_s, 2), "first_call_s": round(first, 2),
               "call_s": round(statistics.median(later), 2),
               "floor_s": round(flop / max(r.values()) / 1e9, 2), "floor_s_xla": round(flop / r["xla"] / 1e9, 2)}
        if with_projections:
            prog = jax.jit(partial(_projections, spec=spec, policy=pol, fused=kernels.enabled()))
            args_ = (params, jnp.asarray(tokens), jnp.asarray(positions))
            prog(*args_).block_until_ready()
            _, later_p = _timed(lambda: prog(*args_).block_until_ready(), args.repeats)
            row["projections_s"] = round(statistics.median(later_p), 2)
            row["attention_and_probe_s"] = round(row["call_s"] - row["projections_s"], 2)
        row["call_over_floor"] = round(row["call_s"] / row["floor_s"], 2)
        row["call_over_floor_xla"] = round(row["call_s"] / row["floor_s_xla"], 2)
        print(json.dumps(row), flush=True)
        return row

    gflops_before = matmul_gflops()
    rows = []
    shift_deltas = [ref, *settings.shifts]
    for name in runner.DEFAULT_POLICIES:
        pol = get_policy(name)
        rows.append(one("shift", pol, remap(windows.shift[:1]), shift_deltas, False, True))
        rows.append(one("length", pol, remap(windows.length[:1]), [ref, 0], True, False))
    budget = budget_runs(budget_plan(get_policy(settings.budget_policy or "hf_bf16")))
    record_budget = budget_programs(MapsRunner, params, spec, budget, remap(windows.budget), ref)
    record = {
        "benchmark": __doc__.splitlines()[0],
        "note": " ".join(__doc__.split("\n\n")[1].split()),
        "calls": rows,
        "error_budget": record_budget,
        "matmul_gflops": rates,
        "machine": machine(matmul_gflops_before=gflops_before, matmul_gflops_after=matmul_gflops(),
                           note="matmul_gflops: XLA's fp32 matmul at SmolLM2's MLP shape before and after"),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
