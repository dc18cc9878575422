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
  walls         per policy, the first shift where D passes twice fp32's D there and twice its own D at the
                smallest shift (metrics.walls)
  rope_bases    with `rope_bases`: the shift curve, walls and RoPE tables' phase error under each base
The logits' vocabulary is cut to the tokens the windows use: the audit reads only attention maps,
which do not depend on the lm-head.

What the audit measures and its checks are `parity_tests.audit.settings`'s, and the curves with the forward
passes they come from are `parity_tests.audit.curves`'s; this module runs them: the windows, the programs
compiled ahead, the pieces a killed audit kept, and `run_audit`. Their names that other code imports from here
are imported here.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from anchor_core import __version__
from anchor_core.errors import InputError
from anchor_core.limits import check_seed
from anchor_core.machine import machine
from anchor_core.parts import Parts, files_id
from anchor_core.progress import ProgressBar
from anchor_core.spec import ModelSpec
from anchor_core.tokenizer import load_tokenizer
from anchor_core.weights import load_spec, load_weights
from jaxref.policy import DtypePolicy
from jaxref.reference import Params, params_from_state
from parity_tests.audit import metrics
from parity_tests.audit.budget import budget_groups, budget_plan, budget_runs, error_budget
from parity_tests.audit.curves import (  # noqa: F401 (re-exported)
    _shift_programs,
    length_curve,
    restrict_vocab,
    run_pairs,
    shift_curve,
    shifts_per_call,
)
from parity_tests.audit.maps import MapsRunner
from parity_tests.audit.random_init import torch_default_state
from parity_tests.audit.sequences import load_texts, make_windows
from parity_tests.audit.settings import (  # noqa: F401 (re-exported)
    ANGLE_POSITIONS,
    DEFAULT_POLICIES,
    PAPER_LENGTHS,
    PAPER_SHIFTS,
    QUICK_SHIFTS,
    REF_SHIFT,
    AuditSettings,
    _audit_policies,
    _audit_settings,
    _budget_base,
    max_len_for_memory,
    resolve_settings,
)


@dataclass(frozen=True)
class _Windows:
    """The audit's token windows (int [n, T], the tokenizer's ids) and the corpus they come from."""

    shift: np.ndarray        # [num_seqs, seq_len]: shift curve and per-token difference
    length: np.ndarray       # [length_seqs, max_len]: length curve
    budget: np.ndarray       # [budget_seqs, budget_len]: error budget
    budget_len: int          # min(budget_seq_len, seq_len)
    corpus_tokens: int       # tokens of the text read, each document with its EOS


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
                       budget_pols: list[DtypePolicy], budget_len: int,
                       base_maps: dict[float, MapsRunner] | None = None) -> None:
    """Start compiling every program the audit runs, in the order it needs them, on the runner's
    background thread while the previous one executes (the random-init model reuses them): each policy's
    curves, the shift curves under each other RoPE base (`base_maps`, runners sharing the thread), the budget."""
    for pol in pols:
        for B, T, group, first_only, max_pos in _shift_programs(settings, k):
            maps.prefetch(pol, B, T, group, first_only, max_pos)
        maps.prefetch(pol, 2, settings.max_len, 2, True, settings.max_len - 1 + settings.ref_shift)
    for runner in (base_maps or {}).values():
        for pol in pols:
            for call in _shift_programs(settings, k):
                runner.prefetch(pol, *call)
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
    per_shift_curve = settings.num_seqs * math.ceil(S / k) * (k + 1)
    per_policy = per_shift_curve + 2 * settings.length_seqs
    total = len(kinds) * len(pols) * per_policy
    swept = [b for b in settings.rope_bases if b != spec.rope.base]  # the model's own base: the main curves
    total += len(swept) * len(pols) * per_shift_curve
    budget_pols = budget_runs(budget_plan(base)) if base is not None else []
    total += 2 * settings.budget_seqs * len(budget_pols)
    bar = ProgressBar("audit", total, progress, unit="forward passes")
    out: dict[str, Any] = {}
    kept = _Kept(parts, key, bar)  # each policy's curves and the budget, through `parts` when given
    maps: MapsRunner | None = None
    base_maps: dict[float, MapsRunner] = {}  # the base sweep's runners, on the pretrained weights
    try:
        for kind, st in kinds:
            params, remap = restrict_vocab(params_from_state(spec, st), spec,
                                           [windows.shift, windows.length, windows.budget])
            if maps is None:
                maps = MapsRunner(params, spec)
                base_maps = {b: maps.with_spec(spec.with_rope(base=float(b))) for b in swept}
                _prefetch_programs(maps, settings, k, pols, budget_pols, windows.budget_len, base_maps)
            else:
                maps = maps.with_params(params)
            block = _curves(params, spec, kind, pols, settings, lengths, windows, remap, bar, maps, kept, per_policy)
            if kind == "pretrained":
                out.update(block)
                out["walls"] = metrics.walls(block["shift_curve"])
                if settings.rope_bases:
                    out["rope_bases"] = _base_sweep(spec, pols, settings, windows, remap, bar, kept,
                                                    block["shift_curve"], per_shift_curve, base_maps)
                out["error_budget"] = {}
                if base is not None:
                    bar.describe(f"error budget of {base.name} (T={windows.budget_len})")
                    out["error_budget"][base.name] = kept(
                        "budget", 2 * settings.budget_seqs * len(budget_pols),
                        lambda: error_budget(params, spec, remap(windows.budget), base, 0, settings.ref_shift,
                                             bar.advance, maps=maps))
            else:
                out["random_init"] = {"init": "pytorch-default (kaiming_uniform a=sqrt(5), embedding N(0,1), norms 1)",
                                      "seed": settings.seed, **block, "walls": metrics.walls(block["shift_curve"])}
    finally:
        bar.close()
        if maps is not None:
            maps.close()
    if kept.taken:
        out["reused"] = {"pieces": kept.taken, "note": "finished by a killed audit with the same settings"}
    return out


