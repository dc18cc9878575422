"""Stock transformers (5.23) and users' attention functions under the oracle (parity_tests.hf_stack).

The "instead" findings are asserted as observed: each test below fails once transformers computes the
variant asked from the inputs it documents for packed sequences (the default input style,
flattening-nocache), and says why this version does not. Every case runs on random:llama at T = 97 (two
windows, the second padded, one- and two-token documents). The other input styles: test_hf_inputs.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from anchor_core.variants import VARIANTS
from parity_tests import planted_attention as planted
from parity_tests.conftest import needs_smollm2
from parity_tests.hf_stack import (Stack, describe_row, hold, module_subject, named_subject, packed_positions,
                                   run_hf_stack, run_stack, stock, subject_inputs, user_stack)
from parity_tests.runners import oracle
from parity_tests.suite import where

MODEL = "random:llama"
FP32 = ("float32",)


def _hold(stack: Stack, variant: str, dtypes=FP32, model: str = MODEL) -> dict:
    row = hold(named_subject(model), stack, variant, seq_len=97, dtypes=dtypes)
    print(f"{row['implementation']} asked {variant}: {describe_row(row)}")
    if row["candidates"]:
        print("  worst error / fp32 tolerance per variant:",
              {v: f"{c['worst_margin']:.3g}" for v, c in row["candidates"].items()})
    return row


def _first(row: dict, key: str = "fp32") -> tuple:
    first = row[key]["first_divergence"]
    return first["layer"], first["tap"]


def test_packed_positions_restart_at_every_document():
    doc = np.array([[0, 1, 1, 2, 2, 2, -1, -1], [1, 1, 1, 1, 2, 3, 3, -1]])
    assert packed_positions(doc).tolist() == [[0, 0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 0, 0, 1, 0]]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", ["full", "intra_doc_reset"])
def test_stock_computes_full_and_intra_doc_reset_and_passes_the_bf16_rule(implementation, variant):
    """One sequence gives causal attention over the window; documents flattened as DataCollatorWithFlattening
    makes them give per-document attention at per-document positions: the two variants transformers can
    express, each held by the bf16 rule against its emulation (eager: hf_bf16; sdpa: the CPU kernel's)."""
    row = _hold(stock(implementation), variant, dtypes=("float32", "bfloat16"))
    assert row["status"] == "computes" and row["fp32"]["pass"]
    assert row["bf16"]["pass"], where(row["bf16"]["first_divergence"])


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_stock_asked_for_intra_doc_computes_intra_doc_reset(implementation):
    """transformers 5.23 finds documents only where position_ids restart (masking_utils.
    find_packed_sequence_indices); the causal rule then compares those positions. So documents cannot be
    kept apart while the positions run on over the window: asked for intra_doc (document mask, slot-index
    positions) it computes intra_doc_reset, and the first divergence is layer 0's q (its rotation)."""
    row = _hold(stock(implementation), "intra_doc")
    assert row["status"] == "instead" and row["computes"] == "intra_doc_reset"
    assert _first(row) == (0, "q")


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_stock_asked_for_anchor_computes_intra_doc_reset(implementation):
    """The anchor (slot 0, visible to every document) has no expression in transformers' packed inputs:
    as a sequence of its own it is visible to nobody else, and every document restarts its positions. Asked
    for anchor, it computes intra_doc_reset on the anchor's documents (the anchor slot alone)."""
    row = _hold(stock(implementation), "anchor")
    assert row["status"] == "instead" and row["computes"] == "intra_doc_reset"
    assert _first(row) == (0, "q")


@pytest.mark.slow  # compiling flex on the CPU: tests/torchtrain/test_engines.py's flex cases run it in make test
def test_flex_attention_computes_intra_doc_reset_for_intra_doc_and_anchor():
    """flex_attention builds its BlockMask from the same mask function as eager and sdpa (forward only on
    the CPU; compiling it takes most of this test): the same two findings. The variant it computes, at a
    second length in the same process (T = 129 after 97: `run_stack` compiles for static shapes, since
    dynamo's dynamic-shape recompile of transformers' compiled flex fails in torch's CPU code generator)."""
    for variant in ("intra_doc", "anchor"):
        row = _hold(stock("flex_attention"), variant)
        assert row["status"] == "instead" and row["computes"] == "intra_doc_reset"
    row = hold(named_subject(MODEL), stock("flex_attention"), "intra_doc_reset", seq_len=129, dtypes=FP32)
    print(f"T=129: {describe_row(row)}")
    assert row["status"] == "computes", row["error"]


def test_the_variants_own_positions_attend_across_documents():
    """Given the position_ids the variant defines (slot index, as torchtrain's engines get them) and no
    other sign of the documents, sdpa attends across documents: full attention, first divergence at layer
    0's attention output (q and k are right)."""
    row = _hold(Stack("sdpa", "sdpa", positions="variant"), "intra_doc")
    assert row["status"] == "instead" and row["computes"] == "full"
    assert _first(row) == (0, "attn_out")


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_an_attention_mask_of_ones_attends_across_documents(implementation):
    """With any 2-D attention_mask, even all ones (a tokenizer's batch carries one), transformers skips its
    packed-sequence detection (masking_utils._preprocess_mask_arguments looks at position_ids only when
    attention_mask is None): the flattened documents attend to each other at their restarted positions.
    That is none of the four variants; the oracle's full mask at those positions is what it computes."""
    import jaxref

    subject = named_subject(MODEL)
    stack = Stack(implementation, implementation, attention_mask=True)
    row = _hold(stack, "intra_doc_reset")
    assert row["status"] == "none"
    inputs = subject_inputs(subject, "intra_doc_reset", 97)
    test = run_stack(subject, stack, inputs, "intra_doc_reset", "float32")["logits"][0]
    pos = packed_positions(inputs.doc_ids)
    across = np.asarray(jaxref.forward(subject.params, subject.spec, inputs.tokens, positions=pos,
                                       doc_ids=inputs.doc_ids, variant="full", policy="fp64"))
    within = oracle(subject, inputs, "intra_doc_reset", "fp64")["logits"][0]
    real = inputs.real
    rel = lambda a, b: float(np.linalg.norm(a[real] - b[real]) / np.linalg.norm(b[real]))  # noqa: E731
    print(f"logits vs full mask at restarted positions {rel(test, across):.2e}, vs intra_doc_reset {rel(test, within):.2e}")
    assert rel(test, across) < 1e-5 < 1e-2 < rel(test, within)


def test_flash_attention_2_is_reported_as_not_run_with_the_reason():
    row = _hold(stock("flash_attention_2"), "anchor")
    assert row["status"] == "not_run" and "CUDA" in row["reason"]


# ---------------------------------------------------------------------------------------------
# A user's attention function: a correct one passes, planted defects are caught and localised


def _user(fn, variant: str, dtypes=FP32, rope_in: str = "attention") -> dict:
    return _hold(user_stack(fn, rope_in=rope_in), variant, dtypes=dtypes)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_correct_function_computes_every_variant(variant):
    row = _user(planted.correct, variant)
    assert row["status"] == "computes" and row["fp32"]["pass"]


@pytest.mark.parametrize("variant", ["intra_doc_reset", "anchor"])
def test_a_correct_function_passes_the_bf16_rule(variant):
    """RoPE in fp32 inside the function, q and k cast to bf16: held against paper_bf16 (the default
    emulation with rope_in="attention")."""
    row = _user(planted.correct, variant, dtypes=("float32", "bfloat16"))
    assert row["status"] == "computes" and row["bf16"]["policy"] == "paper_bf16" and row["bf16"]["pass"]


def test_bf16_cos_sin_tables_are_caught_at_layer_0_q():
    row = _user(planted.bf16_tables, "anchor")
    assert row["status"] == "none" and row["closest"] == "anchor"
    assert _first(row) == (0, "q")


def test_inv_freq_in_bf16_is_caught_at_layer_0_q():
    row = _user(planted.inv_freq_bf16, "anchor")
    assert row["status"] == "none" and row["closest"] == "anchor"
    assert _first(row) == (0, "q")


def test_a_missing_document_mask_computes_full_and_diverges_at_layer_0_attention():
    row = _user(planted.no_document_mask, "intra_doc")
    assert row["status"] == "instead" and row["computes"] == "full"
    assert _first(row) == (0, "attn_out")


def test_positions_not_reset_compute_intra_doc_and_diverge_at_layer_0_q():
    row = _user(planted.positions_not_reset, "intra_doc_reset")
    assert row["status"] == "instead" and row["computes"] == "intra_doc"
    assert _first(row) == (0, "q")


def test_a_function_in_transformers_convention_gets_rotated_q_and_k():
    """rope_in="model": the function only masks and attends; q and k come rotated at the variant's positions."""
    row = _user(planted.mask_only, "anchor", rope_in="model", dtypes=("float32", "bfloat16"))
    assert row["status"] == "computes" and row["bf16"]["policy"] == "fa2_bf16" and row["bf16"]["pass"]


def test_a_function_that_raises_is_an_error_row():
    def broken(module, query, key, value, attention_mask, **kwargs):
        raise RuntimeError("not implemented for GQA\nsecond line")

    row = _user(broken, "full", rope_in="model")
    assert row["status"] == "error" and row["error"] == "RuntimeError: not implemented for GQA"


# ---------------------------------------------------------------------------------------------
# The Python API on a user's module, and the CLI


def _users_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=331, hidden_size=84, intermediate_size=97, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(dtype).eval()


def test_a_users_module_is_held_as_built():
    """run_hf_stack on a module the user built: an fp32 one computes intra_doc_reset with sdpa; the same
    built with .to(torch.bfloat16) carries RoPE frequencies in bf16 (TOOLCHAIN-FACTS), caught at layer 0's q."""
    good = run_hf_stack(_users_llama(), implementations=["sdpa"], variants=["intra_doc_reset"], dtypes=FP32)
    print(describe_row(good["rows"][0]))
    assert good["rows"][0]["status"] == "computes" and good["model"] == "module:LlamaForCausalLM"
    module = _users_llama(torch.bfloat16)
    assert module.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    bad = run_hf_stack(module, implementations=["sdpa"], variants=["intra_doc_reset"], dtypes=FP32)
    print(describe_row(bad["rows"][0]))
    assert bad["rows"][0]["status"] == "none" and _first(bad["rows"][0]) == (0, "q")


def test_a_module_of_an_unsupported_family_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from anchor_core.errors import InputError

    with pytest.raises(InputError, match="unsupported architecture"):
        module_subject(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=400)))


