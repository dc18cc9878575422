"""`anchor audit --stack torch`: the audit measured on torchtrain's model itself, beside the oracle's
emulation of that stack (parity_tests/audit/torch_stack.py). On SmolLM2 at L=512 (recorded in
experiments/torch_stack_audit/results/audit_torch_stack_cpu.json) eager is within 5 % of hf_bf16 at every shift; here the
same holds on a random preset in seconds."""

from __future__ import annotations

import json

import pytest

import jaxref

from anchor.cli import main
from parity_tests.audit.torch_stack import ORACLE_POLICY, audit_torch_stack


def _run(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code)


def _audit(engine: str, **kw):
    return audit_torch_stack("random:llama", engine, "bfloat16", quick=True, **kw)


@pytest.mark.parametrize("engine,bound", [("eager", 0.05), ("sdpa", 0.10), ("flash_varlen_emulated", 0.10),
                                          pytest.param("flex", 0.10, marks=pytest.mark.slow)])
def test_torch_stack_d_follows_its_emulation_at_every_shift(engine, bound):
    result = _audit(engine)
    comp = result["comparison"]
    print(comp)
    # the emulation resolved for this machine (sdpa_cpu_bf16 -> the capability torch runs), named as resolved
    assert comp["oracle"] == jaxref.get_policy(ORACLE_POLICY[engine]).name and comp["torch"] == f"torch:{engine}:bfloat16"
    assert result["machine"]["cpu_capability"] in result["machine"]["cpu_capabilities"]
    assert len(comp["shifts"]) == 6 and all(d > 0 for d in comp["D_torch"])
    assert comp["max_rel_diff"] <= bound
    # the per-token difference and the length curve are measured on the torch stack too
    assert len(result["per_token"][comp["torch"]]["values"]) == result["settings"]["seq_len"]
    assert result["length_curve"][comp["torch"]]["D_logit"][-1] > 0


def test_torch_bf16_breaks_the_relative_property_and_fp32_does_not():
    """The measurement can tell stacks apart: torch in fp32 changes its maps under a shift by orders
    of magnitude less than torch in bf16 (the paper's Figure 1, on the real stack)."""
    bf16 = _audit("eager", oracle=False)
    fp32 = audit_torch_stack("random:llama", "eager", "float32", quick=True, oracle=False)
    d16 = bf16["shift_curve"]["torch:eager:bfloat16"]["D"]
    d32 = fp32["shift_curve"]["torch:eager:float32"]["D"]
    print(d16, d32)
    assert max(d32) < 0.01 * min(d16)


def test_cli_torch_stack_writes_the_comparison(tmp_path, capsys):
    out = tmp_path / "audit"
    rc = _run(["audit", "--stack", "torch", "--engine", "eager", "--model", "random:llama", "--quick", "--out", str(out),
               "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0 and "against oracle hf_bf16" in printed, printed
    result = json.loads((out / "audit.json").read_text())
    assert result["stack"]["engine"] == "eager" and result["comparison"]["oracle"] == "hf_bf16"
    report = (out / "report.md").read_text()
    assert "The torch stack beside the oracle's emulation" in report and (out / "shift_curve.png").is_file()


@pytest.mark.parametrize("argv,message", [
    (["--engine", "flash_varlen"], "flash"),
    (["--engine", "nope"], "unknown engine"),
    (["--policies", "fp32"], "--policies applies to --stack oracle"),
    (["--dtype", "float16"], "unsupported dtype"),
    (["--stack", "gpu"], "unknown stack"),
])
def test_cli_torch_stack_bad_options(tmp_path, capsys, argv, message):
    rc = _run(["audit", "--stack", "torch", "--model", "random:llama", "--quick", "--out", str(tmp_path / "a"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "a").exists()
