"""The black-box check (parity_tests.blackbox.check_step) on the batches real loops build: our own
PackingCollator's (documents in its `doc_ids` key), 4-D masks with padding, a bf16 additive mask, and two
planted bugs it must name: a mask off by one slot (each document also sees the previous document's last
token) and one document's positions shifted by one."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxref  # noqa: E402
import torchtrain.hf  # noqa: E402  (registers the anchor_* attention functions)
from anchor_core.errors import InputError  # noqa: E402
from anchor_core.variants import VARIANTS  # noqa: E402
from parity_tests.blackbox import check_step, infer_documents  # noqa: E402

SEQ_LEN = 127
VOCAB = 331
FIRST, EOS = 1, 2
LENGTHS = (23, 17, 31, 9, 17)  # odd documents, T = 97


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    bos_token_id=FIRST, eos_token_id=EOS)


@pytest.fixture(scope="module")
def anchor_llama():
    """A random Llama whose attention is torchtrain's sdpa engine, reading doc_ids and variant from the batch."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(_config(), attn_implementation="anchor_sdpa",
                                                       dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama():
    """The same shape with transformers' own sdpa (it reads a 4-D attention_mask as given)."""
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(_config()).eval()
    model.config.use_cache = False
    return model


@pytest.fixture(scope="module")
def features():
    rng = np.random.default_rng(5)
    return [{"input_ids": rng.integers(3, VOCAB, int(n)).tolist()} for n in rng.integers(5, 151, 7)]


def _ids(lengths, T=None, pad=0):
    row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.full(pad, -1)])
    return row[None] if T is None else row[None, :T]


def _first_slots(lengths):
    return np.r_[0, np.cumsum(lengths)[:-1]].tolist()


# ---------------------------------------------------------------------------------------------
# Our own collator's batch: the documents are in its doc_ids key


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_packing_collator_batch_is_read_from_its_doc_ids(anchor_llama, features, variant):
    batch = torchtrain.hf.PackingCollator(variant, SEQ_LEN, first_token_id=FIRST, eos_token_id=EOS)(features)
    assert batch["input_ids"].shape[0] > 1 and (batch["doc_ids"] == -1).any()  # several rows, one padded
    r = check_step(anchor_llama, batch, variants=variant)
    print(r["message"])
    docs = r["documents"]
    assert docs["source"] == "batch_doc_ids" and docs["disagree"] == []
    # the collator's ids, the anchor slot (0, anchor variant) counted with the document slot 1 opens
    want = batch["doc_ids"].numpy()
    counts = [len(set(row[row > 0].tolist())) for row in want]
    assert docs["counts"] == counts
    assert r["computes"] == variant and r["pass"], r["message"]
    # the probe sees documents move where the variant lets them see each other, and only there
    assert r["probe"]["ran"] and bool(r["probe"]["moved"]) == (variant == "full")


def test_the_batch_doc_ids_come_after_the_argument_and_before_the_other_sources():
    T = 15
    given = _ids((3, 5, 7))
    key = _ids((4, 11))
    batch = {"input_ids": torch.zeros(1, T, dtype=torch.long), "doc_ids": torch.from_numpy(key),
             "position_ids": torch.from_numpy(np.concatenate([np.arange(n) for n in (3, 5, 7)])[None])}
    by_key = infer_documents(batch)
    assert by_key["source"] == "batch_doc_ids" and by_key["disagree"] == ["position_ids"]
    np.testing.assert_array_equal(by_key["doc_ids"], key)
    by_argument = infer_documents(batch, doc_ids=given)
    assert by_argument["source"] == "doc_ids" and by_argument["disagree"] == ["batch_doc_ids"]
    np.testing.assert_array_equal(by_argument["doc_ids"], given)
    anchor = np.r_[0, key[0, 1:]][None]  # the anchor slot counts with the document after it
    np.testing.assert_array_equal(infer_documents({**batch, "doc_ids": torch.from_numpy(anchor)})["doc_ids"], key)
    with pytest.raises(InputError, match=r"batch\['doc_ids'\]: expected integer ids \[B, T\] = \[1, 15\]"):
        infer_documents({**batch, "doc_ids": torch.full((1, T), -2)})


