"""How the batch reaches stock transformers: the input styles of `anchor parity --stack hf` (parity_tests.hf_stack).

Each (implementation, input style) is asked for the four variants on random:llama at T = 97 (two windows,
the second padded, one- and two-token documents), float32 forward, and held two ways:
  - its verdicts (status, and the variant computed) are pinned as transformers 5.23 gives them (FINDINGS):
    the test fails the day transformers computes something else from the same inputs;
  - every verdict is checked against an independent reference: the stock model run on each document alone
    (`reference`), its logits glued back into the windows. Each run is one plain causal sequence, so no
    code that builds a variant's mask (the oracle's, the trainer's, transformers' packed-sequence search)
    takes part in it.
eager's and sdpa's styles run in `make test`; flex_attention's (it compiles, and its 4-D mask styles end
their process) are `slow`.
"""

from __future__ import annotations

import functools
import json
import os
import signal

import numpy as np
import pytest
import torch

from anchor_core.errors import InputError
from anchor_core.variants import VARIANTS
from parity_tests.core import RULE
from parity_tests.hf_stack import (INPUT_STYLES, Isolated, Stack, collate, describe_row, feed, hold, input_styles,
                                   mask4d, named_subject, packed_positions, run_here, sequences, stock,
                                   stock_model, subject_inputs)

MODEL = "random:llama"
T = 97
FP32 = ("float32",)

# The verdict per variant (VARIANTS' order): "computes", "instead:X", "none" or "crash".
ACROSS = ("computes", "none", "none", "none")  # restarted positions, documents attending to each other
PACKED = ("computes", "instead:intra_doc_reset", "computes", "instead:intra_doc_reset")
CONTINUOUS = ("computes", "instead:full", "instead:full", "instead:full")
EXACT = ("computes",) * 4
MASK_ADDED = ("none",) * 4  # eager adds a bool mask to the scores as a number (True +1, False +0)
# the process corrupts its heap and dies: SIGSEGV, or SIGABRT where glibc's allocator sees the corruption
# first ("double free or corruption"), as it happens
CRASH = ("crash",) * 4
CRASH_SIGNALS = ("crashes (signal 11)", "crashes (signal 6)")

FINDINGS: dict[tuple[str, str], tuple[str, ...]] = {
    # use_cache on (the model's default): a DynamicCache is made, and transformers searches position_ids
    # for packed sequences only without one
    **{(i, "flattening"): ACROSS for i in ("eager", "sdpa", "flex_attention")},
    **{(i, "flattening-nocache"): PACKED for i in ("eager", "sdpa", "flex_attention")},
    # cu_seq_lens_q/k reach the attention function as unused keywords; use_cache on as in flattening
    **{(i, "flash-kwargs"): ACROSS for i in ("eager", "sdpa", "flex_attention")},
    **{(i, "continuous"): CONTINUOUS for i in ("eager", "sdpa", "flex_attention")},
    ("eager", "mask4d-bool"): MASK_ADDED,
    ("eager", "mask4d-float"): EXACT,
    ("sdpa", "mask4d-bool"): EXACT,
    ("sdpa", "mask4d-float"): EXACT,
    # flex_attention given a 4-D mask on the CPU: the process dies
    ("flex_attention", "mask4d-bool"): CRASH,
    ("flex_attention", "mask4d-float"): CRASH,
}


def _verdict(row: dict) -> str:
    if row["status"] == "instead":
        return f"instead:{row['computes']}"
    if row["status"] == "crash":
        assert row["error"] in CRASH_SIGNALS and row["computes"] is None, row["error"]
        return "crash"
    if row["status"] == "error":
        return f"error:{row['error']}"
    return row["status"]


# ---------------------------------------------------------------------------------------------
# The reference: each document alone


