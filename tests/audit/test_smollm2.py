"""A quick audit of the embedded SmolLM2 (30 layers): the API end to end on a real pretrained model."""

from __future__ import annotations

import numpy as np
import pytest

from anchor_core.paths import DEFAULT_MODEL_FILE, cache_dir


@pytest.mark.model
@pytest.mark.slow  # about a minute on 2 shared cores
def test_quick_audit_smollm2():
    if not (cache_dir() / "models" / DEFAULT_MODEL_FILE).is_file():
        pytest.skip("the embedded SmolLM2 GGUF is missing (run `make install`)")
    from parity_tests.audit import run_audit

    r = run_audit("default", ("fp32", "hf_bf16"), quick=True)
    d32, d16 = np.mean(r["shift_curve"]["fp32"]["D"]), np.mean(r["shift_curve"]["hf_bf16"]["D"])
    pt = r["per_token"]["hf_bf16"]
    print(f"SmolLM2 quick: mean D fp32 {d32:.3g}, hf_bf16 {d16:.3g}; first-token share {pt['first_token_share']:.3f}; "
          f"D_logit {r['length_curve']['hf_bf16']['D_logit']}")
    assert r["spec"]["num_layers"] == 30 and len(pt["by_layer"]) == 30
    assert 0 < d32 < d16  # fp32 keeps RoPE far closer to relative than bf16
    assert r["settings"]["lengths"] == [64, 128, 256]
