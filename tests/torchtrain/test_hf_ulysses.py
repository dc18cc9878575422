"""Sequence parallelism in transformers' Trainer (torchtrain.hf.ulysses, DeepSpeed's Ulysses through accelerate):
PackingCollator("anchor") + anchor_varlen on 2 gloo processes with sp_size 2 trains as one process does.

The worker (ulysses_worker.py) trains 3 steps of a tiny Llama with Trainer's defaults (AdamW, max_grad_norm 1)
at the paper's lr 2e-5 and weight decay 0.1, ZeRO-2. Each step's loss equals the one-process run's within the
fp32 rule (1e-6, tests/train/test_zero.py) and so does its gradient norm (1e-5, as there). Without
UlyssesGradients the norms are twice the one-process ones (torchtrain.hf.trainer_sp;
github.com/deepspeedai/DeepSpeed/issues/5248) while the losses, under Adam and clipping, stay equal: the norms
are what this test holds. Measured: losses within 1e-7, norms equal to 7 digits. A wrong slice of doc_ids on
one rank stops both ranks with the one-line check of torchtrain.hf.trainer_sp.check_window, here end to end and
in-process for each kind of wrong slice.

What each rank is fed: DeepSpeed's loader adapter trains each rank's own batch in turn on the whole group, so
ranks fed the same batch train it sp_size times. The guide's arguments without use_cpu=True on a CPU (where
accelerate then counts one process and every rank reads the whole dataset) and sp_size not dividing the
model's heads are refused when the Trainer is built, each rank with one line and no traceback; a train data
loader that feeds every rank the same batches is refused at the first step. Two windows a batch train as one
process does (measured: losses within 1e-7)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from anchor_core.errors import InputError
from tests.train.conftest import ENV
from torchtrain.hf import trainer_sp as hf_ulysses
from torchtrain.parallel.distributed import free_port

WORKER = Path(__file__).with_name("ulysses_worker.py")
CAUGHT = "sequence parallelism: the doc_ids gathered over the 2 ranks are not one window of the anchor variant"


def _run(tmp: Path, sp: int, plant: str = "", logs: Path | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """The worker alone (sp 1) or under torchrun; with `logs`, each rank's stdout and stderr go to its own files
    there (torchrun's --redirects)."""
    out = tmp / f"sp{sp}{plant}.json"
    apart = ["--redirects", "3", "--log-dir", str(logs)] if logs is not None else []
    launch = ([sys.executable, str(WORKER)] if sp == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(sp), "--master_port",
               str(free_port()), *apart, str(WORKER)])
    done = subprocess.run([*launch, str(sp), str(out), *([plant] if plant else [])], capture_output=True, text=True,
                          env=ENV, timeout=300)
    return done, out


def _equal(want: dict, got: dict) -> None:
    """Each step's loss within the fp32 rule (1e-6 relative), each gradient norm within 1e-5."""
    a, b = np.array(want["losses"]), np.array(got["losses"])
    print(f"sp 1 {a}\nsp 2 {b}\nnorms {want['grad_norms']} {got['grad_norms']}")
    assert len(a) == len(b) == 3 and len(want["grad_norms"]) == len(got["grad_norms"]) == 3
    assert (np.abs(a - b) / a).max() <= 1e-6
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=1e-5)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ulysses")
    done, out = _run(tmp, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), tmp


@pytest.mark.slow  # minutes of CPU: make test-all
def test_trainer_under_ulysses_equals_one_process(one_process):
    want, tmp = one_process
    done, out = _run(tmp, 2)
    assert done.returncode == 0, done.stderr[-3000:]
    _equal(want, json.loads(out.read_text()))


@pytest.mark.slow
def test_two_windows_a_batch_train_as_one_process(tmp_path):
    """per_device_train_batch_size 2. The adapter's slices of [2, T] tensors are views on a CPU, which
    transformers' loss cannot flatten with view; here Trainer copies them to its device cpu:0 (use_cpu=True), and
    test_shared_models_get_contiguous_arguments_under_ulysses holds share_gradients' own copy."""
    done, out = _run(tmp_path, 1, "batch2")
    assert done.returncode == 0, done.stderr[-3000:]
    want = json.loads(out.read_text())
    done, out = _run(tmp_path, 2, "batch2")
    assert done.returncode == 0, done.stderr[-3000:]
    _equal(want, json.loads(out.read_text()))


def _refused_on_each_rank(tmp: Path, plant: str, words: str) -> None:
    """The run stops with `words` in one line on each of the 2 ranks, and no rank prints a traceback."""
    logs = tmp / "logs"
    done, out = _run(tmp, 2, plant, logs)
    assert done.returncode != 0 and not out.exists()
    errs = sorted(logs.glob("*/attempt_0/*/stderr.log"))
    assert len(errs) == 2, (done.stderr + done.stdout)[-3000:]
    for rank, err in enumerate(errs):
        text = err.read_text()
        lines = [line for line in text.splitlines() if "error" in line]
        assert "Traceback" not in text and len(lines) == 1, text[-3000:]
        assert f"ulysses_worker.py: error (rank {rank}): " in lines[0] and words in lines[0], lines[0]