# ---------------------------------------------------------------------------------------------
# 4-D masks: the earliest key each slot sees


def _mask(doc_ids, variant, padding="sees itself"):
    """The variant's mask (§2: padding sees only itself), or with padding rows fully masked."""
    allowed = np.asarray(jaxref.variants.attention_mask(doc_ids, variant))
    if padding == "fully masked":
        allowed &= (doc_ids >= 0)[:, :, None]
    return allowed


def _off_by_one(lengths):
    """intra_doc's mask where each document also sees the last slot of the document before it."""
    allowed = _mask(_ids(lengths), "intra_doc")
    for s, n in list(zip(_first_slots(lengths), lengths))[1:]:
        allowed[0, s:s + n, s - 1] = True
    return allowed


@pytest.mark.parametrize("variant", ["full", "intra_doc", "anchor", "causal", "off by one"])
def test_a_4d_mask_reads_documents_by_the_earliest_key_each_slot_sees(variant):
    lengths = LENGTHS
    d = _ids(lengths)
    T = d.shape[1]
    allowed = {"causal": np.tril(np.ones((1, T, T), dtype=bool)), "off by one": _off_by_one(lengths)}.get(
        variant, None)
    allowed = _mask(d, variant) if allowed is None else allowed
    docs = infer_documents({"input_ids": torch.zeros(1, T, dtype=torch.long),
                            "attention_mask": torch.from_numpy(allowed[:, None])})
    want = [[T]] if variant in ("full", "causal") else [list(lengths)]
    assert docs["source"] == "attention_mask" and docs["lengths"] == want