def _base_sweep(spec: ModelSpec, pols: list[DtypePolicy], settings: AuditSettings, windows: _Windows,
                remap: Callable, bar: ProgressBar, kept: _Kept, own_curves: dict[str, Any], per_shift_curve: int,
                base_maps: dict[float, MapsRunner]) -> dict[str, Any]:
    """The result's "rope_bases": per base of `settings.rope_bases` (keyed by `f"{base:g}"`), each policy's shift
    curve on the same windows and weights under that RoPE base, its walls (metrics.walls) and its RoPE table's
    phase error at the windows' last slots. The model's own base takes the audit's main curves; each other base
    runs on its runner of `base_maps` (the base is compiled into the programs, prefetched behind the main ones),
    each policy's curve kept as a piece of `kept`."""
    out: dict[str, Any] = {}
    ends = sorted({s + settings.seq_len - 1 for s in settings.shifts})
    for base in settings.rope_bases:
        spec_b = spec.with_rope(base=float(base))
        if base == spec.rope.base:
            curves = own_curves
        else:
            curves, maps = {}, base_maps[base]
            for i, pol in enumerate(pols):
                bar.describe(f"RoPE base {base:g} {pol.name}: shift curve (T={settings.seq_len})")
                curves[pol.name] = kept(f"base-{base:g}-{i}-{pol.name}", per_shift_curve, lambda pol=pol: {
                    k: v for k, v in shift_curve(maps.params, spec_b, remap(windows.shift), pol, settings.shifts,
                                                 settings.ref_shift, bar.advance, maps=maps).items()
                    if not k.startswith("_")})
        out[f"{base:g}"] = {"base": float(base), "own": base == spec.rope.base,
                            "shift_curve": curves,
                            "walls": metrics.walls(curves),
                            "phase_error": metrics.phase_error(spec_b.rope, spec.head_dim, ends, pols)}
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
      length_curve, error_budget, walls (each keyed by policy name), angle_error, phase_error, random_init
      (when asked: shift_curve, per_token, length_curve and walls of the randomly initialised architecture),
      rope_bases (with `rope_bases`: per base, shift_curve, walls, phase_error), runtime_s, notes;
      `parity_tests.audit.report.findings(result)` states the paper's findings from it.
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
    # each policy's RoPE table against fp64's where the shift curve puts its windows' last slots, and to 1M
    ends = sorted({*ANGLE_POSITIONS, *(s + settings.seq_len - 1 for s in settings.shifts)})
    out["phase_error"] = metrics.phase_error(spec.rope, spec.head_dim, ends, pols)
    settings_d = _settings_record(settings, lengths, base, windows, data)
    return {
        "model": model, "spec": {**dataclasses.asdict(spec)}, "settings": settings_d, "machine": machine(jax_backend=jax.default_backend()),
        "policies": {p.name: p.to_dict() for p in pols}, **out, "notes": notes, "runtime_s": time.time() - t0,
    }
