"""The precision audit: the paper's Figure 1 experiments and a stage-by-stage error budget.

    result = run_audit("default", policies="fp32,hf_bf16,fa2_bf16,paper_bf16")
    result = run_audit("random:llama", quick=True)          # seconds: what `anchor demo` calls

Legend: L layers, N query heads, T slots, S shifts in one call (the reference shift first).

Every measurement is a batch of forward passes of the same tokens under different position
shifts (`positions = slot + Δ`, variant `full`, one document) with a probe that reduces the
attention maps inside each layer to column sums `Σ_i |P_ij(Δ) − P_ij(Δ_ref)|` and per-row
first-key logit differences `|A_i0(Δ) − A_i0(Δ_ref)|` (metrics.py), so no T×T map leaves a layer.
The passes run on `maps.MapsRunner`: the decoder up to the maps only (no lm-head), each window with
all its shifts in one call, each program compiled once and ahead, on a background thread, while the
one before it runs. Its numbers are bitwise those of `jaxref.forward` with the probe (`run_pairs`).

What is measured (docs/DESIGN.md §5):
  shift_curve   D(X, Δ1, Δ2=16) for Δ1 in the paper's list, mean over `num_seqs` windows of `seq_len`
  per_token     the per-key-slot difference for Δ1=0, Δ2=16 (same forwards as the shift curve)
  length_curve  D_logit(Δ1=0, Δ2=16) for the paper's lengths up to `max_len`, from one pair of
                forwards at `max_len` per window (a causal row never sees later slots, so the
                first L rows are exactly the length-L sequence)
  error_budget  D(0, 16) of one bf16 policy with each stage raised to fp64 alone, raised
                cumulatively (pipeline order; the increments add up to D_bf16 − D_fp64 exactly),
                and each stage lowered alone from fp32 to the policy's dtype
  angle_error   fp32 RoPE angles against exact ones at long positions (to 1M)
The logits' vocabulary is cut to the tokens the windows use: the audit reads only attention maps,
which do not depend on the lm-head.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from anchor_core import __version__
from anchor_core.errors import InputError
from anchor_core.limits import check_memory, check_seed
from anchor_core.machine import machine
from anchor_core.parts import Parts, files_id
from anchor_core.progress import ProgressBar
from anchor_core.spec import ModelSpec
from anchor_core.tokenizer import load_tokenizer
from anchor_core.weights import load_spec, load_weights
from jaxref import kernels
from jaxref.executor import forward
from jaxref.policy import STAGES, DtypePolicy, get_policy, parse_policies
from jaxref.reference import Params, params_from_state
from parity_tests.audit import metrics
from parity_tests.audit.budget import budget_groups, budget_plan, budget_runs, error_budget
from parity_tests.audit.maps import MAP_MEMORY_BUDGET, MEM_BYTES_PER_MAP_ENTRY, MapsRunner, make_probe
from parity_tests.audit.random_init import torch_default_state
from parity_tests.audit.sequences import load_texts, make_windows

PAPER_SHIFTS: tuple[int, ...] = (0, 2, 4, 6, 8, 10, 12, 14, 15, 17, 18, 20, 22, 50, 100, 200, 500, 1000, 2000)
PAPER_LENGTHS: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
REF_SHIFT = 16
DEFAULT_POLICIES: tuple[str, ...] = ("fp32", "hf_bf16", "fa2_bf16", "paper_bf16")
ANGLE_POSITIONS: tuple[int, ...] = (1024, 4096, 16384, 32768, 65536, 131072, 262144, 524288, 1_000_000)
QUICK_SHIFTS: tuple[int, ...] = (0, 8, 15, 17, 100, 2000)


@dataclass(frozen=True)
class AuditSettings:
    """What the audit measures and on how much data. Defaults fit a 2-core CPU in < 15 min on SmolLM2.

    seq_len, num_seqs: windows of the shift curve and per-token difference (the paper: 4096 × 50).
    shifts, ref_shift: Δ1 values and Δ2 (Δ1 = 0 is always measured: it gives the per-token curve).
    max_len, length_seqs: longest length of the length curve (capped by the model's max position and
      memory) and the windows of that length it averages over.
    budget_policy: the bf16 policy of the error budget (None: the first low-precision policy).
    budget_seq_len, budget_seqs: windows of the error budget. budget: run it at all.
    random_init: also audit the architecture with PyTorch's default init (seeded by `seed`).
    """

    seq_len: int = 256
    num_seqs: int = 2
    shifts: tuple[int, ...] = PAPER_SHIFTS
    ref_shift: int = REF_SHIFT
    max_len: int = 1024
    length_seqs: int = 1
    budget_policy: str | None = None
    budget_seq_len: int = 128
    budget_seqs: int = 1
    budget: bool = True
    random_init: bool = False
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> AuditSettings:
        """A short audit (for `anchor demo` and tests): one window of 64, six shifts, no error budget."""
        base = dict(seq_len=64, num_seqs=1, shifts=QUICK_SHIFTS, max_len=256, budget_seq_len=64, budget_seqs=1,
                    budget=False)
        return cls(**{**base, **overrides})


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


def max_len_for_memory(spec: ModelSpec) -> int:
    """Longest T whose pair of attention maps per layer fits in half the free memory."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 8e9
    return int(math.isqrt(int(avail / 2 / (2 * MEM_BYTES_PER_MAP_ENTRY * spec.num_heads))))


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
    """D(X, Δ1, ref) for each Δ1 (mean over windows), per-token and per-layer D at Δ1 = 0, D_logit per Δ1.

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
                if c + b == zero:
                    per_token[s] = metrics.per_token_from_colsums(col)
                    by_layer[s] = (col * metrics.column_norm(T)).sum(axis=1)
            tick(len(padded) + 1)
    return {
        "shifts": [int(x) for x in shifts], "ref_shift": int(ref_shift), "seq_len": int(T), "num_seqs": int(n),
        "D": D.mean(axis=0).tolist(), "D_per_seq": D.tolist(), "D_logit": d_logit.mean(axis=0).tolist(),
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


# ---------------------------------------------------------------------------------------------
# Error budget


# ---------------------------------------------------------------------------------------------
# The whole audit


def _is_low_precision(p: DtypePolicy) -> bool:
    return any(getattr(p, s) in ("bfloat16", "float16") for s in STAGES)


def _check_ranges(spec: ModelSpec, settings: AuditSettings) -> None:
    """Seeds in numpy's range; sizes whose windows and attention maps fit in memory, refused up front."""
    check_seed(settings.seed)
    # the shift curve needs at least one pair of [heads, T, T] maps per call (shifts_per_call)
    T = settings.seq_len
    check_memory(2 * MEM_BYTES_PER_MAP_ENTRY * spec.num_heads * T * T, f"--seq-len {T} (attention maps)")
    for n, t, flags in ((settings.num_seqs, settings.seq_len, "--num-seqs x --seq-len"),
                        (settings.length_seqs, settings.max_len, "--length-seqs x --max-len"),
                        (settings.budget_seqs, settings.budget_seq_len, "budget windows")):
        check_memory(16 * n * t, f"{flags} = {n} x {t} (token windows)")