# two processes under torchrun each: make test-all; make test holds each check in-process (test_the_heads_check_*,
# test_the_world_check_*)
@pytest.mark.slow
def test_the_guides_arguments_without_use_cpu_on_a_cpu_are_refused(tmp_path):
    """accelerate on a CPU without use_cpu counts one process on every rank: each would read the whole dataset,
    and the adapter would train every window twice (windows 0, 0, 1, 1, ...)."""
    _refused_on_each_rank(tmp_path, "no_use_cpu", "Trainer's arguments count 1 of the 2 processes, so the ranks of "
                          "a sequence-parallel group would be fed the same batches and DeepSpeed's Ulysses loader "
                          "would train each 2 times: on a CPU pass TrainingArguments(use_cpu=True)")


@pytest.mark.slow
def test_sp_size_not_dividing_the_heads_is_refused(tmp_path):
    _refused_on_each_rank(tmp_path, "heads3", "sp_size 2 does not divide the model's 3 attention heads (")


@pytest.mark.slow
def test_a_duplicated_feed_is_refused_at_the_first_step(tmp_path):
    """A train data loader that accelerate did not shard: every rank reads the same batches."""
    _refused_on_each_rank(tmp_path, "duplicated", "ranks 0 and 1 of a sequence-parallel group were given the same "
                          "batch at the first step")


@pytest.mark.slow
def test_without_shared_gradients_the_norms_are_sp_size_times(one_process):
    """What UlyssesGradients corrects: Trainer's Ulysses loss alone gives twice the gradients."""
    want, tmp = one_process
    done, out = _run(tmp, 2, "unshared")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    np.testing.assert_allclose(got["grad_norms"], 2 * np.array(want["grad_norms"]), rtol=1e-5)


@pytest.mark.slow
def test_training_without_shared_gradients_is_refused(tmp_path):
    done, _ = _run(tmp_path, 2, "no_callback")
    assert done.returncode != 0
    assert "pass callbacks=[torchtrain.hf.UlyssesGradients()] to the Trainer" in done.stderr + done.stdout


@pytest.mark.slow  # each kind of wrong slice is caught in-process in make test (test_the_check_names_a_wrong_slice)
@pytest.mark.parametrize("plant", ["moved_boundary", "first_slice", "swapped"])
def test_a_wrong_slice_of_doc_ids_stops_the_run(tmp_path, plant):
    done, _ = _run(tmp_path, 2, plant)
    assert done.returncode != 0
    assert CAUGHT in done.stderr + done.stdout, (done.stderr + done.stdout)[-3000:]


# --- the check, in-process ------------------------------------------------------------------------------------------


def _worker():
    sys.path.insert(0, str(WORKER.parent))
    try:
        import ulysses_worker
    finally:
        sys.path.pop(0)
    return ulysses_worker


def _window(variant: str = "anchor", T: int = 98):
    """Two packed windows of the worker's kind: doc_ids, position_ids, shift_labels (as Ulysses' loader makes them)."""
    import torchtrain.hf as hf

    b = hf.PackingCollator(variant, T, windows=True)(_worker().windows()[:2])
    labels = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[:, 1:]
    return b["doc_ids"].numpy(), b["position_ids"], labels.numpy()


@pytest.mark.parametrize("variant", ["anchor", "intra_doc", "intra_doc_reset", "full"])
def test_the_check_passes_the_collators_windows(variant):
    doc, pos, labels = _window(variant)
    hf_ulysses.check_window(doc, variant, pos, labels, 2)


def _plant(kind: str, doc: np.ndarray) -> np.ndarray:
    doc = doc.copy()
    half = doc.shape[1] // 2
    if kind == "first_slice":
        doc[:, half:] = doc[:, :half]
    elif kind == "swapped":
        doc = np.concatenate([doc[:, half:], doc[:, :half]], axis=1)
    elif kind == "moved_boundary":
        t = next(t for t in range(half + 1, doc.shape[1]) if doc[0, t] != doc[0, t - 1] and doc[0, t] > 0)
        doc[0, t] = doc[0, t - 1]
    return doc


@pytest.mark.parametrize("kind, problem, rank", [
    ("first_slice", "document 0 (the anchor) past slot 0", 1),
    ("swapped", "slot 0 is not document 0", 0),
    ("moved_boundary", "a prediction across a document boundary or from padding is trained on", 1)])
def test_the_check_names_a_wrong_slice(kind, problem, rank):
    doc, pos, labels = _window()
    with pytest.raises(InputError, match=f"{re.escape(problem)} .*in rank {rank}'s slice"):
        hf_ulysses.check_window(_plant(kind, doc), "anchor", pos, labels, 2)


def test_reset_positions_are_held_to_the_doc_ids():
    doc, pos, labels = _window("intra_doc_reset")
    moved = _plant("moved_boundary", doc)
    with pytest.raises(InputError, match="not the variant's positions"):
        hf_ulysses.check_window(moved, "intra_doc_reset", pos, None, 2)


