"""The step a user runs, checked as a black box (parity_tests.blackbox): a stock LlamaForCausalLM on a batch of
transformers' own DataCollatorWithFlattening. With use_cache at its default transformers builds a cache and
then reads no documents from the restarting position_ids (it looks for packed sequences only where
past_key_values is None): the step attends across documents, and the perturbation probe sees the later
documents move. With use_cache=False it computes intra_doc_reset and no document moves."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from anchor_core.errors import InputError  # noqa: E402
from anchor.pytest_plugin import check_step_or_fail  # noqa: E402
from parity_tests.blackbox import check_step, infer_documents  # noqa: E402

LENGTHS = (13, 7, 19, 11, 5)  # odd documents, T = 55


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=331, hidden_size=84, intermediate_size=97, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def features():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 331, (n,), generator=g).tolist()} for n in LENGTHS]


def _flattened(features, **kw):
    return transformers.DataCollatorWithFlattening(return_tensors="pt", **kw)(features)


@pytest.fixture(scope="module")
def no_cache_model(llama):
    """The model with use_cache=False in its config (a copy): the step the fixture tests run."""
    model = copy.deepcopy(llama)
    model.config.use_cache = False
    return model


def test_default_use_cache_attends_across_documents(llama, features):
    batch = _flattened(features)
    before = {k: v.clone() for k, v in batch.items()}
    assert llama.config.use_cache is True and "use_cache" not in batch
    r = check_step(llama, batch)
    assert set(batch) == set(before) and all(torch.equal(batch[k], v) for k, v in before.items())  # run as given
    assert r["documents"]["source"] == "position_ids" and r["documents"]["lengths"] == [list(LENGTHS)]
    assert r["use_cache"] is True
    assert r["computes"] is None and r["matches"] == [] and not r["pass"]
    assert r["reading"]["mask"] == "full" and r["attends_across_documents"] is True
    assert r["probe"]["document"] == 1 and r["probe"]["moved"] == [(0, d) for d in range(2, len(LENGTHS) + 1)]
    message = r["message"]
    assert "\n" not in message
    assert "it computes none of the variants: full attention (across documents) at the batch's position_ids" in message
    assert "against full it first diverges at layer 0, quantity `q`: relative L2 error" in message
    assert "document(s) 2, 3, 4, 5 moved" in message


@pytest.mark.parametrize("where", ["config", "batch"])
def test_use_cache_false_computes_intra_doc_reset(llama, features, where):
    model, batch = copy.deepcopy(llama), _flattened(features)
    if where == "config":
        model.config.use_cache = False
    else:
        batch["use_cache"] = False
    r = check_step(model, batch)
    assert r["use_cache"] is False
    assert r["computes"] == "intra_doc_reset" and r["matches"] == ["intra_doc_reset"] and r["pass"]
    assert r["attends_across_documents"] is False and r["bf16"] is None
    assert r["probe"]["ran"] and r["probe"]["moved"] == []
    # the changed document itself moved far above the threshold: the probe can see a move
    assert r["probe"]["change"]["0:1"] > 1e3 * r["probe"]["threshold"]
    assert "it computes intra_doc_reset. The perturbation probe changed document 1's tokens and no other " \
           "document moved." in r["message"]


def test_a_4d_anchor_mask_computes_anchor(llama):
    """A collator's own 4-D mask (every slot sees its document and slot 0) is honoured with the cache on too;
    the probe keeps slot 0, the anchor every document sees, so no other document moves."""
    T = sum(LENGTHS)
    d, j = torch.from_numpy(_ids(*LENGTHS)), torch.arange(T)
    allowed = ((d[:, :, None] == d[:, None, :]) | (j == 0)) & torch.ones(T, T, dtype=torch.bool).tril()
    batch = {"input_ids": torch.randint(0, 331, (1, T), generator=torch.Generator().manual_seed(2)),
             "attention_mask": allowed[:, None]}
    r = check_step(llama, batch, variants=["anchor"])
    assert r["documents"]["source"] == "attention_mask" and r["documents"]["lengths"] == [list(LENGTHS)]
    assert r["computes"] == "anchor" and r["matches"] == ["anchor"] and r["pass"]
    assert r["probe"]["moved"] == [] and r["probe"]["changed_slots"] == LENGTHS[0] - 1


def test_bf16_model_passes_the_bf16_rule(llama, features):
    model = copy.deepcopy(llama).to(torch.bfloat16)
    model.config.use_cache = False
    r = check_step(model, _flattened(features, return_flash_attn_kwargs=True))
    assert r["documents"]["source"] == "cu_seq_lens_q" and r["documents"]["disagree"] == []
    assert r["dtype"] == "bfloat16" and r["computes"] == "intra_doc_reset"
    assert r["bf16"]["pass"] and r["bf16"]["policy"].startswith("sdpa_cpu_bf16")
    assert r["bf16"]["summary"]["logits_rel_l2"] > 0  # it did run in bfloat16
    assert "passes the bf16 rule" in r["message"] and r["pass"]


def test_the_fixture_fails_with_one_paragraph(no_cache_model, features):
    with pytest.raises(pytest.fail.Exception) as e:
        check_step_or_fail(no_cache_model, _flattened(features), variants=["intra_doc"], probe=False)
    message = e.value.msg
    assert not e.value.pytrace and "\n" not in message
    assert message.startswith("anchor check_step: LlamaForCausalLM (sdpa, use_cache=False, float32) on 5 document(s) "
                              "(from position_ids), asked for intra_doc: it computes intra_doc_reset instead; "
                              "against intra_doc it first diverges at layer 0, quantity `q`: relative L2 error ")
    # the documents whose positions differ from intra_doc's (all but the first), where they start
    firsts = np.cumsum(LENGTHS)[:-1]
    assert message.endswith("> tolerance 1e-05, in documents " + ", ".join(
        f"{d} (first slot {s})" for d, s in zip(range(2, len(LENGTHS) + 1), firsts)) + ".")


def test_a_forward_that_raises_is_the_finding(no_cache_model, features):
    def broken(module, query, key, value, attention_mask, **kwargs):
        raise RuntimeError("this attention cannot read packed batches\nsecond line")

    transformers.AttentionInterface.register("anchor_test_broken", broken)
    try:
        model = copy.deepcopy(no_cache_model)
        model.set_attn_implementation("anchor_test_broken")
        r = check_step(model, _flattened(features))
    finally:
        transformers.AttentionInterface._global_mapping.pop("anchor_test_broken", None)
    assert not r["pass"] and r["computes"] is None
    assert r["message"].endswith("asked for any of the four variants: model(**batch) raised RuntimeError: this "
                                 "attention cannot read packed batches.")


def test_the_fixture_returns_the_report(anchor_check_step, no_cache_model, features):
    r = anchor_check_step(no_cache_model, _flattened(features), variants="intra_doc_reset", probe=False)
    assert r["computes"] == "intra_doc_reset" and r["probe"] is None


@pytest.mark.parametrize("batch, kw, says", [
    ({"position_ids": torch.arange(5)[None]}, {}, "anchor_check_step: batch: no input_ids (its keys: position_ids)"),
    ([torch.arange(5)[None]], {}, "anchor_check_step: batch: expected the dict of tensors your loop passes to "
                                  "model(**batch), got a list"),
    ("ok", {"variants": ["intra-doc"]}, "anchor_check_step: variants: unknown variant 'intra-doc' (known: all, full,"),
    ("ok", {"variant": "full"}, "anchor_check_step: unknown keyword 'variant' (known: model, batch, variants,"),
    ("ok", {"doc_ids": np.zeros((2, 3), dtype=np.int64)}, "anchor_check_step: doc_ids: expected integer ids [B, T] = "
                                                          "[1, 5]"),
    ("ok", {"dtype": "float16"}, "anchor_check_step: dtype: expected None (the model's own), float32 or bfloat16"),
])
def test_the_fixture_input_errors_are_one_paragraph(llama, batch, kw, says):
    batch = {"input_ids": torch.arange(5)[None]} if batch == "ok" else batch
    with pytest.raises(pytest.fail.Exception) as e:
        check_step_or_fail(llama, batch, **kw)
    assert not e.value.pytrace and "\n" not in e.value.msg
    assert e.value.msg.startswith(says), e.value.msg


# ---------------------------------------------------------------------------------------------
# Where the documents are read from (no model)


def _ids(*lengths):
    return np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None]


def test_documents_from_each_source_agree():
    lengths, T = (3, 5, 1, 6), 15
    ids = torch.zeros(1, T, dtype=torch.long)
    pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])[None])
    cu = torch.from_numpy(np.r_[0, np.cumsum(lengths)])
    d = torch.from_numpy(_ids(*lengths))
    allowed = (d[:, :, None] == d[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    additive = torch.zeros(1, 1, T, T).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    want = _ids(*lengths)
    for batch, source in [({"input_ids": ids, "position_ids": pos}, "position_ids"),
                          ({"input_ids": ids, "cu_seq_lens_q": cu, "position_ids": pos}, "cu_seq_lens_q"),
                          ({"input_ids": ids, "attention_mask": allowed[:, None]}, "attention_mask"),
                          ({"input_ids": ids, "attention_mask": additive, "position_ids": pos}, "attention_mask")]:
        docs = infer_documents(batch)
        assert docs["source"] == source and docs["disagree"] == []
        np.testing.assert_array_equal(docs["doc_ids"], want)
    given = infer_documents({"input_ids": ids}, doc_ids=[7] * 3 + [2] * 5 + [9] + [4] * 6)  # renumbered in order
    assert given["source"] == "doc_ids"
    np.testing.assert_array_equal(given["doc_ids"], want)


def test_documents_padding_and_disagreement():
    T = 9
    batch = {"input_ids": torch.zeros(2, T, dtype=torch.long),
             "attention_mask": torch.tensor([[1] * T, [1] * 6 + [0] * 3]),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(T))])}
    docs = infer_documents(batch)
    np.testing.assert_array_equal(docs["doc_ids"], [[1, 1, 1, 2, 2, 3, 3, 3, 3], [1] * 6 + [-1] * 3])
    assert docs["counts"] == [3, 1] and docs["lengths"] == [[3, 2, 4], [6]]
    assert infer_documents({"input_ids": torch.zeros(1, T, dtype=torch.long)})["source"] == "rows"
    mixed = {"input_ids": torch.zeros(1, T, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 4, T]),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])}
    docs = infer_documents(mixed)
    assert docs["source"] == "cu_seq_lens_q" and docs["disagree"] == ["position_ids"]
    with pytest.raises(InputError, match=r"batch\['cu_seq_lens_q'\]: expected increasing offsets"):
        infer_documents({**mixed, "cu_seq_lens_q": torch.tensor([0, 5, 4])})