def resolve_settings(spec: ModelSpec, settings: AuditSettings) -> tuple[AuditSettings, list[int], list[str]]:
    """`settings` checked against the model and this machine, before any weight is read.

    Refuses (InputError) lengths under 2 or past `spec.max_position`, counts under 1, negative shifts,
    seeds outside numpy's range and windows or attention maps that cannot fit in memory. Returns
    (settings with the shifts deduplicated, the reference dropped and 0 first when missing, and
    `max_len` capped by the free memory; the length curve's lengths; notes on what was capped).
    """
    notes: list[str] = []
    if settings.seq_len < 2 or settings.max_len < 2:
        raise InputError(f"--seq-len and --max-len must be >= 2 (got {settings.seq_len}, {settings.max_len})")
    if min(settings.num_seqs, settings.length_seqs, settings.budget_seqs) < 1:
        raise InputError("--num-seqs and --length-seqs must be >= 1")
    if settings.seq_len > spec.max_position:
        raise InputError(f"--seq-len {settings.seq_len} is longer than the model supports "
                         f"(max position {spec.max_position})")
    if settings.max_len > spec.max_position:
        raise InputError(f"--max-len {settings.max_len} is longer than the model supports "
                         f"(max position {spec.max_position})")
    if any(s < 0 for s in settings.shifts) or settings.ref_shift < 0:
        raise InputError("shifts must be >= 0")
    _check_ranges(spec, settings)
    shifts = [s for s in dict.fromkeys(settings.shifts) if s != settings.ref_shift]
    if 0 not in shifts:
        shifts = [0, *shifts]
    max_len = settings.max_len
    mem_len = max_len_for_memory(spec)
    if max_len > mem_len:
        max_len = 1 << (mem_len.bit_length() - 1)
        notes.append(f"length curve capped at {max_len} by this machine's free memory")
    lengths = [L for L in PAPER_LENGTHS if L <= max_len] or [max_len]
    if lengths[-1] != max_len and max_len not in PAPER_LENGTHS and max_len > lengths[-1]:
        lengths.append(max_len)
    return dataclasses.replace(settings, shifts=tuple(shifts), max_len=max_len), lengths, notes