def _segments(doc_ids: np.ndarray, variant: str) -> list[tuple[list[int], list[int], int]]:
    """Per window row b of doc_ids [T]: (slots fed, their positions, how many leading slots are context
    only) for each sequence the variant's reference runs, read from §2's table directly: `full` one
    sequence of the real slots at the slot index; `intra_doc` each document at the slot index;
    `intra_doc_reset` each document at 0, 1, ...; `anchor` the anchor slot alone, and each other document
    after the anchor slot (position 0), its own slots at the slot index. Padding is left out (no error is
    measured there)."""
    real = [t for t in range(len(doc_ids)) if doc_ids[t] >= 0]
    if variant == "full":
        return [(real, real, 0)]
    docs: dict[int, list[int]] = {}
    for t in real:
        docs.setdefault(int(doc_ids[t]), []).append(t)
    out = []
    for d, slots in docs.items():
        if variant == "intra_doc":
            out.append((slots, slots, 0))
        elif variant == "intra_doc_reset":
            out.append((slots, list(range(len(slots))), 0))
        elif d == 0:  # anchor: the anchor slot sees itself only
            out.append((slots, slots, 0))
        else:
            out.append(([0, *slots], [0, *slots], 1))
    return out


REFERENCE_NAME = "anchor_reference_causal"
_RECORD: list = []  # the reference run's q and k per layer, as its attention function gets them


