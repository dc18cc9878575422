"""Stock transformers, and users' attention functions, held against the oracle (`anchor parity --stack hf`).

Legend: B windows, T slots, N/K query/kv heads, D head dim, R tapped rows, L layers.

Modules, each named for its concern (the names other code uses are also importable from here, `__all__`:
`from parity_tests.hf_stack import hold`):
  stacks     what runs: `Stack`, `stock`, `user_stack`, `input_styles`, the names (IMPLEMENTATIONS,
             INPUT_STYLES, DEFAULT_INPUTS, USER_NAME, ...) and the rules a user's function is held to
             (`check_signature`, `check_output`, `load_function`); `not_run_reason`; `error_line`
  subjects   the model under test: `Subject`, `named_subject`, `module_subject`, `subject_inputs`,
             `stock_model`, `subject_model` (cached; `clear_models`), `torch_dtype`
  inputs     the input styles: `feed`, `collate`, `sequences`, `packed_positions`, `mask4d`, `feed_description`
  runner     `run_stack`, `run_here` and `StackRunner`, the runner `hf:IMPLEMENTATION@STYLE` of the suite's
             registry (`stack_runner` builds it from its name)
  isolation  `Isolated`: the forwards in a child process that may die (a "crash" row)
  judge      `identify`, `bf16_verdict` and `hold` (one row of the report); TRUTH, IDENTIFYING, DTYPES
  rows       a row as its readers take it: `passed`, `closest_margin`, `asked_margin`, `describe_row`
This module holds the entry point, `run_hf_stack`.

What runs, a *stack*:
  a stock implementation  the stock model class of the family (transformers' `LlamaForCausalLM`, ...) with one
                          of transformers' own attention implementations and no torchtrain engine: `eager`,
                          `sdpa`, `flex_attention` (forward only on the CPU), `flash_attention_2` (CUDA and
                          flash-attn: not run by the CPU runners, reported with the reason)
  a user's function       `fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)
                          -> (out [B,T,N,D], weights or None)`, registered in transformers' AttentionInterface
                          under `USER_NAME` (a custom name: transformers builds no mask for it, attention_mask
                          is None and causality is the function's job)

What it is given, per variant (`feed`): the input style (`--inputs`, INPUT_STYLES) names how the batch
reaches a stock model, as real training loops hand it over:
  flattening          DataCollatorWithFlattening's batch (`collate`): input_ids and position_ids restarting
                      at 0 at each sequence (`full` is one sequence per window, 0 … T-1; the other variants'
                      sequences are their documents, `anchor`'s anchor slot a sequence of its own), no
                      attention_mask, use_cache not passed: the model's default (config.use_cache, True for
                      these families), as Trainer and a plain loop call the model. transformers 5.23 looks
                      for packed sequences only where past_key_values is None
                      (masking_utils._preprocess_mask_arguments), and the model makes a DynamicCache whenever
                      use_cache is on (and gradient checkpointing off), so eager, sdpa and flex_attention
                      attend across the documents at their restarted positions
  flattening-nocache  the same with use_cache=False (the default style): the packed sequences are found
                      (find_packed_sequence_indices: a new sequence wherever a position is not the previous
                      one + 1) and each attends within itself. Any 2-D attention_mask, even all ones, turns the
                      search off (test_hf_stack.py::test_an_attention_mask_of_ones_attends_across_documents)
  flash-kwargs        the collator's batch with return_flash_attn_kwargs=True: also cu_seq_lens_q/k and
                      max_length_q/k (what flash_attention_2 reads; the others take them as unused keywords),
                      use_cache at the model's default
  continuous          position_ids 0 … T-1 per window, no attention_mask, use_cache=False
  mask4d-bool,        the variant's own position_ids (§2: the slot index, per-document offsets under
  mask4d-float        intra_doc_reset, since a mask alone cannot reset them) and the variant's mask (§2) as
                      a 4-D attention_mask [B,1,T,T]: bool (True where visible) or float in the model's dtype
                      (0 where visible, the dtype's most negative number where hidden); use_cache=False.
                      transformers uses a 4-D mask as given
  (flash_attention_2 reads cu_seq_lens_q/k and max_length_q/k or, at batch size 1 only, the restarting
  position_ids: modeling_flash_attention_utils._is_packed_sequence.)
  Each implementation runs in a child process (`Isolated`): flex_attention given a 4-D mask on the CPU
  corrupts its heap and the process dies (SIGSEGV, or SIGABRT where glibc's allocator notices first),
  which is a row ("crash") like any other finding.
A user's function (its rows' inputs: "function"):
  function  input_ids, position_ids = the variant's positions (docs/DESIGN.md §2), and the keywords
            doc_ids (int [B,T], §1) and variant, which reach the function in every layer. With
            rope_in="model" (transformers' convention) q and k arrive rotated at position_ids. With
            rope_in="attention" the function applies RoPE itself: transformers' rotary tables are made
            the identity (cos 1, sin 0: exact in every dtype), q and k arrive unrotated, and the function
            may hand its rotated q and k to `kwargs["record_qk"](q, k)` so the report compares them
            (otherwise the comparison starts at each layer's attention output).

How it is judged, per variant asked (`hold`):
  1. which variant it computes: its float32 taps against the oracle's fp64 taps of every variant on
     the same tokens and doc_ids (each with its own positions, §2); a variant is computed when every
     tap of every layer (embeddings, q, k, attention and MLP outputs, hidden states, logits; the
     attention rows are the harness's own reading, left out here) is within the fp32 rule
     (parity_tests.core.Rule.fp32: 1e-5, or 2 x the oracle's own fp32 error where larger). `computes` is
     the variant asked when it is within, else the closest one within, else none (`closest` names the
     nearest);
  2. where it computes the variant asked, its bfloat16 taps against fp64 truth by the suite's bf16
     rule: 2 x the emulation's error (RMS over summation orders) + the floor, the emulation of each
     implementation in parity_tests.emulations.HF_EMULATIONS (a user's function names its own).
An exception in a run is recorded with its first line; a process that dies as "crashes (signal N)".

    from parity_tests.hf_stack import run_hf_stack
    result = run_hf_stack("random:llama", implementations=["sdpa"], variants=["intra_doc"])
    result["rows"][0]["status"], result["rows"][0]["computes"]     # "instead", "intra_doc_reset"
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from anchor_core.errors import InputError
from anchor_core.machine import machine
from anchor_core.progress import ProgressBar
from anchor_core.variants import VARIANTS
from parity_tests.core import RULE, Rule
from parity_tests.hf_stack.inputs import collate, feed, feed_description, mask4d, packed_positions, sequences
from parity_tests.hf_stack.isolation import Isolated
from parity_tests.hf_stack.judge import DTYPES, IDENTIFYING, TRUTH, bf16_verdict, hold, identify, only
from parity_tests.hf_stack.rows import asked_margin, closest_margin, describe_row, passed
from parity_tests.hf_stack.runner import StackRunner, run_here, run_stack
from parity_tests.hf_stack.stacks import (
    FUNCTION_INPUTS,
    IMPLEMENTATIONS,
    INPUT_STYLES,
    Stack,
    check_output,
    error_line,
    input_styles,
    not_run_reason,
    stock,
    user_stack,
)
from parity_tests.hf_stack.subjects import clear_models, module_subject, named_subject, stock_model, subject_inputs
from parity_tests.runners import clear_oracle_cache, registered
from parity_tests.suite import where

# The entry point, and the names other code imports from here (parity_tests.blackbox takes `where`, the
# suite's, and `error_line` from here too).
__all__ = [
    "run_hf_stack",
    "DTYPES", "FUNCTION_INPUTS", "IDENTIFYING", "IMPLEMENTATIONS", "INPUT_STYLES", "TRUTH",
    "Isolated", "Stack", "StackRunner",
    "asked_margin", "bf16_verdict", "check_output", "closest_margin", "collate", "describe_row", "error_line", "feed",
    "feed_description", "hold", "identify", "input_styles", "mask4d", "module_subject", "named_subject",
    "not_run_reason", "only", "packed_positions", "passed", "run_here", "run_stack", "sequences", "stock",
    "stock_model", "subject_inputs", "user_stack", "where",
]


def run_hf_stack(model: Any = "default", *, implementations: Sequence[str] | None = None,
                 attention: Callable[..., Any] | str | None = None, rope_in: str = "model",
                 emulation: str | None = None, variants: Sequence[str] = VARIANTS, seq_len: int = 97,
                 seed: int = 0, dtypes: Sequence[str] = DTYPES, data: str = "random:llama",
                 inputs: str | Sequence[str] | None = None, isolate: bool = True, progress: bool = False,
                 rule: Rule = RULE) -> dict[str, Any]:
    """Hold stock transformers implementations and/or a user's attention function against the oracle.

    Args:
      model: a model name of docs/DESIGN.md §6 (its stock class is built from its weights), or a user's
        transformers causal LM of a supported family (a torch.nn.Module, run as built: its dtype and
        buffers; the oracle reads its weights).
      implementations: transformers' own implementations (IMPLEMENTATIONS); default all of them when no
        `attention` is given, none when one is.
      attention: a user's attention function, or "pkg.module:function".
      rope_in, emulation: for `attention` (see the module docstring; emulation defaults to fa2_bf16 with
        rope_in="model", paper_bf16 with "attention").
      variants: the variants asked; seq_len: T; seed: the documents' lengths.
      dtypes: "float32" (always run: it identifies the variant) and "bfloat16" (the bf16 rule).
      data: for a module, the model whose parity inputs it is fed.
      inputs: the input styles of transformers' own implementations (INPUT_STYLES, comma-separated or a
        list, or "all"; default DEFAULT_INPUTS). A user's function gets its own feed (inputs "function").
      isolate: run transformers' own implementations in child processes (`Isolated`, one per
        implementation), so that one that crashes its process is a "crash" row; a user's module (it
        does not travel to a child: only a model name does) and a user's function run in this process.
    Returns:
      {"stack": "hf", "model", "inputs", "rows": [hold(...) per implementation x style x variant], "pass",
       "rule", "seq_len", "machine", "versions", "runtime_s"}.
    """
    t0 = time.perf_counter()
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or "float32" not in dtypes:
        raise InputError(f"dtypes: float32 and optionally bfloat16, got {list(dtypes)}")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise InputError(f"--variants: unknown variant {bad[0] if bad else None!r} (known: {', '.join(VARIANTS)})")
    if implementations is None:
        implementations = () if attention is not None else IMPLEMENTATIONS
    styles = input_styles(inputs)
    stacks = [stock(i, style) for i in implementations for style in styles]
    if attention is not None:
        stacks.append(user_stack(attention, rope_in=rope_in, emulation=emulation))
    if not stacks:
        raise InputError("nothing to hold: name --attn-implementation or --attention")
    if all(not_run_reason(s) for s in stacks):
        raise InputError(f"nothing was checked: {', '.join(dict.fromkeys(s.name for s in stacks))} cannot run here "
                         f"({not_run_reason(stacks[0])})")
    subject = named_subject(model) if isinstance(model, str) else module_subject(model, data=data)
    if seq_len > subject.spec.max_position:
        raise InputError(f"--seq-len {seq_len} is longer than {subject.name}'s {subject.spec.max_position} positions")
    rows = []
    children: dict[str, Isolated | None] = {}

    def isolated(stack: Stack) -> Isolated | None:
        """transformers' own implementations: one child process each (a user's function, or any stack of a
        user's module, which does not travel to a child, runs in this process)."""
        if stack.user or not isolate:
            return None
        if stack.implementation not in children:
            try:
                children[stack.implementation] = Isolated(subject)
            except TypeError:  # a user's module runs in this process
                children[stack.implementation] = None
        return children[stack.implementation]

    users = [StackRunner(s, subject) for s in stacks if s.user]
    bar = ProgressBar("parity", len(stacks) * len(variants), progress)
    try:
        with registered(*users):  # a user's function is a runner of the registry while it is held
            for variant in sorted(variants, key=lambda v: (v == "anchor", VARIANTS.index(v))):  # shared inputs first
                for stack in stacks:
                    label = stack.name if stack.user else f"{stack.name} / {stack.inputs}"
                    bar.describe(f"{label} / {variant}", log=False)
                    row = hold(subject, stack, variant, seq_len=seq_len, seed=seed, dtypes=dtypes, rule=rule,
                               execute=isolated(stack))
                    rows.append(row)
                    bar.advance(1, f"{label} / {variant}: {describe_row(row)} ({row.get('runtime_s', 0):.1f} s)")
    finally:
        bar.close()
        for child in children.values():
            if child is not None:
                child.close()
        clear_oracle_cache()
        clear_models()
    order = {(s.name, FUNCTION_INPUTS if s.user else s.inputs): i for i, s in enumerate(stacks)}
    rows.sort(key=lambda r: (order[r["implementation"], r["inputs"]], VARIANTS.index(r["variant"])))

    import transformers

    return {"stack": "hf", "model": subject.name, "data": subject.data, "inputs": styles if implementations else [],
            "seq_len": seq_len, "seed": seed,
            "dtypes": list(dtypes), "rows": rows, "pass": all(passed(r) for r in rows), "rule": rule.to_dict(),
            "truth": TRUTH, "transformers": transformers.__version__, "machine": machine(),
            "runtime_s": round(time.perf_counter() - t0, 2)}