@dataclass(frozen=True)
class _Windows:
    """The audit's token windows (int [n, T], the tokenizer's ids) and the corpus they come from."""

    shift: np.ndarray        # [num_seqs, seq_len]: shift curve and per-token difference
    length: np.ndarray       # [length_seqs, max_len]: length curve
    budget: np.ndarray       # [budget_seqs, budget_len]: error budget
    budget_len: int          # min(budget_seq_len, seq_len)
    corpus_tokens: int       # tokens of the text read, each document with its EOS


def _audit_settings(settings: AuditSettings | None, quick: bool, overrides: dict[str, Any]) -> AuditSettings:
    """`settings`, else the defaults (`AuditSettings.quick()` when `quick`), with the fields named in
    `overrides` replaced (None values ignored; an unknown name is a TypeError, as for any keyword)."""
    if settings is None:
        settings = AuditSettings.quick() if quick else AuditSettings()
    if overrides:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(AuditSettings)})
        if unknown:
            raise TypeError(f"run_audit() got unknown settings {unknown}")
        settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    return settings


def _audit_policies(policies: str | Sequence[str | DtypePolicy]) -> list[DtypePolicy]:
    """The policies to audit: at least one, no name twice."""
    pols = parse_policies(policies) if isinstance(policies, str) else [get_policy(p) for p in policies]
    if not pols:
        raise InputError("no dtype policy given")
    names = [p.name for p in pols]
    if len(set(names)) != len(names):
        raise InputError(f"--policies: a policy is named twice ({', '.join(names)})")
    return pols


def _budget_base(settings: AuditSettings, pols: list[DtypePolicy], notes: list[str]) -> DtypePolicy | None:
    """The policy whose error budget is measured: `budget_policy`, else the first bf16/fp16 policy
    (None, with a note, when there is none); None when the budget is off."""
    if not settings.budget:
        return None
    if settings.budget_policy is not None:
        return get_policy(settings.budget_policy)
    base = next((p for p in pols if _is_low_precision(p)), None)
    if base is None:
        notes.append("no bf16/fp16 policy among --policies: no error budget")
    return base


def _audit_windows(model: str, data: str | None, settings: AuditSettings, spec: ModelSpec,
                   notes: list[str]) -> _Windows:
    """The windows of the three measurements, cut from `data` (None: the embedded corpus) with
    `model`'s tokenizer; a note when the text is shorter than the windows, an InputError when an id
    is beyond the model's vocabulary."""
    tok = load_tokenizer(model)
    T_max = max(settings.seq_len, settings.max_len)
    texts = load_texts(data, max_docs=max(64, settings.num_seqs), max_chars=16 * T_max)
    doc_ids = tok.encode_batch(texts)
    first, eos = tok.first_token_id, tok.eos_id
    shift_w = make_windows(doc_ids, first_token=first, eos=eos, n=settings.num_seqs, T=settings.seq_len)
    length_w = make_windows(doc_ids, first_token=first, eos=eos, n=settings.length_seqs, T=settings.max_len)
    bT = min(settings.budget_seq_len, settings.seq_len)
    budget_w = make_windows(doc_ids, first_token=first, eos=eos, n=settings.budget_seqs, T=bT)
    corpus_tokens = sum(len(d) + 1 for d in doc_ids)
    if corpus_tokens < settings.num_seqs * T_max:
        notes.append(f"the text holds {corpus_tokens} tokens: windows repeat it")
    top = max(int(w.max()) for w in (shift_w, length_w, budget_w))
    if top >= spec.vocab_size:
        raise InputError(f"the tokenizer produced id {top}, beyond the model's vocabulary ({spec.vocab_size})")
    return _Windows(shift_w, length_w, budget_w, bT, corpus_tokens)


def _prefetch_programs(maps: MapsRunner, settings: AuditSettings, k: int, pols: list[DtypePolicy],
                       budget_pols: list[DtypePolicy], budget_len: int) -> None:
    """Start compiling every program the audit runs, in the order it needs them, on the runner's
    background thread while the previous one executes (the random-init model reuses them)."""
    for pol in pols:
        for B, T, group, first_only, max_pos in _shift_programs(settings, k):
            maps.prefetch(pol, B, T, group, first_only, max_pos)
        maps.prefetch(pol, 2, settings.max_len, 2, True, settings.max_len - 1 + settings.ref_shift)
    for group in budget_groups(maps.spec, budget_pols, budget_len, settings.budget_seqs):
        maps.prefetch(group, 2 * settings.budget_seqs, budget_len, 2, False, budget_len - 1 + settings.ref_shift)


