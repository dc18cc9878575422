"""The audit's batched maps-only pass (parity_tests/audit/maps.py) gives the numbers of the per-shift path.

The per-shift path is `jaxref.forward` with the audit's probe, one shift per call (`runner.run_pairs`
with a single shift): what the audit's arithmetic is defined by. The batched pass puts every shift
of a window in one call and stops at the maps. Where the arithmetic is the same it must be bitwise
equal; fp64 is the one policy whose matmul kernels sum in a batch-dependent order here, and there
the difference is held to the policy's own rounding, measured: in exact arithmetic a shift changes
nothing, so the fp64 differences between shifts are fp64 rounding alone, and a reordering of the
same fp64 sums may move the numbers by at most twice that (flash-attention's rule).
No timings here: speed is measured by benchmarks/bench_audit_speed.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxref
from parity_tests.audit import budget, runner
from parity_tests.audit.maps import MapsRunner

SHIFTS = [0, 2, 15, 17, 100, 2000]
REF = 16
T = 97  # odd on purpose: the row blocks of the attention overlap at the end


@pytest.fixture(scope="module")
def model():
    params, spec = jaxref.load_model("random:smollm2")
    rng = np.random.default_rng(0)
    toks = rng.integers(3, 259, size=(2, T)).astype(np.int32)
    toks[:, 0] = spec.first_token_id
    return params, spec, toks


def per_shift(params, spec, toks, policy):
    """`col` and `first` [L, n, S, T] from one `jaxref.forward` call per window and shift."""
    outs = [[runner.run_pairs(params, spec, toks[w:w + 1], [s], REF, policy) for s in SHIFTS]
            for w in range(toks.shape[0])]
    return {k: np.stack([np.concatenate([o[k][:, 0] for o in row], axis=1) for row in outs], axis=1)
            for k in ("col", "first")}


def batched(maps, toks, policy):
    """The same from one maps-only call per window with every shift batched."""
    outs = [maps.run(toks[w:w + 1], [REF, *SHIFTS], policy) for w in range(toks.shape[0])]
    return {k: np.concatenate([o[k] for o in outs], axis=1) for k in ("col", "first")}


@pytest.mark.parametrize("policy", [pytest.param("fp32", marks=pytest.mark.slow), "hf_bf16",  # make test: two
                                    pytest.param("fa2_bf16", marks=pytest.mark.slow),
                                    pytest.param("paper_bf16", marks=pytest.mark.slow), "sdpa_cpu_bf16",
                                    pytest.param("fp64", marks=pytest.mark.slow)])
def test_batched_shifts_equal_the_per_shift_path(model, policy):
    params, spec, toks = model
    pol = jaxref.get_policy(policy)
    maps = MapsRunner(params, spec, background=False)
    ref, new = per_shift(params, spec, toks, pol), batched(maps, toks, pol)
    for key in ("col", "first"):
        diff = np.abs(new[key] - ref[key])
        print(f"{policy} {key}: max |batched - per-shift| {diff.max():.3g} (values up to {np.abs(ref[key]).max():.3g})")
        if policy == "fp64":
            # fp64's own rounding: what a shift alone does to the same numbers (exactly 0 in exact arithmetic)
            own = np.abs(ref[key]).max()
            assert 0 < own < 1e-9
            assert diff.max() <= 2 * own
        else:
            np.testing.assert_array_equal(new[key], ref[key])


@pytest.mark.parametrize("policy", ["fp32", "hf_bf16", "paper_bf16", "fp64"])
def test_maps_only_pass_is_the_forward_with_the_probe(model, policy):
    """Same batch as `run_pairs` (all shifts in one jaxref.forward call): the same arithmetic, bitwise."""
    params, spec, toks = model
    pol = jaxref.get_policy(policy)
    maps = MapsRunner(params, spec, background=False)
    for w in range(toks.shape[0]):
        ref = runner.run_pairs(params, spec, toks[w:w + 1], SHIFTS, REF, pol)
        new = maps.run(toks[w:w + 1], [REF, *SHIFTS], pol)
        first_only = maps.run(toks[w:w + 1], [REF, *SHIFTS], pol, first_only=True)
        assert set(first_only) == {"first"}
        for key in ("col", "first"):
            np.testing.assert_array_equal(new[key], ref[key])
        np.testing.assert_array_equal(first_only["first"], ref["first"])


def test_each_program_compiles_once(model):
    """One program per (arithmetic, shape): the same call again, or a policy differing only in name, reuses it."""
    import dataclasses

    params, spec, toks = model
    maps = MapsRunner(params, spec)  # with the background compiler, as run_audit uses it
    pol = jaxref.get_policy("hf_bf16")
    maps.prefetch(pol, len(SHIFTS) + 1, T, len(SHIFTS) + 1, False, T - 1 + max(SHIFTS))
    a = maps.run(toks[:1], [REF, *SHIFTS], pol)
    b = maps.run(toks[1:], [REF, *SHIFTS], dataclasses.replace(pol, name="renamed"))
    assert len(maps._programs) == 1
    maps.run(toks[:1], [REF, *SHIFTS], pol, first_only=True)
    maps.run(toks[:1], [REF, 0], pol)
    assert len(maps._programs) == 3
    np.testing.assert_array_equal(a["col"], maps.run(toks[:1], [REF, *SHIFTS], pol)["col"])
    assert not np.array_equal(a["col"], b["col"])  # two windows, two results
    maps.close()


def test_budget_groups_are_the_programs_prefetched_and_run(model, monkeypatch):
    """error_budget evaluates its policies in `budget_runs` order, a group per program
    (`budget_groups`), and run_audit prefetches exactly those programs: nothing compiled twice."""
    params, spec, toks = model
    seen = []
    real = budget.d_pairs

    def record(params, spec, windows, policies, delta1, delta2, *, maps=None):
        seen.append(tuple(budget.policy_key(p) for p in policies))
        return real(params, spec, windows, policies, delta1, delta2, maps=maps)

    monkeypatch.setattr(budget, "d_pairs", record)
    base = jaxref.get_policy("hf_bf16")
    stages = ("act", "rope_apply", "logits")
    runs = budget.budget_runs(budget.budget_plan(base, stages))
    maps = MapsRunner(params, spec, background=False)
    budget.error_budget(params, spec, toks[:1, :41], base, 0, REF, stages=stages, maps=maps)
    assert [k for group in seen for k in group] == [budget.policy_key(p) for p in runs]
    groups = budget.budget_groups(spec, runs, 41, 1)
    assert len(seen) == len(groups) == -(-len(runs) // budget.BUDGET_POLICIES_PER_CALL) and len(groups) > 1
    ran = set(maps._programs)
    ahead = MapsRunner(params, spec)  # what run_audit's prefetch compiles for the same budget
    settings = runner.AuditSettings(budget_seq_len=41, budget_seqs=1, shifts=(0,), max_len=41, seq_len=41)
    runner._prefetch_programs(ahead, settings, 1, [], runs, 41)
    assert set(ahead._programs) == ran
    ahead.close()


def test_budget_groups_fit_the_memory_budget(model):
    """Long budget windows share programs only as far as their maps fit (one policy per call at worst)."""
    _, spec, _ = model
    runs = budget.budget_runs(budget.budget_plan(jaxref.get_policy("hf_bf16")))
    assert max(map(len, budget.budget_groups(spec, runs, 128, 1))) == budget.BUDGET_POLICIES_PER_CALL
    assert max(map(len, budget.budget_groups(spec, runs, 4096, 1))) == 1
    assert [p for g in budget.budget_groups(spec, runs, 1024, 2) for p in g] == runs


@pytest.mark.parametrize("stages", [("act", "rope_apply", "logits", "softmax")])
@pytest.mark.slow  # minutes of CPU: make test-all
def test_policies_sharing_a_program_give_their_own_numbers(model, stages):
    """run_many (one program for several policies) equals run (one program each), bitwise, per policy."""
    params, spec, toks = model
    runs = budget.budget_runs(budget.budget_plan(jaxref.get_policy("fa2_bf16"), stages))
    maps = MapsRunner(params, spec, background=False)
    together = maps.run_many(toks[:1], [REF, 0, 2000], tuple(runs))
    assert len(together) == len(runs) > 4
    for p, r in zip(runs, together):
        alone = maps.run(toks[:1], [REF, 0, 2000], p)
        for key in ("col", "first"):
            np.testing.assert_array_equal(r[key], alone[key])
    assert not np.array_equal(together[0]["col"], together[1]["col"])  # the policies differ


def test_shift_programs_cover_every_call(model):
    """The prefetch list of the shift curve names exactly the calls shift_curve makes (chunks padded)."""
    _, spec, _ = model
    settings = runner.AuditSettings(seq_len=T, shifts=tuple(SHIFTS))
    for k in (1, 2, 4, len(SHIFTS)):
        calls = runner._shift_programs(settings, k)
        assert all(c[0] == k + 1 and c[1] == T and not c[3] for c in calls)
        # each chunk's largest position: T - 1 + the largest shift in it (or the reference)
        chunks = [SHIFTS[c:c + k] for c in range(0, len(SHIFTS), k)]
        assert sorted({c[4] for c in calls}) == sorted({T - 1 + max(REF, *ch) for ch in chunks})


@pytest.mark.slow  # minutes of CPU: make test-all
def test_compile_cache_gives_the_same_audit(tmp_path):
    """`anchor audit` keeps its compiled programs under <cache>/jax: a second run reads them (no new
    entries) and writes the same audit.json bit for bit; --no-compile-cache writes none. In their own
    processes, with the cache folder in tmp_path (JAX sets its cache up once per process)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Rotary embeddings rotate pairs. " * 9,
                                                                      "def f(x):\n    return x * 2\n" * 10]))
    exe = Path(sys.executable).parent / "anchor"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["ANCHOR_CACHE"] = str(tmp_path / "cache")  # random:llama needs nothing from the real cache
    argv = [str(exe), "audit", "--model", "random:llama", "--policies", "hf_bf16", "--quick", "--seq-len", "33",
            "--max-len", "64", "--data", str(data), "--no-progress"]
    cache = tmp_path / "cache" / "jax"

    def run(out, *extra):
        r = subprocess.run([*argv, "--out", str(tmp_path / out), *extra], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads((tmp_path / out / "audit.json").read_text())

    def entries():
        return sorted(p.name for p in cache.glob("*-cache")) if cache.is_dir() else []

    first = run("a")
    filled = entries()
    print(f"{len(filled)} programs cached")
    assert filled
    second = run("b")
    assert entries() == filled  # every program came from the cache
    for key in ("shift_curve", "per_token", "length_curve"):
        assert second[key] == first[key]
    third = run("c", "--no-compile-cache")
    assert entries() == filled and third["shift_curve"] == first["shift_curve"]


@pytest.mark.parametrize("policy", ["fp32", "hf_bf16", "paper_bf16"])
def test_kernel_probe_forms_the_maps_of_the_jax_probe(model, policy):
    """The C++ probe (maps.KernelProbe, what the audit runs on the CPU) against the JAX probe on the
    same q and k of a real forward (first and last layer, a window under every shift): it differs
    from the JAX probe by at most twice what the JAX probe's own fp32 arithmetic does (the same
    probe with q·kᵀ's accumulation and the softmax in fp64, the logits rounded as the policy rounds them)."""
    import jax
    import jax.numpy as jnp

    from jaxref import kernels
    from jaxref.attention import full_probs
    from parity_tests.audit.maps import KernelProbe, batch_inputs, group_probe

    if not kernels.available():
        pytest.skip("no C++ compiler: the kernel is not built")
    params, spec, toks = model
    pol = jaxref.get_policy(policy)
    deltas = [REF, *SHIFTS]
    tokens, positions, doc = batch_inputs(toks[:1], np.asarray(deltas))
    _, taps = jaxref.forward(params, spec, tokens, positions=positions, doc_ids=doc, policy=pol, taps=True)
    scale, G = spec.head_dim ** -0.5, len(deltas)

    def jax_probe(p):
        return jax.jit(lambda q, k: group_probe(G)(*full_probs(q, k, jnp.asarray(doc), "full", p, scale)))

    kernel = jax.jit(lambda q, k: KernelProbe(G, False, pol)(q, k, scale))
    wide = pol.with_stages(qk_acc="float64", softmax="float64")
    for layer in (0, spec.num_layers - 1):
        q, k = taps["q"][layer], taps["k"][layer]
        got, ref, hi = kernel(q, k), jax_probe(pol)(q, k), jax_probe(wide)(q, k)
        for key in ("col", "first"):
            g, r, h = (np.asarray(x[key]) for x in (got, ref, hi))
            own = np.abs(r - h).max()
            print(f"{policy} layer {layer} {key}: |kernel - JAX| {np.abs(g - r).max():.3g}, JAX fp32 vs fp64 "
                  f"arithmetic {own:.3g}, values up to {np.abs(r).max():.3g}")
            assert g.shape == r.shape and np.abs(r).max() > 0
            assert np.abs(g - r).max() <= 2 * own + 1e-12 * np.abs(r).max()


# make test-all only (the CI budget on 2 cores): 24 s; the audit's own speed paths stay in make test
@pytest.mark.slow
def test_the_speed_benchmark_replays_the_calls_the_audit_makes(monkeypatch):
    """benchmarks/bench_audit_speed.py times the audit's products alone at the shapes the audit runs
    them (`products_at_shapes`); its call plan (`audit_calls`: rows of one call, length, operand dtypes)
    must be the calls the audit's programs make. Observed here, per program traced: its q|k|v products,
    in the BLAS (`jaxref.kernels.matmul`) or in XLA (`jaxref.executor.linear` where the BLAS cannot run
    them: fp64 weights under fp32 activations in the error budget), times the program's runs."""
    import sys
    import threading
    from collections import Counter
    from pathlib import Path

    import jax.numpy as jnp

    from jaxref import kernels
    from jaxref import executor

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_audit_speed

    tracing, traced, runs = threading.local(), {}, Counter()  # programs compile on the runner's thread
    matmul, linear, compile_, program = kernels.matmul, executor.linear, MapsRunner._compile, MapsRunner.program

    def record(x, w, act, param):
        traced.setdefault(tracing.key, Counter())[(x.shape[0], x.shape[1], w.shape[0], str(jnp.dtype(act)),
                                                   str(jnp.dtype(param)))] += 1

    def record_matmul(x, w):
        record(x, w, x.dtype, w.dtype)
        return matmul(x, w)

    def record_linear(x, w, b, act, param, fused=False):
        if not executor._blas_ok(act, param, fused):
            record(x, w, act, param)
        return linear(x, w, b, act, param, fused)

    def record_compile(self, policy, B, T, group, first_only, seq_len):
        tracing.key = self._key(policy, B, T, group, first_only, seq_len)
        return compile_(self, policy, B, T, group, first_only, seq_len)

    def record_program(self, policy, B, T, group, first_only, max_pos, *, wait=True):
        if wait:  # run / run_many: one execution
            runs[self._key(policy, B, T, group, first_only, self._seq_len(max_pos))] += 1
        return program(self, policy, B, T, group, first_only, max_pos, wait=wait)

    monkeypatch.setattr(kernels, "matmul", record_matmul)
    monkeypatch.setattr(executor, "linear", record_linear)
    monkeypatch.setattr(MapsRunner, "_compile", record_compile)
    monkeypatch.setattr(MapsRunner, "program", record_program)
    audit = runner.run_audit("random:smollm2", ("fp32", "hf_bf16"), seq_len=41, num_seqs=2, shifts=(0, 2, 17),
                             max_len=64, budget_seq_len=33, budget_seqs=1)
    sp = audit["spec"]
    kv = sp["num_kv_heads"] * sp["head_dim"]
    qkv = sp["num_heads"] * sp["head_dim"] + 2 * kv
    assert kv not in (qkv, sp["num_heads"] * sp["head_dim"], sp["hidden_size"], sp["intermediate_size"])
    seen: Counter = Counter()
    for key, n in runs.items():
        for (rows, T, width, act, param), m in traced[key].items():
            if width == qkv:  # q|k|v in one BLAS call
                seen[(rows, T, act, param)] += n * m
            elif width == kv:  # XLA: q, k and v apart; k and v have this width
                assert m % 2 == 0
                seen[(rows, T, act, param)] += n * m // 2
    assert audit["error_budget"] and sum(seen.values()) > 4
    assert any(a == p == "float64" for _, _, a, p in seen)  # BLAS fp64 calls of the budget's raised policies
    assert any(executor.blas_share_key(a, p) is None for _, _, a, p in seen)  # and an XLA one
    assert bench_audit_speed.audit_calls(audit) == dict(seen)
