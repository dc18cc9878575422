"""What `anchor.check_step` (parity_tests.blackbox) returns: `StepCheck`, a frozen dataclass of its findings that
also reads as the mapping of its fields, by the keys the report has always had (`report["message"]`,
`report["pass"]`, `dict(report)`). It imports nothing of the oracle, so the type is there without JAX."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["StepCheck"]


@dataclass(frozen=True, eq=False)
class StepCheck(Mapping[str, Any]):
    """What check_step found, one field per finding. It also reads as the mapping check_step has always returned,
    by the keys in `KEYS`: `report["message"]`, `"bf16" in report`, `report.get("probe")`, `dict(report)` or
    `report.to_dict()` (in that order), and it equals a mapping of the same keys and values. Every field is a
    key under its own name but `passed`, whose key is "pass" (a Python keyword). The nested findings (`documents`,
    `candidates`, `fp32`, `bf16`, `probe`, `reading`) are plain dicts and lists, as JSON writes them."""

    passed: bool
    message: str
    """The verdict. `passed` (key "pass"): the step computes one of the variants asked, passes the bf16 rule where
    that applies, and (unless "full" is asked) the probe moved no other document. `message`: the verdict in one
    paragraph (what was asked, what it computes, the first diverging layer and quantity, what the probe saw),
    with which the pytest fixture `anchor_check_step` fails a test."""

    asked: list[str]
    documents: dict[str, Any]
    attn_implementation: str
    use_cache: Any
    dtype: str
    error: str | None
    """The step as it ran. `asked`: the variants it may compute to pass. `documents`: where the documents are,
    read from the batch (parity_tests.batch_documents: "source", "counts", "lengths", "disagree", ...).
    `attn_implementation` and `use_cache`: as the model ran the batch. `dtype`: "float32" or "bfloat16", the
    dtype of the run. `error`: the one line model(**batch) raised, else None; where it is set, the findings
    below stay at None (or empty) from the point where the forward failed."""

    computes: str | None
    matches: list[str]
    closest: str | None
    reading: dict[str, Any] | None
    candidates: dict[str, dict[str, Any]] | None
    fp32: dict[str, Any] | None
    """Against the oracle, a float32 copy's taps by the fp32 rule. `computes`: the variant the step computes (an
    asked one first), or None. `matches`: every variant within the rule. `closest`: the variant with the smallest
    error. `reading`: where none matches, the mask at the batch's own position_ids that explains it ({"mask",
    "positions", "worst_margin"}), or None. `candidates`: per variant {"pass", "worst_margin",
    "first_divergence"}. `fp32`: against the asked variant nearest ({"against", "first_divergence",
    "worst_margin", "documents"}: the documents over the tolerance at the first divergence, each {"row",
    "document", "first_slot", "rel_l2"})."""

    bf16: dict[str, Any] | None
    """Where the step runs in bfloat16 and computes a variant asked: its taps against the fp64 truth by the bf16
    rule ({"policy", "pass", "first_divergence", "worst_margin", "summary"}); else None."""

    probe: dict[str, Any] | None
    attends_across_documents: bool | None
    """Which documents see each other. `probe`: the perturbation probe ({"ran", "document", "moved", "first_slots",
    "change", "noise", "threshold", ...}: probe_documents), or None where it was not asked for.
    `attends_across_documents`: from what it computes, else the reading, else the probe; None where none says."""

    # the keys in the order check_step's mapping has always had them; FIELD_OF: the field of each key
    KEYS = ("asked", "computes", "matches", "closest", "reading", "documents", "attn_implementation", "use_cache",
            "dtype", "candidates", "fp32", "bf16", "probe", "attends_across_documents", "error", "pass", "message")
    FIELD_OF = {**{k: k for k in KEYS}, "pass": "passed"}

    @classmethod
    def of(cls, report: Mapping[str, Any]) -> StepCheck:
        """The StepCheck of a mapping by KEYS (every key present, no other)."""
        if set(report) != set(cls.KEYS):
            raise ValueError(f"StepCheck.of: keys {sorted(set(report) ^ set(cls.KEYS))} differ from StepCheck.KEYS")
        return cls(**{cls.FIELD_OF[k]: v for k, v in report.items()})

    def __getitem__(self, key: str) -> Any:
        if key not in self.FIELD_OF:
            raise KeyError(key)
        return getattr(self, self.FIELD_OF[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)

    def to_dict(self) -> dict[str, Any]:
        """The mapping as a plain dict, by KEYS (the nested findings are the same objects, not copies)."""
        return {k: self[k] for k in self.KEYS}