def _curves(params: Params, spec: ModelSpec, kind: str, pols: list[DtypePolicy], settings: AuditSettings,
            lengths: list[int], windows: _Windows, remap: Callable, bar: ProgressBar,
            maps: MapsRunner, kept: _Kept, per_policy: int) -> dict[str, Any]:
    """{"shift_curve", "per_token", "length_curve"}, each {policy name: result}, of one kind of weights;
    a policy's three as one piece of `kept` (`per_policy` forward passes)."""
    block: dict[str, Any] = {"shift_curve": {}, "per_token": {}, "length_curve": {}}
    for i, pol in enumerate(pols):
        curves = kept(f"{kind}-{i}-{pol.name}", per_policy, lambda pol=pol: _policy_curves(
            params, spec, kind, pol, settings, lengths, windows, remap, bar, maps))
        for section, value in curves.items():
            block[section][pol.name] = value
    return block


def _policy_curves(params: Params, spec: ModelSpec, kind: str, pol: DtypePolicy, settings: AuditSettings,
                   lengths: list[int], windows: _Windows, remap: Callable, bar: ProgressBar,
                   maps: MapsRunner) -> dict[str, Any]:
    """One policy's {"shift_curve", "per_token", "length_curve"} on one kind of weights."""
    bar.describe(f"{kind} {pol.name}: shift curve (T={settings.seq_len})")
    sc = shift_curve(params, spec, remap(windows.shift), pol, settings.shifts, settings.ref_shift, bar.advance,
                     maps=maps)
    pt = sc.pop("_per_token")
    by_layer = sc.pop("_by_layer")
    per_token = {"delta1": 0, "delta2": settings.ref_shift, "seq_len": settings.seq_len, "values": pt.tolist(),
                 "first_token_share": float(pt[0] / pt.sum()) if pt.sum() > 0 else 0.0,
                 "by_layer": by_layer.tolist()}
    bar.describe(f"{kind} {pol.name}: length curve (T={settings.max_len})")
    lc = length_curve(params, spec, remap(windows.length), pol, lengths, 0, settings.ref_shift, bar.advance, maps=maps)
    return {"shift_curve": sc, "per_token": per_token, "length_curve": lc}


class _Kept:
    """The audit's pieces through anchor_core.parts under the run's `key`: `kept(name, ticks, compute)` is
    compute()'s value or the one a killed audit kept (the progress bar then advanced by its `ticks`, and
    `taken` names it)."""

    def __init__(self, parts: Parts | None, key: Any, bar: ProgressBar):
        self.parts, self.key, self.bar, self.taken = parts or Parts(None, "audit"), key, bar, []

    def __call__(self, name: str, ticks: int, compute: Callable[[], Any]) -> Any:
        value, taken = self.parts.kept(name, {"run": self.key, "piece": name}, compute)
        if taken:
            self.taken.append(name)
            self.bar.advance(ticks)
        return value


def _measure(spec: ModelSpec, kinds: list[tuple[str, dict]], pols: list[DtypePolicy], base: DtypePolicy | None,
             settings: AuditSettings, lengths: list[int], windows: _Windows, progress: bool,
             parts: Parts | None = None, key: Any = None) -> dict[str, Any]:
    """Every forward pass of the audit: the curves of each kind of weights ("pretrained", "random_init")
    under every policy, and the error budget of `base` on the pretrained weights, on one MapsRunner.

    Returns the result's shift_curve, per_token, length_curve, error_budget and (with a random-init
    kind) random_init sections.
    """
    S = len(settings.shifts)
    k = shifts_per_call(spec, settings.seq_len, S)
    per_policy = settings.num_seqs * math.ceil(S / k) * (k + 1) + 2 * settings.length_seqs
    total = len(kinds) * len(pols) * per_policy
    budget_pols = budget_runs(budget_plan(base)) if base is not None else []
    total += 2 * settings.budget_seqs * len(budget_pols)
    bar = ProgressBar("audit", total, progress, unit="forward passes")
    out: dict[str, Any] = {}
    kept = _Kept(parts, key, bar)  # each policy's curves and the budget, through `parts` when given
    maps: MapsRunner | None = None
    try:
        for kind, st in kinds:
            params, remap = restrict_vocab(params_from_state(spec, st), spec,
                                           [windows.shift, windows.length, windows.budget])
            if maps is None:
                maps = MapsRunner(params, spec)
                _prefetch_programs(maps, settings, k, pols, budget_pols, windows.budget_len)
            else:
                maps = maps.with_params(params)
            block = _curves(params, spec, kind, pols, settings, lengths, windows, remap, bar, maps, kept, per_policy)
            if kind == "pretrained":
                out.update(block)
                out["error_budget"] = {}
                if base is not None:
                    bar.describe(f"error budget of {base.name} (T={windows.budget_len})")
                    out["error_budget"][base.name] = kept(
                        "budget", 2 * settings.budget_seqs * len(budget_pols),
                        lambda: error_budget(params, spec, remap(windows.budget), base, 0, settings.ref_shift,
                                             bar.advance, maps=maps))
            else:
                out["random_init"] = {"init": "pytorch-default (kaiming_uniform a=sqrt(5), embedding N(0,1), norms 1)",
                                      "seed": settings.seed, **block}
    finally:
        bar.close()
        if maps is not None:
            maps.close()
    if kept.taken:
        out["reused"] = {"pieces": kept.taken, "note": "finished by a killed audit with the same settings"}
    return out