def _run(argv: list[str]) -> int:
    from anchor.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code)


def test_cli_holds_a_users_function_and_exits_1_on_a_finding(tmp_path, capsys):
    out = tmp_path / "hf"
    rc = _run(["parity", "--stack", "hf", "--model", MODEL, "--out", str(out), "--variants", "intra_doc,full",
               "--attention", "parity_tests.planted_attention:no_document_mask", "--rope-in", "attention",
               "--policies", "fp32", "--no-progress"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 1 and "computes `full` instead" in printed
    report = json.loads((out / "parity.json").read_text())
    assert report["stack"] == "hf" and report["machine"]["cpu_count"] and not report["pass"]
    row = {r["variant"]: r for r in report["rows"]}
    assert row["full"]["status"] == "computes" and row["intra_doc"]["computes"] == "full"
    assert row["intra_doc"]["implementation"] == "parity_tests.planted_attention:no_document_mask"
    assert (out / "summary.md").read_text().startswith("# transformers")


def test_cli_stock_rows_pass_where_they_compute_the_variant(tmp_path, capsys):
    out = tmp_path / "hf"
    rc = _run(["parity", "--stack", "hf", "--model", MODEL, "--out", str(out), "--variants", "full",
               "--attn-implementation", "sdpa,flash_attention_2", "--policies", "fp32", "--no-progress"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 0 and "| `flash_attention_2` | `flattening-nocache` | not run |" in printed
    rows = json.loads((out / "parity.json").read_text())["rows"]
    assert [(r["implementation"], r["inputs"], r["status"], r["computes"]) for r in rows] == [
        ("sdpa", "flattening-nocache", "computes", "full"),
        ("flash_attention_2", "flattening-nocache", "not_run", None)]


@pytest.mark.parametrize("argv,message", [
    (["--engines", "sdpa"], "--engines applies to --stack torch"),
    (["--attention", "json:nosuch"], "has no 'nosuch'"),
    (["--attention", "json"], "expected pkg.module:function"),
    (["--attn-implementation", "flash_attention_3"], "unknown implementation"),
    (["--policies", "bf16"], "fp32 or fp32,bf16"),
    (["--rope-in", "attention"], "apply to --attention"),
])
def test_cli_usage_errors_exit_2(tmp_path, capsys, argv, message):
    rc = _run(["parity", "--stack", "hf", "--model", MODEL, "--out", str(tmp_path / "hf"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not (tmp_path / "hf").exists()


def test_cli_torch_stack_refuses_hf_options(tmp_path, capsys):
    rc = _run(["parity", "--model", MODEL, "--out", str(tmp_path / "p"), "--attn-implementation", "sdpa"])
    assert rc == 2 and "applies to --stack hf" in capsys.readouterr().err


@pytest.mark.slow
@needs_smollm2
@pytest.mark.model
def test_smollm2_asked_for_intra_doc_computes_intra_doc_reset():
    """The finding on the real model (T = 97, one window of documents of 64+ tokens)."""
    row = _hold(stock("sdpa"), "intra_doc", model="default")
    assert row["status"] == "instead" and row["computes"] == "intra_doc_reset"
