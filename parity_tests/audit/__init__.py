"""The precision audit (paper §2, Figure 1; docs/DESIGN.md §5): does RoPE stay relative under a dtype policy?

    from parity_tests.audit import run_audit, write_audit
    result = run_audit("default", policies="fp32,hf_bf16,fa2_bf16,paper_bf16", random_init=True)
    write_audit(result, "runs/audit")          # audit.json, report.md, PNG figures (atomically)
    short = run_audit("random:llama", quick=True)   # seconds

Metric functions (numpy, on attention maps or on the column sums the audit's probe returns) are in
`parity_tests.audit.metrics`; PyTorch's default init in numpy in `parity_tests.audit.random_init`.
"""

from parity_tests.audit.budget import budget_plan, error_budget
from parity_tests.audit.metrics import (
    angle_error, attention_difference, column_norm, d_from_colsums, d_logit_from_rows, logit_difference,
    per_token_difference, per_token_from_colsums,
)
from parity_tests.audit.random_init import torch_default_state
from parity_tests.audit.report import findings, render_report, write_audit
from parity_tests.audit.runner import (
    DEFAULT_POLICIES, PAPER_LENGTHS, PAPER_SHIFTS, REF_SHIFT, AuditSettings, run_audit,
)

__all__ = [
    "DEFAULT_POLICIES", "PAPER_LENGTHS", "PAPER_SHIFTS", "REF_SHIFT", "AuditSettings", "angle_error",
    "attention_difference", "budget_plan", "column_norm", "d_from_colsums", "d_logit_from_rows", "error_budget",
    "findings", "logit_difference", "per_token_difference", "per_token_from_colsums", "render_report", "run_audit",
    "torch_default_state", "write_audit",
]
