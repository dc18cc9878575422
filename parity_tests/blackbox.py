"""The training step you run, checked as a black box: your transformers model on one batch of your collator.

    import anchor
    report = anchor.check_step(model, batch)                    # runs model(**batch) as your loop does
    report.computes, report.probe["moved"], report.message      # a StepCheck; report["message"] reads the same

`check_step` (public name `anchor.check_step`) says which attention variant of docs/DESIGN.md §1-§2 that
forward computes, held against the oracle (jaxref, fp64) on the same tokens and weights; where the model runs in
bfloat16, whether it passes the bf16 rule; and which documents see each other (a perturbation probe that needs no
oracle). It returns a `StepCheck` (parity_tests.step_check), a dataclass that also reads as the mapping of its
fields. Its docstring says how each is judged; docs/guides/hf-trainer.md is the user's guide. `probe_documents`
is the probe alone, `step_message` the report's one paragraph, with which the pytest fixture `anchor_check_step`
(anchor/pytest_plugin.py) fails a test. The helpers follow them, in the order check_step calls them.

Legend: B rows, T slots, V vocabulary, L layers.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np

import jaxref
from anchor_core.errors import InputError
from anchor_core.variants import VARIANTS
from parity_tests.batch_documents import SOURCES, batch_positions, batch_tokens, infer_documents
from parity_tests.cases import CaseInputs
from parity_tests.core import EMBED, HEAD, RULE, Rule, tap_errors
from parity_tests.core import hold as judged
from parity_tests.emulations import HF_EMULATIONS
from parity_tests.hf_stack import IDENTIFYING, TRUTH, bf16_verdict, error_line, identify, module_subject, only, where
from parity_tests.runners import Taps, as_arrays, oracle
from parity_tests.step_check import StepCheck
from torchtrain.model.taps import capture_taps

__all__ = ["DTYPES", "MASKS", "PROBE_SWEEP", "SOURCES", "StepCheck", "check_step", "infer_documents",
           "probe_documents", "step_message"]  # SOURCES and infer_documents live in parity_tests.batch_documents,
# StepCheck in parity_tests.step_check

DTYPES: tuple[str, ...] = ("float32", "bfloat16")
PROBE_SWEEP = 8  # documents the probe changes in turn where the step does not compute the variant asked
LISTED = 6  # documents a message names before "and N more"
MASKS: tuple[str, ...] = ("full", "intra_doc", "anchor")  # the masks of the four variants
_MASK_WORDS = {"full": "full attention (across documents)", "intra_doc": "attention within each document",
               "anchor": "attention within each document and to slot 0"}
_PER_DOCUMENT = ("intra_doc", "intra_doc_reset", "anchor")


def check_step(model: Any, batch: Any, *, variants: Any = "all", dtype: str | None = None, doc_ids: Any = None,
               probe: bool = True, probe_document: int | None = None, emulation: str | None = None,
               rule: Rule = RULE) -> StepCheck:
    """Run model(**batch) on copies of `model` and say which variant the step computes.

    How it judges (your model, its mode and dtype are left as they are; the copies run in eval mode without
    gradient):
      documents  read from the batch (parity_tests.batch_documents: `doc_ids=`, the batch's doc_ids,
                 cu_seq_lens, a 4-D mask, restarting position_ids, else one per row; a 2-D mask marks padding).
      computes   a float32 copy's taps (its rotary tables rebuilt from the config) against the oracle's fp64
                 taps of each variant, by the fp32 rule: `matches` are within it, `computes` is the one asked
                 with the smallest error. Where none matches, each mask at the batch's own position_ids
                 (`reading`: e.g. full attention at restarting positions); where it does not compute the
                 variant asked, the documents over the tolerance at the first diverging tap.
      bf16       where the model runs in bfloat16: its taps against the fp64 truth of what it computes, by
                 the suite's bf16 rule (2 x the emulation's error + the floor).
      probe      one document's tokens changed (slot 0 kept); the other documents whose logits moved by more
                 than 2 x the run-to-run noise + the fp32 tolerance see it. Each in turn (up to PROBE_SWEEP)
                 where the step does not compute the variant asked.
      pass       it computes one of `variants`, passes the bf16 rule where it applies, and (unless "full" is
                 asked) the probe moved no other document.
    The batch runs as given (`use_cache` stays what the config and the batch say), with one change: a floating
    4-D attention_mask in the model's dtype is given to each copy in that copy's dtype (torch's sdpa refuses a
    mask in another dtype than the query's).

    Args:
      model: your transformers causal LM of a supported family (llama, mistral, qwen2, qwen3), as built.
      batch: the dict your loop passes to model(**batch) (input_ids required; run as given, a floating 4-D
        attention_mask in the model's dtype in each copy's).
      variants: "all", one variant or a list: the variants the step may compute to pass.
      dtype: None (the model's own dtype), "float32" (identify only) or "bfloat16" (also the bf16 rule).
      doc_ids: the documents, where the batch does not say them (int [B, T], -1 padding).
      probe: also run the perturbation probe; probe_document: the document it changes (default the first
        one another document follows; each in turn where the step does not compute the variant asked).
      emulation: the oracle bf16 preset of the bf16 rule (default: the model's attention implementation's).
    Returns:
      a StepCheck: `passed` and `message`, then what was asked and how it ran, what it computes against the
      oracle, the bf16 verdict and the probe (its docstring lists every field). It also reads as a mapping by
      the keys check_step has always returned: report["message"], report["pass"], dict(report).
    """
    asked = _variants(variants)
    run_dtype = _check_args(model, dtype, probe, emulation)
    docs = infer_documents(batch, doc_ids=doc_ids)
    tokens, doc = batch_tokens(batch), docs["doc_ids"]
    own = _model_dtype(model)
    run_dtype = run_dtype or own
    subject = module_subject(model)
    if int(tokens.max()) >= subject.spec.vocab_size or int(tokens.min()) < 0:
        raise InputError(f"batch['input_ids']: token ids {int(tokens.min())}..{int(tokens.max())} outside the "
                         f"model's vocabulary of {subject.spec.vocab_size}")
    inputs = _inputs(tokens, doc)
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    f32 = _copy(model, "float32", rebuild_rope=True)
    report: dict[str, Any] = {
        "asked": asked, "computes": None, "matches": [], "closest": None, "reading": None,
        "documents": _describe_docs(docs), "attn_implementation": impl,
        "use_cache": batch.get("use_cache", getattr(model.config, "use_cache", None)), "dtype": run_dtype,
        "candidates": None, "fp32": None, "bf16": None, "probe": None,
        "attends_across_documents": None, "error": None, "pass": False,
    }
    try:
        test = _tapped(f32, _as_run(batch, "float32", own), doc)
    except Exception as e:  # whatever the user's forward raises is the finding
        report.update(error=error_line(e))
        report["message"] = step_message(report, model)
        return StepCheck.of(report)
    found = identify(test, subject, inputs, asked[0], rule)
    cands = found["candidates"]
    matches = [v for v in VARIANTS if cands[v]["pass"]]
    within = sorted(matches, key=lambda v: (v not in asked, cands[v]["worst_margin"]))
    computes = within[0] if within else None
    nearest = min(asked, key=lambda v: cands[v]["worst_margin"])
    first = cands[nearest]["first_divergence"]
    report.update(computes=computes, matches=matches, closest=found["closest"], candidates=cands,
                  reading=None if matches else _read_positions(test, subject, inputs, batch, rule),
                  fp32={"against": nearest, "first_divergence": first, "worst_margin": cands[nearest]["worst_margin"],
                        "documents": [] if computes in asked else _documents_off(test, subject, inputs, nearest,
                                                                                first, rule)})
    runs = f32 if run_dtype == "float32" else _copy(model, "bfloat16")
    if computes in asked and run_dtype == "bfloat16":
        preset = emulation or HF_EMULATIONS.get(impl, "fa2_bf16")
        try:
            test16 = _tapped(runs, _as_run(batch, "bfloat16", own), doc)
        except Exception as e:  # a step that runs in float32 may still fail in bfloat16
            report.update(error=f"in bfloat16: {error_line(e)}")
            report["message"] = step_message(report, model)
            return StepCheck.of(report)
        v = bf16_verdict(test16, subject, inputs, computes, preset, rule)
        report["bf16"] = {k: v[k] for k in ("policy", "pass", "first_divergence", "worst_margin", "summary")}
    if probe:
        report["probe"] = _probe(runs, _as_run(batch, run_dtype, own), doc, probe_document, rule,
                                 sweep=computes not in asked)
    report["attends_across_documents"] = _across(report)
    report["pass"] = bool(computes in asked and (report["bf16"] is None or report["bf16"]["pass"])
                          and not (report["probe"] and report["probe"]["moved"] and "full" not in asked))
    report["message"] = step_message(report, model)
    return StepCheck.of(report)


def probe_documents(model: Any, batch: Any, *, doc_ids: Any = None, probe_document: int | None = None,
                    dtype: str | None = None, rule: Rule = RULE) -> dict[str, Any]:
    """The perturbation probe alone (no oracle), in the model's own dtype (or `dtype`): change document
    `probe_document` (default: the first one another document follows) and report {"ran", "document",
    "moved": [(row, document)], "first_slots": {"row:doc": its first slot}, "change": {"row:doc": relative
    change of its logits}, "noise", "threshold", "documents"}."""
    batch_tokens(batch)
    run = _check_dtype(dtype) or _model_dtype(model)
    docs = infer_documents(batch, doc_ids=doc_ids)
    return {**_probe(_copy(model, run), _as_run(batch, run, _model_dtype(model)), docs["doc_ids"], probe_document,
                     rule),
            "documents": _describe_docs(docs)}


def step_message(report: Mapping[str, Any], model: Any = None) -> str:
    """One paragraph: what was asked, what it computes, the first diverging layer and quantity (and the
    documents over the tolerance there), the probe."""
    name = type(model).__name__ if model is not None else "the model"
    asked, rows = report["asked"], len(report["documents"]["counts"])
    head = (f"anchor check_step: {name} ({report['attn_implementation']}, use_cache={report['use_cache']}, "
            f"{report['dtype']}) on {_docs_text(report)}, asked for "
            + ("any of the four variants" if len(asked) == len(VARIANTS) else " or ".join(asked)))
    if report.get("error"):
        return f"{head}: model(**batch) raised {report['error']}."
    computes, fp32 = report["computes"], report["fp32"]
    against = (f"against {fp32['against']} it first diverges at {_divergence(fp32['first_divergence'])}"
               f"{_off_text(fp32['documents'], rows)}")
    if computes is None:
        reading = report["reading"]
        what = (f"it computes none of the variants: {_MASK_WORDS[reading['mask']]} at {reading['positions']}"
                if reading else f"it computes none of the variants (closest: {report['closest']})")
        text = f"{head}: {what}; {against}."
    elif computes not in asked:
        text = f"{head}: it computes {computes} instead; {against}."
    elif report["bf16"] is not None and not report["bf16"]["pass"]:
        b = report["bf16"]
        text = (f"{head}: it computes {computes}, but fails the bf16 rule (2 x the {b['policy']} emulation's "
                f"error + floor) first at {_divergence(b['first_divergence'])}.")
    else:
        bf = "" if report["bf16"] is None else " and passes the bf16 rule"
        text = f"{head}: it computes {computes}{bf}."
    return text + _probe_text(report["probe"], rows)


# ---------------------------------------------------------------------------------------------
# The check's parts


def _check_args(model: Any, dtype: str | None, probe: Any, emulation: str | None) -> str | None:
    """check_step's options, each an InputError naming it; returns the dtype asked (None: the model's)."""
    run_dtype = _check_dtype(dtype)
    if not isinstance(probe, bool):
        raise InputError(f"probe: expected True or False, got {probe!r}")
    if emulation is not None:
        try:
            jaxref.get_policy(emulation)
        except (InputError, KeyError, ValueError) as e:
            raise InputError(f"emulation: {e}") from None
    if not hasattr(model, "config") or not hasattr(model, "parameters") or not callable(model):
        raise InputError(f"model: expected your transformers causal LM (a torch module with a .config), got "
                         f"{type(model).__name__}")
    return run_dtype


def _check_dtype(dtype: str | None) -> str | None:
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"dtype: expected None (the model's own), {' or '.join(DTYPES)}, got {dtype!r}")
    return dtype


def _variants(variants: Any) -> list[str]:
    asked = list(VARIANTS) if variants == "all" else [variants] if isinstance(variants, str) else variants
    try:
        asked = list(asked)
    except TypeError:
        asked = [asked]
    bad = [v for v in asked if v not in VARIANTS]
    if bad or not asked:
        raise InputError(f"variants: unknown variant {bad[0] if bad else None!r} (known: all, {', '.join(VARIANTS)})")
    return asked


def _describe_docs(docs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in docs.items() if k != "doc_ids"}


def _documents_off(test: Taps, subject, inputs: CaseInputs, variant: str, first: dict[str, Any] | None,
                   rule: Rule) -> list[dict[str, Any]]:
    """The documents over the fp32 rule (`Rule.fp32`, against the oracle's own fp32 error on that document) at the
    first diverging tap (else the logits) against the variant's oracle: [{"row", "document", "first_slot",
    "rel_l2"}] in order of row and document."""
    truth = oracle(subject, inputs, variant, TRUTH)  # cached: the runs identify held the taps against
    fp32 = oracle(subject, inputs, variant, "fp32")
    name, label = (first["tap"], first["layer"]) if first else ("logits", HEAD)
    i = 0 if label in (EMBED, HEAD) else int(label)
    out = []
    for r, row in enumerate(inputs.doc_ids):
        for d in range(1, int(row.max(initial=0)) + 1):
            err = tap_errors(test[name][i][r], truth[name][i][r], row == d)["rel_l2"]
            if err > rule.fp32(tap_errors(fp32[name][i][r], truth[name][i][r], row == d)["rel_l2"]):
                out.append({"row": r, "document": d, "first_slot": int(np.argmax(row == d)), "rel_l2": err})
    return out


def _read_positions(test: Taps, subject, inputs: CaseInputs, batch: Mapping, rule: Rule) -> dict[str, Any] | None:
    """Where no variant matches: each mask at the batch's own position_ids; the first within the fp32 rule."""
    B, T = inputs.shape
    pos = batch_positions(batch, B, T)
    if pos is None:
        return None
    for mask in MASKS:
        own = [v for v in VARIANTS if (v == mask or (mask == "intra_doc" and v == "intra_doc_reset"))]
        if any(np.array_equal(pos, jaxref.positions(inputs.doc_ids, v)) for v in own):
            continue  # that is a variant, already held
        reading = only(oracle(subject, inputs, mask, TRUTH, positions=pos), IDENTIFYING)  # the mask at those positions
        v = judged(test, reading, inputs, bf16=False, baseline=[oracle(subject, inputs, mask, "fp32", positions=pos)],
                   rule=rule)
        if v["pass"]:
            return {"mask": mask, "positions": "the batch's position_ids", "worst_margin": v["worst_margin"]}
    return None