@pytest.mark.parametrize("padding", ["fully masked", "sees itself"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_padded_4d_mask_reads_padding_and_a_correct_step_passes(llama, variant, padding):
    T = 97
    d = np.concatenate([_ids((31, 41, 25)), _ids((51, 23), T, pad=T - 74)])
    if variant == "anchor":
        d[:, 0] = 0
    allowed = _mask(d, variant, padding)
    batch = {"input_ids": torch.randint(3, VOCAB, (2, T), generator=torch.Generator().manual_seed(7)),
             "attention_mask": torch.from_numpy(allowed[:, None]),
             "position_ids": torch.from_numpy(np.asarray(jaxref.positions(d, variant), dtype=np.int64))}
    r = check_step(llama, batch, variants=variant)
    print(r["message"])
    # full attention's mask cannot tell documents apart: one per row, up to the padding
    assert r["documents"]["lengths"] == ([[T], [74]] if variant == "full" else [[31, 41, 25], [51, 23]])
    assert r["computes"] == variant and r["pass"], r["message"]


def test_a_2d_mask_with_zeros_is_padding_and_a_correct_step_passes(llama):
    T = 97
    real = np.ones((2, T), dtype=np.int64)
    real[1, 61:] = 0
    batch = {"input_ids": torch.randint(3, VOCAB, (2, T), generator=torch.Generator().manual_seed(8)),
             "attention_mask": torch.from_numpy(real)}
    r = check_step(llama, batch, variants="full")
    assert r["documents"]["source"] == "rows" and r["documents"]["lengths"] == [[T], [61]]
    assert r["computes"] == "full" and r["pass"], r["message"]


def test_an_off_by_one_mask_fails_and_names_the_documents_that_move(llama):
    allowed = _off_by_one(LENGTHS)
    T = allowed.shape[-1]
    batch = {"input_ids": torch.randint(3, VOCAB, (1, T), generator=torch.Generator().manual_seed(9)),
             "attention_mask": torch.from_numpy(allowed[:, None])}
    r = check_step(llama, batch, variants="intra_doc")
    print(r["message"])
    assert r["documents"]["lengths"] == [list(LENGTHS)]
    assert not r["pass"] and r["computes"] != "intra_doc"
    probe = r["probe"]
    assert probe["ran"] and probe["documents_changed"] == [1, 2, 3, 4]
    for d in probe["documents_changed"]:  # document d + 1 sees d's last token
        assert (0, d + 1) in probe["moved_by"][d] and all(m > d for _, m in probe["moved_by"][d])
    firsts = _first_slots(LENGTHS)
    assert (f"document(s) 2, 3, 4, 5 moved (first slots {', '.join(map(str, firsts[1:]))};" in r["message"])
    assert "changing 1 moved 2, 3" in r["message"]
    # the verdict names the documents that differ from intra_doc at the first diverging tap, and where they start
    assert [(x["row"], x["document"], x["first_slot"]) for x in r["fp32"]["documents"]] == \
           [(0, d, firsts[d - 1]) for d in range(2, 6)]


# ---------------------------------------------------------------------------------------------
# A bf16 additive mask


def _bf16_mask_batch():
    d = _ids(LENGTHS)
    T = d.shape[1]
    allowed = torch.from_numpy(_mask(d, "intra_doc")[:, None])
    mask = torch.zeros(1, 1, T, T, dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min)
    return {"input_ids": torch.randint(3, VOCAB, (1, T), generator=torch.Generator().manual_seed(10)),
            "attention_mask": mask}


def test_a_bf16_additive_mask_of_a_bf16_model_is_given_to_each_copy_in_its_dtype(llama):
    """A bf16 loop's mask: the float32 copy gets it in float32 (sdpa refuses a bf16 mask on fp32 queries)."""
    batch = _bf16_mask_batch()
    r = check_step(copy.deepcopy(llama).to(torch.bfloat16), batch, variants="intra_doc")
    assert r["error"] is None and r["documents"]["lengths"] == [list(LENGTHS)]
    assert r["computes"] == "intra_doc" and r["pass"] and r["bf16"] is not None, r["message"]
    assert batch["attention_mask"].dtype == torch.bfloat16  # the user's batch is left as it is


def test_a_mask_in_another_dtype_than_the_model_is_run_as_given(llama):
    """An fp32 model with a bf16 mask: the copies run what the model runs, so the check reports what the model
    does with it (sdpa refuses it)."""
    batch = _bf16_mask_batch()
    model = copy.deepcopy(llama)
    try:
        model(**batch)
        own = None
    except Exception as e:  # noqa: BLE001  (whatever the model raises is what the check must report)
        own = str(e).splitlines()[0]
    r = check_step(model, batch, variants="intra_doc")
    if own is None:
        assert r["error"] is None and r["computes"] == "intra_doc", r["message"]
    else:
        assert r["error"] is not None and not r["pass"] and own[:40] in r["message"], (own, r["message"])


# ---------------------------------------------------------------------------------------------
# A planted positions error: the report names the document


def test_a_shifted_document_is_named_with_its_first_slot(anchor_llama):
    lengths = (37, 23, 45, 61, 19)
    rng = np.random.default_rng(11)
    features = [{"input_ids": rng.integers(3, VOCAB, n).tolist()} for n in lengths]
    batch = torchtrain.hf.PackingCollator("intra_doc_reset", SEQ_LEN, first_token_id=FIRST, eos_token_id=EOS)(features)
    row = batch["doc_ids"][0].numpy()
    first = int(np.argmax(row == 2))
    assert (row == 3).any()  # document 2 of row 0 is whole, another follows it
    batch["position_ids"][0, row == 2] += 1
    r = check_step(anchor_llama, batch, variants="intra_doc_reset")
    print(r["message"])
    assert not r["pass"]
    assert [(x["row"], x["document"], x["first_slot"]) for x in r["fp32"]["documents"]] == [(0, 2, first)]
    assert f"in row 0 document 2 (first slot {first})" in r["message"]
