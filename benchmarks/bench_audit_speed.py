"""Wall time of the default `anchor audit` on SmolLM2, and its audit.json against a reference one.

    .venv/bin/python benchmarks/bench_audit_speed.py [--reference results/audit_smollm2_cpu.json]
        [--out results/audit/audit_speed_cpu.json] [--audit-out DIR] [--warm 1] [--baseline-jaxref DIR]
    .venv/bin/python benchmarks/bench_audit_speed.py --quick      # `anchor audit --quick`, the CI audit
        (-> results/audit/audit_quick_speed_cpu.json; no reference: its numbers are only recorded)

    git archive COMMIT jaxref | tar -x -C /tmp/base       # an older oracle, for --baseline-jaxref /tmp/base

Runs the console script exactly as a user would (`anchor audit --out DIR`, every option at its default,
in its own process: imports, weight loading, compiling and writing included), first with an empty JAX
compilation cache (a fresh checkout), then `--warm` more times with the cache the first run filled
(a second audit on the same machine); with --baseline-jaxref, that oracle first, in the same
session (the cores are shared: compare runs of one session). Records for each run:
  wall_s, cpu_s        the command's wall time and CPU seconds (user + system of the child process)
  phases               the wall time of each phase, from the arrival of the progress lines the audit
                       logs to a pipe
  load_average_*       before and after the run
  comparison           for every number of audit.json (machine, timings and notes aside) its largest
                       absolute and relative difference against the reference audit.json, per top-level
                       key, how many numbers differ at all, and whether all are bitwise equal
  vs_baseline          with --baseline-jaxref: the same comparison against the baseline run's audit.json
                       (the baseline code's numbers, from this session)
and for the whole: machine (anchor_core.machine, with `matmul_gflops` before and after: an fp32 matmul of
SmolLM2's MLP shape, a measure of what the shared cores gave), and vs_committed: the same comparison
against results/audit_smollm2_random_init_cpu/audit.json (an older oracle, with --random-init).
The reference is the default audit's audit.json as an older oracle wrote it (results/audit_smollm2_cpu.json):
a faster audit must give the same numbers. The limit is LIMIT_S.
`ratios`: each run's wall time over the matmul floor measured in the same session (`matmul_floor`, at the
best rates measured; the target is 1.25x), over the floor at XLA's own matmul rates (what the oracle's
projections would reach without numpy's BLAS on the CPU, `jaxref.kernels.matmul`), over the run's own floor at the rates measured just before and after it
(`floor_around_s`; the rates, `matmul_rates`, are measured before the first run and after each), and
over the products alone at the audit's own shapes (`products_at_shapes`: each projection timed alone
through the oracle's BLAS kernel at the batch the audit runs it, measured before the first run and
after the last, the faster kept; `products_at_shapes_over_floor` is how far those shapes fall short of
the MLP shape's rate, the part of the floor ratio no overhead cut removes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LIMIT_S = 120.0
SKIP = {"machine", "runtime_s", "notes", "findings"}


def numbers(a, b, path: str = ""):
    """(path, a, b) for every number in both JSON values at the same place."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if k in b and not (path == "" and k in SKIP):
                yield from numbers(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from numbers(x, y, f"{path}[{i}]")
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        yield path, float(a), float(b)


def compare(new: dict, ref: dict) -> dict:
    """Per top-level key: numbers compared, how many differ, the largest absolute and relative difference."""
    out: dict[str, dict] = {}
    for path, a, b in numbers(new, ref):
        top = path.split("/")[1]
        e = out.setdefault(top, {"numbers": 0, "differ": 0, "max_abs_diff": 0.0, "max_rel_diff": 0.0, "worst": None})
        e["numbers"] += 1
        d = abs(a - b)
        if d > 0:
            e["differ"] += 1
            rel = d / max(abs(a), abs(b))
            if rel > e["max_rel_diff"]:
                e["worst"] = {"path": path, "new": a, "reference": b}
            e["max_abs_diff"] = max(e["max_abs_diff"], d)
            e["max_rel_diff"] = max(e["max_rel_diff"], rel)
    return out


def matmul_gflops(seconds: float = 1.0) -> float:
    """GFLOP/s of a jitted fp32 [4096,576]x[576,1536] matmul (SmolLM2's MLP shape) in this process."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((4096, 576), jnp.float32)
    w = jnp.ones((576, 1536), jnp.float32)
    f = jax.jit(lambda x, w: x @ w)
    return round(_rate(lambda: f(x, w).block_until_ready(), 2 * 4096 * 576 * 1536, seconds), 1)


def _rate(fn, flop: float, seconds: float = 1.0) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return flop * n / (time.perf_counter() - t0) / 1e9


def audit_forward_flop(spec: dict, T: int) -> float:
    """Matrix-product FLOPs of one audit forward of one sequence of T tokens (spec: ModelSpec as a dict):
    every layer's q/k/v projections and causal q·kᵀ, every layer but the last's p·v, o-projection and MLP
    (the last layer's come after its attention map); no lm-head."""
    H, F, L = spec["hidden_size"], spec["intermediate_size"], spec["num_layers"]
    N, K, D = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    qkv = 2 * H * (N * D + 2 * K * D)
    o_mlp = 2 * (N * D * H + 3 * H * F)
    return T * (L * qkv + (L - 1) * o_mlp) + L * 2 * 2 * N * D * T * (T + 1) / 2 - 2 * N * D * T * (T + 1) / 2


def matmul_rates() -> dict[str, dict[str, float]]:
    """GFLOP/s now of XLA's jitted matmul and numpy's BLAS at SmolLM2's MLP shape, fp32 and fp64 (1 s each)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    M, K, N = 4096, 576, 1536
    rates = {}
    for dt in ("float32", "float64"):
        a, b = np.ones((M, K), dt), np.ones((K, N), dt)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        f = jax.jit(lambda x, y: x @ y)
        flop = 2 * M * K * N
        rates[dt] = {"xla": round(_rate(lambda: f(ja, jb).block_until_ready(), flop), 1),
                     "numpy_blas": round(_rate(lambda: a @ b, flop), 1)}
    return rates


def mean_rates(a: dict, b: dict) -> dict[str, dict[str, float]]:
    """The mean of two `matmul_rates` measurements, per dtype and implementation."""
    return {dt: {k: round((a[dt][k] + b[dt][k]) / 2, 1) for k in a[dt]} for dt in a}


def audit_flop(audit: dict) -> tuple[dict[str, float], float]:
    """The audit's matrix-product FLOPs per part ({"shift curves", "length curves", "error budget"}) and
    how many of them run in fp64."""
    from parity_tests.audit.budget import budget_plan, budget_runs
    from jaxref.policy import get_policy

    spec, st = audit["spec"], audit["settings"]
    n_pol = len(audit["policies"])
    fwd = {"shift curves": n_pol * st["num_seqs"] * (len(st["shifts"]) + 1) * audit_forward_flop(spec, st["seq_len"]),
           "length curves": n_pol * st["length_seqs"] * 2 * audit_forward_flop(spec, st["max_len"])}
    fp64 = 0.0
    if audit.get("error_budget"):
        runs = budget_runs(budget_plan(get_policy(st["budget_policy"])))
        one = st["budget_seqs"] * 2 * audit_forward_flop(spec, st["budget_seq_len"])
        fwd["error budget"] = one * len(runs)
        fp64 = one * sum(p.act == "float64" for p in runs)
    return fwd, fp64


def floor_at(audit: dict, rates: dict, impl: str | None = None) -> float:
    """Seconds of the audit's matrix products at `rates` (`matmul_rates`): the best implementation's rate
    per dtype, or `impl`'s ("xla", "numpy_blas")."""
    fwd, fp64 = audit_flop(audit)
    r32, r64 = (max(rates[dt].values()) if impl is None else rates[dt][impl] for dt in ("float32", "float64"))
    return round((sum(fwd.values()) - fp64) / r32 / 1e9 + fp64 / r64 / 1e9, 2)


def matmul_floor(audit: dict, rates: dict | None = None) -> dict:
    """The least time the audit's matrix products take on this machine: their FLOPs over the best rate measured.

    Counted: per token of every forward the audit runs, the q/k/v/o projections and the MLP of each layer
    (not the last layer's o-projection and MLP, which come after its attention map) and the causal half of
    q·kᵀ and p·v; not the lm-head (the audit has none), RoPE, norms, softmax, rounding or the probes.
    A forward's products run in fp64 when its `act` stage is fp64 (the error budget's raised policies),
    else in fp32 (16-bit operands are widened: jaxref.attention.wide_einsum). Rates: the best of XLA's
    jitted matmul and numpy's BLAS at SmolLM2's MLP shape, fp32 and fp64, measured now (or `rates`).
    """
    fwd, fp64 = audit_flop(audit)
    rates = rates or matmul_rates()
    return {"tflop": {k: round(v / 1e12, 3) for k, v in fwd.items()}, "tflop_total": round(sum(fwd.values()) / 1e12, 3),
            "tflop_in_fp64": round(fp64 / 1e12, 3), "matmul_gflops": rates,
            "floor_s": floor_at(audit, rates), "floor_s_at_xla_rates": floor_at(audit, rates, "xla"),
            "note": matmul_floor.__doc__.split("\n\n")[0].strip() + " " +
            " ".join(matmul_floor.__doc__.split("\n\n")[1].split())}


def audit_calls(audit: dict) -> dict[tuple[int, int, str, str], int]:
    """The product calls of one layer's projection the audit makes, as its programs make them:
    {(B, T, activation dtype, weight dtype): calls}. In numpy's BLAS (`jaxref.executor.blas_share_key`) a
    call's operands are the accumulator's dtype and B counts the rows of every policy sharing it (a
    shift call's window under every shift; a budget program's policies with the same key,
    `jaxref.executor.linear_many`, where the BLAS is position-exact, `jaxref.kernels.blas_position_exact`:
    else each policy's call is its own); a product the BLAS cannot run (fp64 weights under fp32
    activations) is one XLA call per policy in its own dtypes."""
    import math
    from collections import Counter
    from types import SimpleNamespace

    from jaxref import kernels
    from parity_tests.audit.budget import budget_groups, budget_plan, budget_runs
    from parity_tests.audit.runner import shifts_per_call
    from jaxref.executor import blas_share_key
    from jaxref.policy import get_policy

    share = kernels.blas_position_exact()

    spec, st = audit["spec"], audit["settings"]
    heads = SimpleNamespace(num_heads=spec["num_heads"])  # all that the call plan reads of the spec
    calls: Counter = Counter()

    def add(group, rows: int, T: int, n: int) -> None:
        """`n` runs of one program holding the policies `group` ([(act, param)]), `rows` rows each."""
        shared: Counter = Counter()
        for act, param in group:
            key = blas_share_key(act, param)
            if key is None:
                calls[(rows, T, str(act), str(param))] += n
            else:
                shared[key] += 1
        for (_, acc), m in shared.items():
            if share:
                calls[(rows * m, T, str(acc), str(acc))] += n
            else:
                calls[(rows, T, str(acc), str(acc))] += n * m

    S = len(st["shifts"])
    k = shifts_per_call(heads, st["seq_len"], S)
    for p in audit["policies"].values():
        add([(p["act"], p["param"])], k + 1, st["seq_len"], st["num_seqs"] * math.ceil(S / k))
        add([(p["act"], p["param"])], 2, st["max_len"], st["length_seqs"])
    if audit.get("error_budget"):
        runs = budget_runs(budget_plan(get_policy(st["budget_policy"])))
        for group in budget_groups(heads, runs, st["budget_seq_len"], st["budget_seqs"]):
            add([(p.act, p.param) for p in group], 2 * st["budget_seqs"], st["budget_seq_len"], 1)
    return dict(calls)


def products_at_shapes(audit: dict, rates: dict, reps: int = 5) -> dict:
    """The matmul floor at the audit's own shapes: the products `matmul_floor` counts, each projection
    timed alone as the audit runs it (`jaxref.executor.linear`: the oracle's BLAS kernel, or XLA where the
    BLAS cannot run it) at the shape and batch of its call (q|k|v of one x as one call, o, gate|up as
    one call, down, where the BLAS's calls are shared; else each alone; `audit_calls`), the best of
    `reps`; the causal q·kᵀ and p·v (inside the attention kernel, with the softmax) at `rates` (the
    accumulator's dtype).

    What the audit's products cost with nothing else around them: the floor at the MLP shape's rate
    (`matmul_floor`) is a rate the audit's smaller products (K = 576, 192-wide k and v, T = 128 budget
    calls) do not reach. None when the BLAS kernel is not available.
    """
    from functools import partial

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxref import kernels
    from jaxref.attention import wide
    from jaxref.executor import blas_share_key, linear

    if not kernels.blas_available():
        return {"seconds": None, "note": "jaxref's BLAS kernel is not available here: not measured"}
    jax.config.update("jax_enable_x64", True)
    spec = audit["spec"]
    H, F, L = spec["hidden_size"], spec["intermediate_size"], spec["num_layers"]
    N, K, D = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    rng = np.random.default_rng(0)
    shapes, proj, attn = [], 0.0, 0.0
    for (B, T, act, param), n in sorted(audit_calls(audit).items()):
        product = jax.jit(partial(linear, b_O=None, act=jnp.dtype(act), param=jnp.dtype(param), fused=True))

        def best(rows_in: int, cols: int) -> float:
            x = jnp.asarray(rng.standard_normal((B, T, rows_in)), act)
            w = jnp.asarray(rng.standard_normal((cols, rows_in)), param)
            product(x, w).block_until_ready()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                product(x, w).block_until_ready()
                ts.append(time.perf_counter() - t0)
            return min(ts)

        if blas_share_key(act, param) is not None and kernels.blas_position_exact():  # q|k|v, gate|up: a call each
            t = {"qkv": best(H, N * D + 2 * K * D), "o": best(N * D, H), "gate_up": best(H, 2 * F),
                 "down": best(F, H)}
        else:  # XLA, or a BLAS whose calls are not shared: each product alone
            t = {"qkv": best(H, N * D) + 2 * best(H, K * D), "o": best(N * D, H), "gate_up": 2 * best(H, F),
                 "down": best(F, H)}
        one = L * t["qkv"] + (L - 1) * (t["o"] + t["gate_up"] + t["down"])
        flop = 2 * B * T * (L * H * (N * D + 2 * K * D) + (L - 1) * (N * D * H + 3 * H * F))
        rate = max(rates[str(jnp.dtype(wide(act)))].values())
        qk_pv = B * (L * 2 * 2 * N * D * T * (T + 1) / 2 - 2 * N * D * T * (T + 1) / 2) / rate / 1e9
        proj += n * one
        attn += n * qk_pv
        shapes.append({"B": B, "T": T, "act": act, "param": param, "calls": n,
                       "ms": {k: round(v * 1e3, 3) for k, v in t.items()},
                       "projections_gflops": round(flop / one / 1e9, 1)})
    return {"seconds": round(proj + attn, 2), "projections_s": round(proj, 2), "attention_products_s": round(attn, 2),
            "per_shape": shapes, "note": " ".join(products_at_shapes.__doc__.split("\n\n")[0].split())}


def run_audit_cli(audit_out: Path, cache: Path, cwd: str, *, jaxref_dir: str | None = None,
                  options: tuple[str, ...] = ()) -> dict:
    """`anchor audit --out audit_out` in its own process with JAX's compilation cache in `cache`
    (or, with `jaxref_dir`, the jaxref package found there and no compilation cache): wall and CPU
    seconds, the phases (from the progress lines) and audit.json."""
    exe = Path(sys.executable).parent / "anchor"
    # stderr is a pipe, so the progress bar logs one line per phase with the seconds so far (wide: unwrapped)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "COLUMNS": "400"}
    extra = []
    if jaxref_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join([jaxref_dir, *filter(None, [os.environ.get("PYTHONPATH")])])
        env.pop("JAX_COMPILATION_CACHE_DIR")
        extra = ["--no-compile-cache"]
    load_before = [round(x, 2) for x in os.getloadavg()]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.Popen([str(exe), "audit", "--out", str(audit_out), *options, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    # each phase from the arrival of its line (seconds since the command started); the first phase
    # starts after imports, reading the weights and tokenizing ("setup"), the last ends with the
    # report written and the process gone
    phases, err = [{"phase": "setup (imports, weights, tokenizer, windows)", "started_s": 0.0}], []
    for line in proc.stderr:
        err.append(line)
        m = re.match(r"audit: (.*) \[\d+/\d+ forward passes, \d+ s\]", line.strip())
        if m:
            phases.append({"phase": m.group(1), "started_s": round(time.time() - t0, 1)})
    stdout = proc.stdout.read()
    rc = proc.wait()
    wall = time.time() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        raise SystemExit(f"anchor audit failed (exit {rc}): {stdout}{''.join(err[-5:])}")
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    phases[-1]["phase"] += ", then the report written"
    for a, b in zip(phases, phases[1:] + [{"started_s": wall}]):
        a["seconds"] = round(b["started_s"] - a["started_s"], 1)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "cores_used_on_average": round(cpu / wall, 2),
            "within_limit": wall <= LIMIT_S, "load_average_before": load_before,
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "phases": phases,
            "audit": json.loads((audit_out / "audit.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", default=None,
                    help="audit.json to compare with (default: results/audit_smollm2_cpu.json; "
                         "none with --quick)")
    ap.add_argument("--committed", default=None,
                    help="an older audit.json of the random-init audit, compared key by key (default: "
                         "results/audit_smollm2_random_init_cpu/audit.json; none with --quick)")
    ap.add_argument("--out", default=None, help="(default: results/audit/audit_speed_cpu.json, "
                                                "audit_quick_speed_cpu.json with --quick)")
    ap.add_argument("--quick", action="store_true", help="time `anchor audit --quick` (the audit for CI)")
    ap.add_argument("--model", default=None, help="--model of the audit (default: its default, SmolLM2)")
    ap.add_argument("--audit-out", default=None, help="keep the last audit's output here (default: a temporary folder)")
    ap.add_argument("--warm", type=int, default=1, help="runs after the first, with the compilation cache it filled")
    ap.add_argument("--baseline-jaxref", default=None,
                    help="a folder holding another version's jaxref package (`git archive COMMIT jaxref | tar -x -C DIR`): "
                         "run it first, in the same conditions, for a ratio measured in one session")
    args = ap.parse_args()
    results = ROOT / "results" / "audit"
    if not args.quick:
        args.reference = args.reference or str(ROOT / "results/audit_smollm2_cpu.json")
        args.committed = args.committed or str(ROOT / "results/audit_smollm2_random_init_cpu/audit.json")
    args.out = args.out or str(results / ("audit_quick_speed_cpu.json" if args.quick else "audit_speed_cpu.json"))
    options = (("--quick",) if args.quick else ()) + (("--model", args.model) if args.model else ())
    command = " ".join(["anchor audit --out DIR", *options])

    from anchor_core.machine import machine

    def rel(p: str) -> str:
        return str(Path(p).resolve().relative_to(ROOT)) if Path(p).resolve().is_relative_to(ROOT) else p

    ref = json.loads(Path(args.reference).read_text()) if args.reference else None

    def comparison_of(audit: dict) -> dict:
        if ref is None:
            return {"reference": None}
        per_key = compare(audit, ref)
        return {"reference": rel(args.reference), "bitwise_equal": all(v["differ"] == 0 for v in per_key.values()),
                "per_key": per_key}
    tmp = Path(tempfile.mkdtemp(prefix="bench_audit_speed-"))
    cache = tmp / "jax-cache"  # empty: the first run compiles everything, as on a fresh checkout
    gflops_before = matmul_gflops()
    measured = [matmul_rates()]  # the matmul rates before the first run and after each
    at_shapes = [products_at_shapes(ref, measured[0])] if ref else []  # the default audit's settings, as the runs'

    def around(r: dict, audit: dict) -> dict:
        """The rates measured just before and after run r, and its floor at their mean."""
        measured.append(matmul_rates())
        r["matmul_gflops_around"] = {"before": measured[-2], "after": measured[-1]}
        r["floor_around_s"] = floor_at(audit, mean_rates(measured[-2], measured[-1]))
        return r

    runs = []
    baseline_audit = None
    if args.baseline_jaxref:
        r = run_audit_cli(tmp / "baseline", cache, str(tmp), jaxref_dir=str(Path(args.baseline_jaxref).resolve()),
                          options=options)
        audit = baseline_audit = r.pop("audit")
        around(r, audit)
        runs.append({"label": f"baseline: the jaxref from {args.baseline_jaxref} (no compilation cache)",
                     **r, "comparison": comparison_of(audit)})
        print(json.dumps({k: runs[-1][k] for k in ("label", "wall_s", "cpu_s", "phases")}, indent=2), flush=True)
    for i in range(1 + args.warm):
        last = i == args.warm
        out = Path(args.audit_out) if (args.audit_out and last) else tmp / f"audit{i}"
        r = run_audit_cli(out, cache, str(tmp), options=options)
        audit = r.pop("audit")
        around(r, audit)
        r = {"label": "cold: empty compilation cache" if i == 0 else "warm: the programs from the cache the first "
                                                                     "run filled",
             **r, "runtime_s_reported_by_audit": round(audit["runtime_s"], 1), "comparison": comparison_of(audit)}
        if baseline_audit is not None:  # the same audit by the baseline code, in this session
            r["vs_baseline"] = compare(audit, baseline_audit)
        runs.append(r)
        print(json.dumps({k: r[k] for k in ("label", "wall_s", "cpu_s", "within_limit", "phases")}, indent=2))
        if ref is not None:
            print("bitwise equal to the reference:", r["comparison"]["bitwise_equal"], flush=True)
    new = [r for r in runs if not r["label"].startswith("baseline")]
    record = {
        "benchmark": (f"`{command}`" + ("" if options else " on SmolLM2, every option at its default")),
        "command": command,
        "settings": audit["settings"], "limit_s": LIMIT_S,
        "wall_s": new[0]["wall_s"], "cpu_s": new[0]["cpu_s"], "within_limit": new[0]["within_limit"],
        "warm_wall_s": new[-1]["wall_s"] if len(new) > 1 else None,
        "warm_cpu_s": new[-1]["cpu_s"] if len(new) > 1 else None,
        "runs": runs,
        "machine": machine(matmul_gflops_before=gflops_before, matmul_gflops_after=matmul_gflops(),
                           note="matmul_gflops: an fp32 matmul of SmolLM2's MLP shape timed before and after the "
                                "runs; with each run's load averages, it tells whether other work shared the cores"),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    best = {dt: {k: max(m[dt][k] for m in measured) for k in measured[0][dt]} for dt in measured[0]}
    record["matmul_floor"] = floor = matmul_floor(audit, best)
    floor["rates_note"] = (f"matmul_gflops: the best of the {len(measured)} measurements of the session (before the "
                           "first run and after each; each run's own are its matmul_gflops_around)")
    at_shapes.append(products_at_shapes(audit, best))  # before the first run (the reference's settings) and now
    shaped = min((a for a in at_shapes if a["seconds"]), key=lambda a: a["seconds"], default=at_shapes[-1])
    record["products_at_shapes"] = {**shaped, "measurements_s": [a["seconds"] for a in at_shapes]}
    timed = [("cold", new[0])] + ([("warm", new[-1])] if len(new) > 1 else [])
    record["ratios"] = {
        "note": "wall time over the matmul floor (floor_s: at the best rates measured in the session; the target: "
                "<= 1.25); over the floor at XLA's own matmul rates (floor_s_at_xla_rates: what the oracle's matmuls "
                "reach without its projections in numpy's BLAS, jaxref.kernels.matmul); over the run's "
                "floor at the mean of the rates measured just before and just after it (floor_around_s: the host's "
                "rate moves by 15-25% between minutes, so the best rate of the session may not be what the run had); "
                "and over the products alone at the audit's own shapes (products_at_shapes: what no cut of the other "
                "work removes; products_at_shapes_over_floor: how far those shapes fall short of the floor's rate)",
        **{f"{label}_over_floor{suffix}": round(r["wall_s"] / floor[key], 2) if floor[key] > 0 else None
           for label, r in timed for suffix, key in (("", "floor_s"), ("_at_xla_rates", "floor_s_at_xla_rates"))},
        **{f"{label}_over_floor_around": round(r["wall_s"] / r["floor_around_s"], 2) for label, r in timed},
        "products_at_shapes_over_floor": (round(shaped["seconds"] / floor["floor_s"], 2) if shaped["seconds"] else None),
        **{f"{label}_over_products_at_shapes": round(r["wall_s"] / shaped["seconds"], 2) if shaped["seconds"] else None
           for label, r in timed}}
    if args.committed and Path(args.committed).is_file():
        committed = json.loads(Path(args.committed).read_text())
        record["vs_committed"] = {
            "file": rel(args.committed),
            "note": "recorded by another version of the oracle and with --random-init: only the keys both "
                    "hold are compared, and differences are expected (it is not the same code)",
            "per_key": compare(audit, committed)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