def test_ulysses_arguments_are_checked(monkeypatch):
    import torchtrain.hf as hf

    for args, kw, words in [((0,), {}, "sp_size must be an int >= 1"), ((2, 97), {}, "divisible by sp_size 2"),
                            ((2,), {"attn_implementation": "sdpa"}, "attn_implementation must be one of")]:
        with pytest.raises(InputError, match=words):
            hf.ulysses(*args, **kw)
    with pytest.raises(InputError, match="sp_size must be an int >= 1 that divides seq_len 97"):
        hf.PackingCollator("anchor", 97, first_token_id=1, eos_token_id=2, sp_size=2)
    monkeypatch.setitem(sys.modules, "accelerate.parallelism_config", None)  # an accelerate without it
    with pytest.raises(InputError, match=r"needs accelerate >= 1\.12 .*installed: accelerate \d"):
        hf.ulysses(2, 98)


def test_collator_under_sequence_parallelism_cuts_along_the_sequence():
    import torchtrain.hf as hf

    w = _worker()
    plain = hf.PackingCollator("anchor", 98, windows=True)(w.windows()[:2])
    sp = hf.PackingCollator("anchor", 98, windows=True, sp_size=2)(w.windows()[:2])
    assert {k: v.shape for k, v in sp.items()} == {k: plain["input_ids"].shape for k in plain}
    assert hf.variant_name(sp["variant"][:, 49:]) == "anchor"
    for k in plain:
        if k != "variant":
            assert torch.equal(plain[k], sp[k]), k


# --- what each rank is fed, the heads, the processes counted: in-process ---------------------------------------------


def test_the_feed_check_names_a_duplicated_or_mismatched_feed():
    assert hf_ulysses.feed_problem([(1, 11), (1, 12)], [0, 1]) is None
    assert "ranks 2 and 3 of a sequence-parallel group were given the same batch" in hf_ulysses.feed_problem(
        [(1, 11), (1, 11)], [2, 3])
    assert "every batch would train 4 times" in hf_ulysses.feed_problem([(1, 1), (1, 2), (1, 3), (1, 2)], [0, 1, 2, 3])
    assert "given batches of 2, 1 rows at the first step" in hf_ulysses.feed_problem([(2, 11), (1, 12)], [0, 1])


def test_the_batch_digest_follows_every_tensor():
    import torchtrain.hf as hf

    w = _worker().windows()
    collate = hf.PackingCollator("anchor", 98, windows=True, sp_size=2)
    first, again, other = collate(w[:2]), collate(w[:2]), collate(w[2:4])
    assert hf_ulysses.batch_digest(first) == hf_ulysses.batch_digest(again)
    assert hf_ulysses.batch_digest(first)[0] == 2 and hf_ulysses.batch_digest(first) != hf_ulysses.batch_digest(other)
    again["doc_ids"][1, 50] += 1
    assert hf_ulysses.batch_digest(first) != hf_ulysses.batch_digest(again)
    with pytest.raises(InputError, match="each batch must be a dict of \\[B, T\\] tensors with input_ids"):
        hf_ulysses.batch_digest([first])


def test_the_heads_check_names_the_sp_sizes_that_fit():
    from transformers import LlamaConfig

    def config(heads, kv):
        return LlamaConfig(hidden_size=16 * heads, num_attention_heads=heads, num_key_value_heads=kv)

    hf_ulysses.check_heads(config(4, 2), 2)
    hf_ulysses.check_heads(config(4, 1), 4)  # key/value heads replicated
    with pytest.raises(InputError, match=r"^sp_size 2 does not divide the model's 3 attention heads \(.*\): "
                                         r"use sp_size 1, 3 in torchtrain.hf.ulysses"):
        hf_ulysses.check_heads(config(3, 3), 2)
    with pytest.raises(InputError, match=r"^sp_size 2 and the model's 3 key/value heads do not divide one "
                                         r"another \(.*\): use sp_size 1, 3, 6 in"):
        hf_ulysses.check_heads(config(6, 3), 2)


def test_the_world_check_asks_for_use_cpu():
    hf_ulysses.check_world(2, 2, 2)
    with pytest.raises(InputError, match=r"count 1 of the 4 processes.*train each 4 times: on a CPU pass "
                                         r"TrainingArguments\(use_cpu=True\)"):
        hf_ulysses.check_world(1, 4, 4)


def test_shared_models_get_contiguous_arguments_under_ulysses(monkeypatch):
    """The adapter's slice of a [2, T] tensor on a CPU is a view; transformers' loss flattens it with view."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    labels = torch.randint(0, 32, (2, 8))[:, 2:6]
    assert not labels.is_contiguous()
    inputs = {"input_ids": labels.clone(), "labels": labels, "shift_labels": labels}  # as Trainer passes them
    with torch.no_grad():  # no gradient: the loss hook of share_gradients leaves the loss alone
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            model(**inputs)
        hf_ulysses.share_gradients(model)
        monkeypatch.setattr(hf_ulysses, "sp_group", lambda: object())  # as under Ulysses
        seen = {}
        model.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
        out = model(**inputs)
    assert seen["shift_labels"].is_contiguous() and torch.equal(seen["shift_labels"], labels)
    assert torch.isfinite(out.loss)