def _causal(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The reference's attention: plain causal attention over one sequence (torch's is_causal; registered
    under a custom name, so transformers builds no mask for it), recording q and k after RoPE."""
    import torch.nn.functional as F

    _RECORD.append((query, key))
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                         is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=1)
def _reference_model():
    from transformers import AttentionInterface

    AttentionInterface.register(REFERENCE_NAME, _causal)
    subject = named_subject(MODEL)
    model = stock_model(subject.spec, subject.state, "float32")
    model.set_attn_implementation(REFERENCE_NAME)
    return model


@functools.lru_cache(maxsize=16)
def _reference(variant_asked: str, variant: str) -> dict[str, np.ndarray]:
    """{"q", "k": [L, B, T, heads, D], "logits": [B, T, V]} of `variant` on the inputs of `variant_asked`:
    the stock model (float32) on each sequence of `_segments` as a batch of one, glued back."""
    inputs = subject_inputs(named_subject(MODEL), variant_asked, T)
    model = _reference_model()
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for b in range(inputs.shape[0]):
            for slots, positions, context in _segments(inputs.doc_ids[b], variant):
                _RECORD.clear()
                ids = torch.from_numpy(inputs.tokens[b, slots]).long()[None]
                logits = model(input_ids=ids, position_ids=torch.tensor([positions]), use_cache=False).logits
                taps = {"logits": logits[None], "q": torch.stack([q for q, _ in _RECORD]),
                        "k": torch.stack([k for _, k in _RECORD])}
                for name, x in taps.items():  # [L or 1, 1, heads, n, D] / [1, 1, n, V]
                    x = x[:, 0].transpose(1, 2) if name != "logits" else x[:, 0]
                    if name not in out:
                        out[name] = np.zeros((x.shape[0], *inputs.shape, *x.shape[2:]), np.float32)
                    out[name][:, b, slots[context:]] = x[:, context:].numpy()
    out["logits"] = out["logits"][0]
    return out


def _rel(test: np.ndarray, ref: np.ndarray, real: np.ndarray) -> float:
    """Relative L2 error over the real slots (taps [L, B, T, ...] or logits [B, T, V])."""
    sel = (slice(None), real) if test.ndim == 5 else real
    return float(np.linalg.norm(test[sel] - ref[sel]) / np.linalg.norm(ref[sel]))


def _errors(taps: dict[str, np.ndarray], ref: dict[str, np.ndarray], real: np.ndarray) -> float:
    """The worst relative error of q and k (the positions) and the logits (the mask)."""
    return max(_rel(taps[name], ref[name], real) for name in ("q", "k", "logits"))


def _agrees(row: dict, taps: dict | None) -> None:
    """The row's verdict against the references of the four variants on its inputs (q, k of every layer
    and the logits within the fp32 rule): computes X <=> X's reference is within it and the nearest;
    none <=> no reference is."""
    if row["status"] in ("crash", "error"):
        assert taps is None
        return
    real = subject_inputs(named_subject(MODEL), row["variant"], T).real
    err = {v: _errors(taps, _reference(row["variant"], v), real) for v in VARIANTS}
    print(f"  {row['variant']}: worst error vs per-document references", {v: f"{e:.2e}" for v, e in err.items()})
    within = [v for v in VARIANTS if err[v] <= RULE.fp32_tol]
    if row["status"] == "none":
        assert within == [], (row["variant"], err)
    else:
        assert row["computes"] in within and err[row["computes"]] == min(err.values()), (row["variant"], err)


def _hold_all(implementation: str, style: str) -> tuple[dict[str, dict], dict[str, dict | None]]:
    """The rows of the four variants, and the float32 taps each forward gave (None where it did not
    finish). flex_attention runs in a child process (its 4-D mask styles end theirs)."""
    subject = named_subject(MODEL)
    logits: dict[str, dict | None] = {}
    isolated = Isolated(subject) if implementation == "flex_attention" else None

    def runner(subject, stack, inputs, variant, dtype):
        kind, taps = (isolated or run_here)(subject, stack, inputs, variant, dtype)
        logits[variant] = {"q": taps["q"], "k": taps["k"], "logits": taps["logits"][0]} if kind == "ok" else None
        return kind, taps

    try:
        rows = {v: hold(subject, stock(implementation, style), v, seq_len=T, dtypes=FP32, execute=runner)
                for v in VARIANTS}
    finally:
        if isolated:
            isolated.close()
    for v, row in rows.items():
        print(f"{implementation} / {style} asked {v}: {describe_row(row)}")
    return rows, logits


def _params():
    fast = {(i, s) for i in ("eager", "sdpa") for s in INPUT_STYLES}
    return [pytest.param(i, s, id=f"{i}-{s}", marks=() if (i, s) in fast else pytest.mark.slow)
            for i, s in FINDINGS]


@pytest.mark.parametrize("implementation,style", _params())
def test_verdicts_are_pinned_and_agree_with_per_document_runs(implementation, style):
    rows, logits = _hold_all(implementation, style)
    for v in VARIANTS:
        _agrees(rows[v], logits[v])
    assert tuple(_verdict(rows[v]) for v in VARIANTS) == FINDINGS[implementation, style]


def test_the_reference_tells_the_variants_apart():
    """On the inputs asked for anchor, the four references differ from each other by far more than the fp32
    rule, so a verdict cannot agree with two of them. (On the logits alone intra_doc and intra_doc_reset
    agree: RoPE sees only the distance between positions, the same inside a document alone; q and k
    tell them apart.)"""
    real = subject_inputs(named_subject(MODEL), "anchor", T).real
    refs = {v: _reference("anchor", v) for v in VARIANTS}
    gaps = {(a, b): _errors(refs[a], refs[b], real) for a in VARIANTS for b in VARIANTS if a < b}
    print({k: f"{g:.2e}" for k, g in gaps.items()})
    assert min(gaps.values()) > 100 * RULE.fp32_tol


# ---------------------------------------------------------------------------------------------
# The feeds


def _inputs(variant: str):
    return subject_inputs(named_subject(MODEL), variant, T)


@pytest.mark.parametrize("variant", VARIANTS)
def test_flattening_is_the_collators_batch(variant):
    """The real DataCollatorWithFlattening's position_ids restart at every sequence (`full`: one per window),
    and its cu_seq_lens_q/k mark the sequences of the B*T slots laid end to end."""
    inputs = _inputs(variant)
    batch = collate(inputs, variant, flash_kwargs=True)
    runs = sequences(inputs.doc_ids, variant)
    expected_pos = (np.broadcast_to(np.arange(T), inputs.shape) if variant == "full"
                    else packed_positions(inputs.doc_ids))
    assert batch["position_ids"].tolist() == expected_pos.tolist()
    bounds = [0] + [b * T + e for b, window in enumerate(runs) for _, e in window]
    assert batch["cu_seq_lens_q"].tolist() == bounds == batch["cu_seq_lens_k"].tolist()
    assert batch["max_length_q"] == max(e - s for window in runs for s, e in window)
    assert "cu_seq_lens_q" not in collate(inputs, variant, flash_kwargs=False)


@pytest.mark.parametrize("style,use_cache", [("flattening", None), ("flash-kwargs", None),
                                             ("flattening-nocache", False), ("continuous", False),
                                             ("mask4d-bool", False), ("mask4d-float", False)])
def test_only_the_collator_styles_leave_use_cache_to_the_model(style, use_cache):
    out = feed(stock("sdpa", style), _inputs("intra_doc"), "intra_doc")
    assert out.get("use_cache") is use_cache


def test_mask4d_is_the_variants_mask_with_its_positions():
    """bool: True where §2 lets a query see a key; float: 0 there, the dtype's most negative number
    elsewhere; position_ids: the variant's (per-document offsets under intra_doc_reset)."""
    import jaxref

    for variant in ("intra_doc_reset", "anchor"):
        inputs = _inputs(variant)
        allowed = jaxref.attention_mask(inputs.doc_ids, variant)
        b = mask4d(inputs.doc_ids, variant, "bool", "float32")
        f = mask4d(inputs.doc_ids, variant, "float", "bfloat16")
        assert b.shape == (*inputs.shape[:1], 1, T, T) and b.dtype == torch.bool
        assert (b[:, 0].numpy() == allowed).all()
        assert f.dtype == torch.bfloat16
        assert set(f[b].float().unique().tolist()) == {0.0}
        assert set(f[~b].float().unique().tolist()) == {torch.finfo(torch.bfloat16).min}
        fed = feed(stock("eager", "mask4d-float"), inputs, variant, "float32")
        assert fed["position_ids"].tolist() == jaxref.positions(inputs.doc_ids, variant).tolist()
        assert fed["attention_mask"].dtype == torch.float32