def _settings_record(settings: AuditSettings, lengths: list[int], base: DtypePolicy | None, windows: _Windows,
                     data: str | None) -> dict[str, Any]:
    """The result's "settings": the resolved AuditSettings with what the run derived from them."""
    settings_d = dataclasses.asdict(settings)
    settings_d.update(shifts=list(settings.shifts), lengths=lengths, budget_policy=None if base is None else base.name,
                      budget_seq_len=windows.budget_len, data=str(data) if data is not None else "default corpus",
                      corpus_tokens=int(windows.corpus_tokens), variant="full")
    return settings_d


def run_audit(model: str = "default", policies: str | Sequence[str | DtypePolicy] = DEFAULT_POLICIES, *,
              data: str | None = None, settings: AuditSettings | None = None, quick: bool = False,
              progress: bool = False, parts: Parts | None = None, **overrides: Any) -> dict[str, Any]:
    """Run the precision audit of `model` and return its results (the content of `audit.json`).

    Args:
      model: as in docs/DESIGN.md §6 ("default", a Hugging Face folder, a .gguf file, "random:<preset>").
      policies: comma-separated names / YAML paths, or a list of names and DtypePolicy values.
      data: a JSONL file/folder with a `text` field; None: the embedded default corpus.
      settings: an AuditSettings; `quick=True` starts from `AuditSettings.quick()` instead of the
        defaults; `overrides` (e.g. seq_len=512, random_init=True) replace single fields.
      progress: show a progress bar on stderr.
      parts: where each policy's curves and the error budget are kept as they finish (anchor_core.parts;
        `parts_dir(out)` from the CLI), and taken from when a killed audit with the same model files,
        data, settings, policies and JAX backend finished them; the result then says so in `reused`.

    Returns:
      a JSON-ready dict: model, spec, settings, machine, policies, shift_curve, per_token,
      length_curve, error_budget (each keyed by policy name), angle_error, random_init (when asked:
      shift_curve, per_token, length_curve of the randomly initialised architecture), runtime_s,
      notes; `parity_tests.audit.report.findings(result)` states the paper's findings from it.
    """
    t0 = time.time()
    settings = _audit_settings(settings, quick, overrides)
    pols = _audit_policies(policies)
    check_seed(settings.seed)
    # sizes are checked against the model's positions and this machine's memory before any weight is read
    settings, lengths, notes = resolve_settings(load_spec(model), settings)
    spec, state = load_weights(model, seed=settings.seed)
    base = _budget_base(settings, pols, notes)
    windows = _audit_windows(model, data, settings, spec, notes)
    kinds = [("pretrained", state)]
    if settings.random_init:
        kinds.append(("random_init", torch_default_state(spec, seed=settings.seed)))
    key = None
    if parts is not None:
        key = {"anchor": __version__, "model_files": files_id(model), "data_files": files_id(data) if data else None,
               "settings": dataclasses.asdict(settings), "lengths": lengths,
               "policies": [p.to_dict() for p in pols], "budget": base.to_dict() if base is not None else None,
               "jax_backend": jax.default_backend()}
    out = _measure(spec, kinds, pols, base, settings, lengths, windows, progress, parts, key)
    out["angle_error"] = metrics.angle_error(spec.rope, spec.head_dim, ANGLE_POSITIONS, shift=settings.ref_shift)
    settings_d = _settings_record(settings, lengths, base, windows, data)
    return {
        "model": model, "spec": {**dataclasses.asdict(spec)}, "settings": settings_d, "machine": machine(jax_backend=jax.default_backend()),
        "policies": {p.name: p.to_dict() for p in pols}, **out, "notes": notes, "runtime_s": time.time() - t0,
    }
