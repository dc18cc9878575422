"""What the precision audit measures and on how much data: `AuditSettings`, checked before any weight is read.

The paper's shifts and lengths are the defaults (`PAPER_SHIFTS`, `PAPER_LENGTHS`, Δ2 = `REF_SHIFT`);
`AuditSettings.quick()` is the short audit `anchor demo` runs. `resolve_settings` refuses lengths, counts,
shifts, seeds and sizes that cannot run on the model or fit this machine's memory, and caps the length curve
by the free memory (`max_len_for_memory`), so that a bad setting fails with one line before the weights are
read. The policies audited and the one whose error budget is measured are chosen here too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

from anchor_core.errors import InputError
from anchor_core.limits import check_memory, check_seed
from anchor_core.spec import ModelSpec
from jaxref.policy import STAGES, DtypePolicy, get_policy, parse_policies
from parity_tests.audit.maps import MEM_BYTES_PER_MAP_ENTRY

PAPER_SHIFTS: tuple[int, ...] = (0, 2, 4, 6, 8, 10, 12, 14, 15, 17, 18, 20, 22, 50, 100, 200, 500, 1000, 2000)
PAPER_LENGTHS: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
REF_SHIFT = 16
DEFAULT_POLICIES: tuple[str, ...] = ("fp32", "hf_bf16", "fa2_bf16", "paper_bf16")
ANGLE_POSITIONS: tuple[int, ...] = (1024, 4096, 16384, 32768, 65536, 131072, 262144, 524288, 1_000_000)
QUICK_SHIFTS: tuple[int, ...] = (0, 8, 15, 17, 100, 2000)
MILLION_SHIFTS: tuple[int, ...] = (0, 8, 100, 2000, *(1 << k for k in range(12, 21)))
"""`--shifts million`: a few of the paper's short shifts, then every power of two from 4096 to 2^20 (windows stay
--seq-len long: only their positions move)."""


def _comma_list(text: str, convert, what: str, option: str) -> tuple:
    """`text` split at commas, each item through `convert`; InputError naming `option` when one is not `what`."""
    try:
        return tuple(convert(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise InputError(f"{option}: {text!r} is not a comma-separated list of {what}") from None


def parse_shifts(text: str) -> tuple[int, ...]:
    """`--shifts`: comma-separated non-negative integers, or `million` (MILLION_SHIFTS); InputError otherwise."""
    if text.strip() == "million":
        return MILLION_SHIFTS
    shifts = _comma_list(text, int, "integers (or `million`)", "--shifts")
    if not shifts or min(shifts) < 0:
        raise InputError(f"--shifts: {text!r}: give at least one shift, each >= 0")
    return shifts


def parse_rope_bases(text: str) -> tuple[float, ...]:
    """`--rope-base`: comma-separated numbers (1e4,5e5,5e6,1e8); InputError otherwise (the range is checked by
    `resolve_settings`)."""
    bases = _comma_list(text, float, "numbers", "--rope-base")
    if not bases:
        raise InputError("--rope-base: give at least one base")
    return bases


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
    rope_bases: RoPE bases under which the shift curve is measured again, the weights staying the model's
      (`rope_bases` in the result: per base, each policy's shift curve, its walls and its RoPE table's phase
      error); the rest of the audit runs under the model's own base. () for none.
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
    rope_bases: tuple[float, ...] = ()

    @classmethod
    def quick(cls, **overrides: Any) -> AuditSettings:
        """A short audit (for `anchor demo` and tests): one window of 64, six shifts, no error budget."""
        base = dict(seq_len=64, num_seqs=1, shifts=QUICK_SHIFTS, max_len=256, budget_seq_len=64, budget_seqs=1,
                    budget=False)
        return cls(**{**base, **overrides})


def max_len_for_memory(spec: ModelSpec) -> int:
    """Longest T whose pair of attention maps per layer fits in half the free memory."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 8e9
    return int(math.isqrt(int(avail / 2 / (2 * MEM_BYTES_PER_MAP_ENTRY * spec.num_heads))))


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
    for b in settings.rope_bases:
        if not (isinstance(b, (int, float)) and math.isfinite(b) and b > 1):
            raise InputError(f"--rope-base: each base must be a finite number above 1, got {b!r}")
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
    bases = tuple(float(b) for b in dict.fromkeys(settings.rope_bases))
    return dataclasses.replace(settings, shifts=tuple(shifts), max_len=max_len, rope_bases=bases), lengths, notes


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
