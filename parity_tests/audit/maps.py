"""The audit's forward pass: the decoder up to the attention maps, all shifts of a window in one call.

Legend: L layers, B = windows × shifts in one call, G shifts per window (the reference first),
T slots, N query heads.

`jaxref.forward(..., probe=...)` runs the whole decoder and hands each layer's maps to a probe. The
audit reads nothing but the maps, so this pass is the same decoder (`jaxref.executor.decoder_layer`
under one `lax.scan`, op for op) without what comes after them:

  * no final norm and no lm-head (the logits are never read);
  * the length curve (`first_only=True`) keeps only the logits towards key 0 (A_i0): no softmax
    and no T×T column sums; the JAX probe still forms q·kᵀ whole (so each A_i0 is the same
    number), the kernel's only the scores of the first panel of keys (each score is its own dot
    product there, the same number either way);
  * every shift of a window goes through one call with a leading batch axis ([B, T] =
    windows × G, window-major), compiled once per (arithmetic, shape) and kept; `prefetch`
    compiles the programs an audit will need on a background thread while the current one runs;
  * several policies on the same inputs can share one program (`run_many`: the error budget's
    policies, a few programs instead of one per policy; each policy's numbers unchanged).
  * on the CPU the maps of the policies the kernel covers (fp32 softmax, bf16/fp32 logits) are
    formed and reduced in the fused C++ kernel (`KernelProbe`), never as [B, N, T, T] arrays.

What a shift cannot change is shared by construction: tokens, the embedding lookup and the mask
are the same for every shift (only `positions`, hence the RoPE tables, differ), and the vocabulary
is cut to the tokens used (`runner.restrict_vocab`). Not cut, because the numbers would move: the
last layer's p·v and MLP (run inside the scan; computed apart, XLA fused the fp32 norm into the q/k
matmuls differently and the last layer's fp32 maps changed), layer 0's q/k/v projections per
window rather than per shift, and several windows per call (the matmul kernels sum in an order that
depends on the batch: fa2_bf16 and paper_bf16 moved): about 3%, under 1% and none of the work.
The results are bitwise those of `jaxref.forward` with the same probe (`make_probe`: `runner.run_pairs`;
tests/audit/test_audit_speed.py), and the kernel's probe is the JAX probe's numbers up to rounding.
Like `jaxref.forward`, a runner resolves the fused-kernel switch once (`fused`, default the user's
`JAXREF_FUSED_ATTENTION`) and passes it to every program it compiles.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from anchor_core.spec import ModelSpec
from jaxref import kernels
from jaxref import rope as rope_lib
from jaxref.attention import full_probs
from jaxref.executor import decoder_layer, layer_steps, layers_in_step
from jaxref.policy import DtypePolicy
from jaxref.reference import Params

# Working memory one forward call may take for its attention maps and probe (batch sizing).
MEM_BYTES_PER_MAP_ENTRY = 40
"""Bytes per attention-map entry (per head, query row and key) one forward call may take: sizes the
shifts per call, the length curve's longest T, the error budget's groups and the up-front memory checks."""
MAP_MEMORY_BUDGET = 1.5e9
"""Bytes of attention maps one forward call may hold (the shifts or budget policies it takes at once)."""


@lru_cache(maxsize=None)
def group_probe(group: int, first_only: bool = False) -> Callable[[jax.Array, jax.Array], dict[str, jax.Array]]:
    """The probe of `n` groups of `group` batch elements, element 0 of each group the reference.

    Returns per layer `first` [n, group-1, T] = Σ_h |A_i0 − A_ref,i0| (per query row i) and,
    unless `first_only`, `col` [n, group-1, T] = Σ_h Σ_i |P_ij − P_ref,ij|; float64. Cached, so
    that `jax.jit` (where the probe is a static argument, as in `jaxref.forward`) sees one function
    per size.
    """

    def probe(scores_BNTS, probs_BNTS):
        B, N, T, S = scores_BNTS.shape
        a = scores_BNTS[..., 0].astype(jnp.float64).reshape(B // group, group, N, T)
        out = {"first": jnp.abs(a[:, 1:] - a[:, :1]).sum(axis=2)}
        if not first_only:
            p = probs_BNTS.reshape(B // group, group, N, T, S)
            out["col"] = jnp.abs(p[:, 1:] - p[:, :1]).astype(jnp.float64).sum(axis=(2, 3))
        return out

    return probe


@dataclass(frozen=True)
class KernelProbe:
    """`group_probe` computed by the C++ kernel (`jaxref.kernels.audit_probe`) on the CPU, from q and k.

    The maps are formed and reduced inside the kernel, block by block, instead of as [B, N, T, T]
    arrays in XLA (whose elementwise passes over them are memory-bound); on other platforms the
    JAX probe runs. The same numbers up to rounding (tests/audit/test_audit_speed.py). For policies
    whose maps the kernel forms (`covers`): fp32 q·kᵀ accumulation and softmax, operands and logits
    fp32 or bf16. Variant `full`, one document per window (the audit's).
    """

    group: int
    first_only: bool
    policy: DtypePolicy
    reads_qk: ClassVar[bool] = True  # jaxref.executor.decoder_layer hands it (q, k, scale) instead of the maps

    @staticmethod
    def covers(policy: DtypePolicy) -> bool:
        return (policy.qk_in in ("float32", "bfloat16") and policy.qk_acc == "float32"
                and policy.logits in ("float32", "bfloat16") and policy.softmax == "float32")

    def __call__(self, q, k, scale: float) -> dict[str, jax.Array]:
        qk_in, policy, group, first_only = self.policy.dtype("qk_in"), self.policy, self.group, self.first_only

        def cpu(q, k):
            first, col = kernels.audit_probe(q.astype(qk_in), k.astype(qk_in), group, scale,
                                             logits_bf16=policy.logits == "bfloat16", first_only=first_only)
            return {"first": first} if first_only else {"first": first, "col": col}

        def default(q, k):
            B, T = q.shape[:2]
            s, p = full_probs(q, k, jnp.ones((B, T), jnp.int32), "full", policy, scale)
            return group_probe(group, first_only)(s, p)

        return jax.lax.platform_dependent(q, k, cpu=cpu, default=default)


def make_probe(group: int, first_only: bool, policy: DtypePolicy, fused: bool):
    """The audit's probe for a forward under `policy`: the kernel's (`KernelProbe`) where `fused` allows
    the kernels and it covers the policy, else `group_probe`. One rule for the batched pass and for
    `runner.run_pairs` (jaxref.forward), so that both form the maps with the same arithmetic."""
    if fused and KernelProbe.covers(policy) and kernels.available():
        return KernelProbe(group, first_only, policy)
    return group_probe(group, first_only)


def _layers(params, tokens, pos, doc_ids, *, spec: ModelSpec, policy: DtypePolicy, group: int, first_only: bool,
            seq_len: int | None, fused: bool):
    """The residual stream entering layer 0 under `policy`, and the keywords of the layer scan's body
    (`decoder_layer` or `layer_steps`: that policy's RoPE tables and probe)."""
    act, param = policy.dtype("act"), policy.dtype("param")
    probe = make_probe(group, first_only, policy, fused)
    cos, sin = rope_lib.rope_tables(spec.rope, spec.head_dim, pos, policy, seq_len=seq_len)
    h = params["embed"].astype(param)[tokens].astype(act)
    return h, dict(spec=spec, policy=policy, variant="full", cos=cos, sin=sin, doc_ids=doc_ids, tap=False,
                   tap_rows=None, probe=probe, fused=fused)


def _maps(params, tokens, pos, doc_ids, *, spec: ModelSpec, policy: DtypePolicy, group: int, first_only: bool,
          seq_len: int | None, fused: bool):
    """Per-layer probe outputs ([L, n, group-1, T] each) of variant `full` (the audit's)."""
    h, kw = _layers(params, tokens, pos, doc_ids, spec=spec, policy=policy, group=group, first_only=first_only,
                    seq_len=seq_len, fused=fused)
    _, per_layer = jax.lax.scan(partial(decoder_layer, **kw), h, params["layers"])
    return per_layer["probe"]


_maps_jit = jax.jit(_maps, static_argnames=("spec", "policy", "group", "first_only", "seq_len", "fused"))


def _maps_many(params, tokens, pos, doc_ids, *, spec: ModelSpec, policies: tuple[DtypePolicy, ...], group: int,
               first_only: bool, seq_len: int | None, fused: bool):
    """`_maps` of several policies on the same inputs in one program: a tuple, one entry per policy.

    One compile instead of one per policy: most of a small program's compile time is XLA's cost per
    program, so the error budget's 33 policies at T = 128, as 3 programs of 11, compile in a third of
    the time of 33 programs (benchmarks/bench_audit_breakdown.py). The policies share one scan over the
    layers, each step running every policy's layer in step (`jaxref.executor.layer_steps`), round by round
    of projections: the products that read the same weights in the same dtypes run as one BLAS call
    (`jaxref.executor.linear_many`: every policy's x against q|k|v, then against gate|up), which packs a
    weight once for all their rows instead of once per policy (at T = 128 the packing of the weights
    took a fifth of the BLAS time). The policies'
    forwards are otherwise independent in the program and each one's outputs are bitwise those of its
    own `_maps` program (tests/audit/test_audit_speed.py).
    """
    starts, kws = zip(*(_layers(params, tokens, pos, doc_ids, spec=spec, policy=p, group=group,
                                first_only=first_only, seq_len=seq_len, fused=fused) for p in policies))

    def step(hs, lp):
        outs = layers_in_step([layer_steps(h, lp, **kw) for h, kw in zip(hs, kws)], fused)
        return tuple(h for h, _ in outs), tuple(taps["probe"] for _, taps in outs)

    _, per_layer = jax.lax.scan(step, tuple(starts), params["layers"])
    return per_layer


_maps_many_jit = jax.jit(_maps_many, static_argnames=("spec", "policies", "group", "first_only", "seq_len", "fused"))


def batch_inputs(tokens_nT: np.ndarray, deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, positions and doc ids [n*G, T] of `n` windows under the G shifts `deltas` (window-major)."""
    n, T = tokens_nT.shape
    G = len(deltas)
    tokens = np.repeat(tokens_nT, G, axis=0)
    positions = np.arange(T, dtype=np.int64)[None, :] + np.tile(np.asarray(deltas, np.int64), n)[:, None]
    return tokens.astype(np.int32), positions, np.ones_like(tokens, dtype=np.int32)


class MapsRunner:
    """Compiles and runs `_maps` once per (policy, shape); `prefetch` compiles ahead on a background thread.

    Programs are compiled ahead of time (`jit(...).lower(...).compile()`) and kept here, keyed by
    what the compiled code depends on: the policy's stages (not its name: policies that differ only
    in name share a program), the batch shape, the probe and the dynamic-RoPE length. Lowering and
    compiling a program while another executes overlaps the compiler (one thread) with the matmuls.

    `fused`: allow the fused CPU attention kernel, as `jaxref.forward`'s argument; None (default):
    the user's switch (`kernels.enabled()`, off under `JAXREF_FUSED_ATTENTION=0`), read here once.
    """

    def __init__(self, params: Params, spec: ModelSpec, *, background: bool = True, fused: bool | None = None):
        self.params, self.spec = params, spec
        self.fused = kernels.enabled() if fused is None else bool(fused)
        self._programs: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-compile") if background else None

    @staticmethod
    def _policy_key(policy: DtypePolicy) -> tuple:
        return policy.forward_key()

    @staticmethod
    def _key(policy: DtypePolicy | tuple[DtypePolicy, ...], B: int, T: int, group: int, first_only: bool,
             seq_len: int | None) -> tuple:
        pk = (tuple(map(MapsRunner._policy_key, policy)) if isinstance(policy, tuple)
              else MapsRunner._policy_key(policy))
        return (pk, B, T, group, first_only, seq_len)

    def _seq_len(self, max_pos: int) -> int | None:
        return int(max_pos) + 1 if self.spec.rope.kind == "dynamic" else None

    def _compile(self, policy: DtypePolicy | tuple[DtypePolicy, ...], B: int, T: int, group: int, first_only: bool,
                 seq_len: int | None):
        args = (self.params, jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, T), jnp.int64),
                jax.ShapeDtypeStruct((B, T), jnp.int32))
        static = dict(spec=self.spec, group=group, first_only=first_only, seq_len=seq_len, fused=self.fused)
        if isinstance(policy, tuple):
            return _maps_many_jit.lower(*args, policies=policy, **static).compile()
        return _maps_jit.lower(*args, policy=policy, **static).compile()

    def program(self, policy: DtypePolicy | tuple[DtypePolicy, ...], B: int, T: int, group: int, first_only: bool,
                max_pos: int, *, wait: bool = True):
        """The compiled program (compiling it now, or waiting for a prefetch); with wait=False, start it only.

        `policy` a tuple: one program for all of them (`_maps_many`), whose output is a tuple."""
        seq_len = self._seq_len(max_pos)
        key = self._key(policy, B, T, group, first_only, seq_len)
        with self._lock:
            fut = self._programs.get(key)
            if fut is None:
                if self._pool is not None and not wait:
                    fut = self._pool.submit(self._compile, policy, B, T, group, first_only, seq_len)
                else:
                    fut = Future()
                    fut.set_result(self._compile(policy, B, T, group, first_only, seq_len))
                self._programs[key] = fut
        return fut.result() if wait else None

    def prefetch(self, policy: DtypePolicy | tuple[DtypePolicy, ...], B: int, T: int, group: int, first_only: bool,
                 max_pos: int) -> None:
        """Start compiling a program that will be needed (no-op without a background thread)."""
        if self._pool is not None:
            self.program(policy, B, T, group, first_only, max_pos, wait=False)

    def run(self, tokens_nT: np.ndarray, deltas, policy: DtypePolicy, *, first_only: bool = False
            ) -> dict[str, np.ndarray]:
        """Probe outputs of `n` windows under the shifts `deltas` (the reference first) in one call.

        Args: tokens_nT int [n, T]; deltas: G shifts, deltas[0] the reference. Returns float64
        `first` (and `col` unless first_only), each [L, n, G-1, T].
        """
        tokens, positions, doc_ids = batch_inputs(tokens_nT, deltas)
        B, T = tokens.shape
        prog = self.program(policy, B, T, len(deltas), first_only, int(positions.max()))
        out = prog(self.params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(doc_ids))
        return {k: np.asarray(v, np.float64) for k, v in out.items()}

    def run_many(self, tokens_nT: np.ndarray, deltas, policies: tuple[DtypePolicy, ...], *, first_only: bool = False
                 ) -> list[dict[str, np.ndarray]]:
        """`run` for several policies in one call of one program (`_maps_many`): a list, one result per policy."""
        tokens, positions, doc_ids = batch_inputs(tokens_nT, deltas)
        B, T = tokens.shape
        prog = self.program(tuple(policies), B, T, len(deltas), first_only, int(positions.max()))
        outs = prog(self.params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(doc_ids))
        return [{k: np.asarray(v, np.float64) for k, v in o.items()} for o in outs]

    def with_params(self, params: Params) -> MapsRunner:
        """A runner over other params of the same shapes and dtypes (the random-init model), sharing the
        compiled programs (params are an argument of each program, not a constant in it) and the thread."""
        return self._sibling(params, self.spec, self._programs)

    def with_spec(self, spec: ModelSpec) -> MapsRunner:
        """A runner of the same params under another spec (another RoPE base): programs of its own (the spec is
        compiled into them) on the same compile thread, queued behind this runner's. Closed by closing this one."""
        return self._sibling(self.params, spec, {})

    def _sibling(self, params: Params, spec: ModelSpec, programs: dict) -> MapsRunner:
        """A runner on this one's compile thread and lock, with the params, spec and program cache given."""
        other = MapsRunner.__new__(MapsRunner)
        other.params, other.spec, other.fused = params, spec, self.fused
        other._programs, other._lock, other._pool = programs, self._lock, self._pool
        return other

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
