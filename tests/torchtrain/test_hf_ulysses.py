"""Sequence parallelism in transformers' Trainer (torchtrain.hf.ulysses, DeepSpeed's Ulysses through accelerate):
PackingCollator("anchor") + anchor_varlen on 2 gloo processes with sp_size 2 trains as one process does.

The worker (ulysses_worker.py) trains 3 steps of a tiny Llama with Trainer's defaults (AdamW, max_grad_norm 1)
at the paper's lr 2e-5 and weight decay 0.1, ZeRO-2. Each step's loss equals the one-process run's within the
fp32 rule (1e-6, tests/train/test_zero.py) and so does its gradient norm (1e-5, as there). Without
UlyssesGradients the norms are twice the one-process ones (torchtrain.hf_ulysses;
github.com/deepspeedai/DeepSpeed/issues/5248) while the losses, under Adam and clipping, stay equal: the norms
are what this test holds. Measured: losses within 1e-7, norms equal to 7 digits. A wrong slice of doc_ids on
one rank stops both ranks with the one-line check of torchtrain.hf_ulysses.check_window, here end to end and
in-process for each kind of wrong slice."""

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
from torchtrain import hf_ulysses
from torchtrain.distributed import free_port

WORKER = Path(__file__).with_name("ulysses_worker.py")
CAUGHT = "sequence parallelism: the doc_ids gathered over the 2 ranks are not one window of the anchor variant"


def _run(tmp: Path, sp: int, plant: str = "") -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / f"sp{sp}{plant}.json"
    launch = ([sys.executable, str(WORKER)] if sp == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(sp), "--master_port",
               str(free_port()), str(WORKER)])
    done = subprocess.run([*launch, str(sp), str(out), *([plant] if plant else [])], capture_output=True, text=True,
                          env=ENV, timeout=300)
    return done, out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ulysses")
    done, out = _run(tmp, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), tmp


def test_trainer_under_ulysses_equals_one_process(one_process):
    want, tmp = one_process
    done, out = _run(tmp, 2)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    a, b = np.array(want["losses"]), np.array(got["losses"])
    print(f"sp 1 {a}\nsp 2 {b}\nnorms {want['grad_norms']} {got['grad_norms']}")
    assert len(a) == len(b) == 3 and len(want["grad_norms"]) == len(got["grad_norms"]) == 3
    assert (np.abs(a - b) / a).max() <= 1e-6
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=1e-5)


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


@pytest.mark.parametrize("plant", ["moved_boundary", pytest.param("first_slice", marks=pytest.mark.slow),
                                   pytest.param("swapped", marks=pytest.mark.slow)])
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