def _across(report: dict[str, Any]) -> bool | None:
    """Whether documents see each other: from what it computes, else the reading, else the probe."""
    if report["computes"] is not None:
        return report["computes"] == "full" and max(report["documents"]["counts"], default=0) > 1
    if report["reading"] is not None:
        return report["reading"]["mask"] == "full"
    if report["probe"] and report["probe"]["ran"]:
        return bool(report["probe"]["moved"])
    return None


# ---------------------------------------------------------------------------------------------
# The batch and the forwards


def _model_dtype(model: Any) -> str:
    import torch

    p = next(iter(model.parameters()), None)
    return "bfloat16" if p is not None and p.dtype == torch.bfloat16 else "float32"


def _as_run(batch: Mapping, dtype: str, own: str) -> Mapping:
    """The batch for a copy in `dtype` of a model in `own`: a floating 4-D attention_mask in `own` cast to
    `dtype` (finite values kept finite: a float32 mask's most negative number is bfloat16's most negative,
    not -inf), else as given."""
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    mask, want = batch.get("attention_mask"), dtypes[dtype]
    if not (isinstance(mask, torch.Tensor) and mask.ndim == 4 and mask.is_floating_point()
            and mask.dtype == dtypes[own] and mask.dtype != want):
        return batch
    info, out = torch.finfo(want), mask.to(want)
    return {**batch, "attention_mask": torch.where(torch.isfinite(mask), out.clamp(info.min, info.max), out)}