def test_input_styles_parse():
    assert input_styles(None) == ["flattening-nocache"]
    assert input_styles("all") == list(INPUT_STYLES)
    assert input_styles("continuous, mask4d-bool,continuous") == ["continuous", "mask4d-bool"]
    with pytest.raises(InputError, match="--inputs: unknown input style 'mask3d'"):
        input_styles("continuous,mask3d")
    with pytest.raises(InputError, match="--inputs"):
        stock("sdpa", "packed")


# ---------------------------------------------------------------------------------------------
# A process that dies is a row


def segfault(module, query, key, value, attention_mask, **kwargs):
    """An attention function that ends its process as a crashing kernel does."""
    os.kill(os.getpid(), signal.SIGSEGV)


@pytest.mark.slow
def test_a_child_that_dies_is_a_crash_and_the_next_request_gets_a_new_child():
    subject = named_subject(MODEL)
    inputs = _inputs("intra_doc_reset")
    with Isolated(subject) as isolated:
        dying = Stack("segfault", "anchor_user_attention", segfault)
        assert isolated(subject, dying, inputs, "intra_doc_reset", "float32") == ("crash", "crashes (signal 11)")
        kind, taps = isolated(subject, stock("sdpa"), inputs, "intra_doc_reset", "float32")
        assert kind == "ok" and taps["logits"].shape[1:3] == inputs.shape


def _run(argv: list[str]) -> int:
    from anchor.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code)


@pytest.mark.slow
def test_cli_reports_a_crashing_style_and_writes_the_report(tmp_path, capsys):
    """flex_attention with a 4-D bool mask ends its child process; the run goes on to sdpa and the report
    is written with the crash as a row."""
    out = tmp_path / "hf"
    rc = _run(["parity", "--stack", "hf", "--model", MODEL, "--out", str(out), "--variants", "intra_doc",
               "--attn-implementation", "flex_attention,sdpa", "--inputs", "mask4d-bool", "--policies", "fp32",
               "--no-progress"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 1 and any(c in printed for c in CRASH_SIGNALS)
    rows = {r["implementation"]: r for r in json.loads((out / "parity.json").read_text())["rows"]}
    assert {k: rows["flex_attention"][k] for k in ("inputs", "variant", "status", "computes")} == {
        "inputs": "mask4d-bool", "variant": "intra_doc", "status": "crash", "computes": None}
    assert rows["sdpa"]["status"] == "computes" and rows["sdpa"]["computes"] == "intra_doc"


@pytest.mark.parametrize("argv,message", [
    (["--stack", "hf", "--inputs", "packed"], "--inputs: unknown input style 'packed'"),
    (["--stack", "hf", "--inputs", "continuous", "--attention", "parity_tests.planted_attention:correct"],
     "--inputs applies to transformers' own implementations"),
    (["--inputs", "continuous"], "--inputs applies to --stack hf"),
])
def test_cli_inputs_usage_errors_exit_2(tmp_path, capsys, argv, message):
    rc = _run(["parity", "--model", MODEL, "--out", str(tmp_path / "hf"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "hf").exists()
