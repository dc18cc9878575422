"""`anchor.check_step` returns a `StepCheck` dataclass that also reads as the mapping of its fields: every key the
report has always had (`result["message"]`, `result["pass"]`, `"probe" in result`, `.get`, `dict(result)`,
`.to_dict()`), with the values of the fields of the same names."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("jax")  # the oracle extra

import anchor  # noqa: E402
from parity_tests.blackbox import StepCheck, check_step  # noqa: E402

LENGTHS = (9, 5, 7)  # three documents, T = 21


@pytest.fixture(scope="module")
def result() -> StepCheck:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=61, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    features = [{"input_ids": torch.randint(0, 97, (n,), generator=g).tolist()} for n in LENGTHS]
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(features)
    return anchor.check_step(model, batch, variants="intra_doc_reset", probe=False)


def test_check_step_returns_the_dataclass_and_its_message_by_key(result):
    assert anchor.check_step is check_step
    assert isinstance(result, StepCheck) and dataclasses.is_dataclass(result)
    assert result["message"] == result.message and result.message.startswith("anchor check_step: LlamaForCausalLM")
    assert result["pass"] is result.passed is True and result.computes == result["computes"] == "intra_doc_reset"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.message = "changed"


def test_every_key_of_the_report_reads_as_before(result):
    keys = ["asked", "computes", "matches", "closest", "reading", "documents", "attn_implementation", "use_cache",
            "dtype", "candidates", "fp32", "bf16", "probe", "attends_across_documents", "error", "pass", "message"]
    assert list(result) == list(result.keys()) == list(StepCheck.KEYS) == keys and len(result) == 17
    fields = {f.name for f in dataclasses.fields(result)}
    assert fields == (set(keys) - {"pass"}) | {"passed"}
    as_dict = dict(result)
    assert as_dict == result.to_dict() and list(as_dict) == keys
    assert all(as_dict[k] is getattr(result, StepCheck.FIELD_OF[k]) for k in keys)
    assert result == as_dict  # equal to the mapping it reads as
    assert "message" in result and "passed" not in result and "nothing" not in result
    assert result.get("bf16") is None and result.get("nothing", "default") == "default"
    with pytest.raises(KeyError):
        result["passed"]


def test_a_report_with_other_keys_is_refused():
    with pytest.raises(ValueError, match="differ from StepCheck.KEYS"):
        StepCheck.of({"message": "m"})