def _copy(model: Any, dtype: str, *, rebuild_rope: bool = False):
    """The model in eval mode with its parameters in `dtype` (buffers as built), the user's left as it is.

    rebuild_rope: also every floating buffer in float32 and the rotary tables (`inv_freq`) rebuilt from
    the config, as from_pretrained builds them. For the float32 copy that identifies the variant: a
    model cast with .to(bfloat16) carries a bf16-rounded inv_freq, a precision matter the bf16 rule
    judges, not a question of which positions it uses.
    """
    import torch

    out = copy.deepcopy(model).eval()
    for p in out.parameters():
        p.data = p.data.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    if rebuild_rope:
        for module in out.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is not None and buf.is_floating_point():
                    setattr(module, name, buf.float())
            if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(module, "config"):
                fresh = type(module)(module.config)
                for name, buf in fresh.named_buffers(recurse=False):
                    setattr(module, name, buf.to(getattr(module, name).device))
    return out


def _forward(model: Any, batch: Mapping):
    """model(**batch) as the loop runs it: the same keys and values, no gradient."""
    import torch

    with torch.no_grad():
        return model(**batch)


def _rows(T: int) -> tuple[int, ...]:
    """Tapped query rows: the oracle taps attention rows only when asked for some; they are the harness's
    reading of q and k, not the stack's, and are left out of every comparison here."""
    return tuple(sorted({0, T // 2, T - 1}))


def _tapped(model: Any, batch: Mapping, doc_ids: np.ndarray) -> Taps:
    """The taps of model(**batch), recorded by torchtrain.capture_taps (the recorder of every parity runner:
    hooks and a wrapper of the model's own attention implementation)."""
    import torch


    with (capture_taps(model, _rows(doc_ids.shape[1]), doc_ids=torch.from_numpy(doc_ids), variant="full") as taps,
          torch._dynamo.config.patch(automatic_dynamic_shapes=False)):
        _forward(model, batch)
    return only(as_arrays(taps), IDENTIFYING)


def _inputs(tokens: np.ndarray, doc_ids: np.ndarray) -> CaseInputs:
    zeros = np.zeros_like(tokens)
    return CaseInputs(tokens, doc_ids, zeros, zeros, _rows(tokens.shape[1]))


# ---------------------------------------------------------------------------------------------
# The perturbation probe


def _logits(model: Any, batch: Mapping) -> np.ndarray:
    out = _forward(model, batch)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.detach().float().cpu().numpy().astype(np.float64)


def _moves(a: np.ndarray, b: np.ndarray, doc_ids: np.ndarray) -> dict[tuple[int, int], float]:
    """Relative L2 change of each (row, document)'s logits."""
    out = {}
    for r, row in enumerate(doc_ids):
        for d in range(1, int(row.max(initial=0)) + 1):
            sel = row == d
            norm = float(np.linalg.norm(a[r, sel]))
            out[(r, d)] = float(np.linalg.norm(a[r, sel] - b[r, sel]) / (norm or 1.0))
    return out


def _probe(model: Any, batch: Mapping, doc_ids: np.ndarray, document: int | None, rule: Rule,
           sweep: bool = False) -> dict[str, Any]:
    """Change one document's tokens (each row's document `document`, slot 0 kept) and list the documents
    whose logits moved; with `sweep` (and no `document`), each document another follows in turn, up to
    PROBE_SWEEP. The probe needs no oracle; `moved` is [(row, document)], `moved_by` {changed: moved}."""
    vocab = int(model.get_input_embeddings().num_embeddings)
    last = int(doc_ids.max(initial=0))
    changeable = [d for d in range(1, last + 1) if (doc_ids[:, 1:] == d).any()]  # slot 0 is never changed
    if document is None:  # the first document(s) with a changeable slot and a document after it
        changed = [d for d in changeable if d < last][:PROBE_SWEEP if sweep else 1]
        if not changed:
            return {"ran": False, "reason": "one document per row: nothing can move", "moved": []}
    elif not isinstance(document, int) or document < 1 or document > last:
        raise InputError(f"probe_document: expected a document number 1..{last}, got {document!r}")
    elif document not in changeable:
        raise InputError(f"probe_document: document {document} is slot 0 only (the anchor slot, never changed): "
                         f"name another")
    else:
        changed = [document]
    a = _logits(model, batch)
    noise = max(_moves(a, _logits(model, batch), doc_ids).values(), default=0.0)
    threshold = rule.factor * noise + rule.fp32_tol
    moves = {d: _moves(a, _logits(model, _changed(batch, doc_ids == d, vocab)), doc_ids) for d in changed}
    moved_by = {d: [key for key, m in moves[d].items() if key[1] != d and m > threshold] for d in changed}
    moved = sorted(set().union(*moved_by.values()))
    return {"ran": True, "document": changed[0], "documents_changed": changed,
            "changed_slots": int((doc_ids[:, 1:] == changed[0]).sum()), "moved": moved, "moved_by": moved_by,
            "first_slots": {f"{r}:{d}": int(np.argmax(doc_ids[r] == d)) for r, d in moved},
            "largest": max((moves[d][key] for d in changed for key in moved_by[d]), default=0.0),
            "change": {f"{r}:{d}": m for (r, d), m in moves[changed[0]].items()}, "noise": noise,
            "threshold": threshold}


def _changed(batch: Mapping, slots: np.ndarray, vocab: int) -> dict[str, Any]:
    """The batch with the token of each slot in bool [B, T] `slots` (slot 0 kept) replaced by another."""
    import torch

    ids = batch["input_ids"]
    where_ = torch.from_numpy(slots & (np.arange(slots.shape[1]) > 0)).to(ids.device)
    new = ids.clone()
    new[where_] = (ids[where_] + vocab // 2 + 1) % vocab
    return {**batch, "input_ids": new}


# ---------------------------------------------------------------------------------------------
# The message


def _divergence(first: dict[str, Any] | None) -> str:
    if not first:
        return "no single layer (every tap within its tolerance)"
    return (f"{where(first).replace(' / ', ', quantity `')}`: relative L2 error {first['rel_l2']:.3g} > "
            f"tolerance {first['tol']:.3g}")


def _docs_text(report: dict[str, Any]) -> str:
    d = report["documents"]
    counts = d["counts"]
    n = f"{counts[0]} document(s)" if len(counts) == 1 else f"{sum(counts)} documents in {len(counts)} rows"
    source = {"doc_ids": "doc_ids as given", "batch_doc_ids": "from the batch's doc_ids",
              "rows": "nothing in the batch tells documents apart: one per row"}.get(d["source"], f"from {d['source']}")
    extra = f"; {', '.join(d['disagree'])} put the boundaries elsewhere" if d["disagree"] else ""
    return f"{n} ({source}{extra})"


def _namer(rows: int):
    return (lambda r, d: str(d)) if rows == 1 else (lambda r, d: f"row {r} document {d}")


def _off_text(documents: list[dict[str, Any]], rows: int) -> str:
    """', in document(s) …' over the tolerance at the first divergence, each with its first slot."""
    if not documents:
        return ""
    name = _namer(rows)
    listed = [f"{name(x['row'], x['document'])} (first slot {x['first_slot']})" for x in documents[:LISTED]]
    more = f" and {len(documents) - LISTED} more" if len(documents) > LISTED else ""
    noun = ("documents " if len(documents) > 1 else "document ") if rows == 1 else ""  # else "row r document d"
    return f", in {noun}{', '.join(listed)}{more}"


def _probe_text(probe: dict[str, Any] | None, rows: int) -> str:
    if not probe:
        return ""
    if not probe["ran"]:
        return f" The perturbation probe did not run ({probe['reason']})."
    name, changed = _namer(rows), probe["documents_changed"]
    what = (f"document {changed[0]}'s tokens" if len(changed) == 1
            else f"the tokens of documents {', '.join(map(str, changed))} in turn")
    if not probe["moved"]:
        return f" The perturbation probe changed {what} and no other document moved."
    moved = probe["moved"]
    slots = ", ".join(str(probe["first_slots"][f"{r}:{d}"]) for r, d in moved)
    sweep = "".join(f"changing {d} moved {', '.join(name(r, m) for r, m in probe['moved_by'][d])}; "
                    for d in changed if len(changed) > 1 and probe["moved_by"][d])
    noun = "document(s) " if rows == 1 else ""  # else "row r document d"
    return (f" The perturbation probe changed {what} and {noun}{', '.join(name(r, d) for r, d in moved)} "
            f"moved (first slot{'s' if len(moved) > 1 else ''} {slots}; largest relative change of their logits "
            f"{probe['largest']:.3g} > {probe['threshold']:.3g}): {sweep}documents see each other.")
