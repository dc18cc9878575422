"""Stock transformers, and users' attention functions, held against the oracle (`anchor parity --stack hf`).

Legend: B windows, T slots, N/K query/kv heads, D head dim, R tapped rows, L layers.

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
     (parity_tests.core.RULE.fp32_tol). `computes` is the variant asked when it is within, else the
     closest one within, else none (`closest` names the nearest);
  2. where it computes the variant asked, its bfloat16 taps against fp64 truth by the suite's bf16
     rule: 2 x the emulation's error (RMS over summation orders) + the floor, the emulation of each
     implementation in parity_tests.emulations.HF_EMULATIONS (a user's function names its own).
An exception in a run is recorded with its first line; a process that dies as "crashes (signal N)".

    from parity_tests.hf_stack import run_hf_stack
    result = run_hf_stack("random:llama", implementations=["sdpa"], variants=["intra_doc"])
    result["rows"][0]["status"], result["rows"][0]["computes"]     # "instead", "intra_doc_reset"
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import importlib.util
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

import jaxref
from anchor_core.errors import InputError
from anchor_core.machine import machine
from anchor_core.progress import ProgressBar
from anchor_core.spec import ModelSpec, from_hf_config, to_hf_config
from anchor_core.variants import VARIANTS
from anchor_core.weights import load_weights
from parity_tests.cases import BF16, Case, CaseInputs, case_inputs
from parity_tests.core import RULE, Rule
from parity_tests.core import hold as judged
from parity_tests.emulations import HF_EMULATIONS
from parity_tests.runners import (
    Runner,
    Taps,
    as_arrays,
    clear_oracle_cache,
    oracle,
    oracle_model,
    register_family,
    registered,
)
from parity_tests.suite import judge_case, where
from torchtrain.taps import capture_taps
from torchtrain.variants import dense_mask

IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa", "flex_attention", "flash_attention_2")
# How a batch reaches a stock model (`--inputs`; the module docstring says what each style feeds).
INPUT_STYLES: tuple[str, ...] = ("flattening", "flattening-nocache", "flash-kwargs", "continuous", "mask4d-bool",
                                 "mask4d-float")
DEFAULT_INPUTS = "flattening-nocache"
FUNCTION_INPUTS = "function"  # a user's function's row: its own feed (position_ids of the variant, keywords)
RopeIn = Literal["model", "attention"]
ROPE_IN: tuple[str, ...] = ("model", "attention")
# The name a user's function is registered under: without "flash" in it, which transformers would take
# for a request of a FlashAttention kernel (and try to import one).
USER_NAME = "anchor_user_attention"
TRUTH = "fp64"
# Taps that say what a stack computed: q/k (its positions), the attention, MLP and hidden outputs (its
# mask) and the logits. The attention rows (scores, probs) are the harness's own reading of q and k
# under the mask asked for, so they are judged in the rule but do not identify a variant.
IDENTIFYING: tuple[str, ...] = ("embed", "q", "k", "attn_out", "mlp_out", "hidden", "logits")
DEFAULT_EMULATION: dict[str, str] = {"model": "fa2_bf16", "attention": "paper_bf16"}
DTYPES: tuple[str, ...] = ("float32", "bfloat16")


# ---------------------------------------------------------------------------------------------
# What runs


@dataclass(frozen=True)
class Stack:
    """One attention implementation under test.

    name: the report's name (an implementation, or `pkg.module:function`).
    implementation: what the model's attn_implementation is set to (USER_NAME for a function).
    function: a user's attention function (None: transformers' own).
    rope_in: for a function, who applies RoPE ("model" or "attention", see the module docstring).
    emulation: the oracle bf16 preset the bf16 rule scales from.
    positions: for transformers' own implementations, "packed" (the style's position_ids) or "variant"
      (position_ids as the variant defines them, §2: what torchtrain's engines get), replacing the style's.
    attention_mask: also pass a 2-D attention_mask of ones (what a tokenizer's batch carries).
    inputs: for transformers' own implementations, the input style (INPUT_STYLES, the module docstring).
    """

    name: str
    implementation: str
    function: Callable[..., Any] | None = None
    rope_in: RopeIn = "model"
    emulation: str = "fa2_bf16"
    positions: Literal["packed", "variant"] = "packed"
    attention_mask: bool = False
    inputs: str = DEFAULT_INPUTS

    @property
    def user(self) -> bool:
        return self.function is not None


def stock(implementation: str, inputs: str = DEFAULT_INPUTS) -> Stack:
    """A stack of one of transformers' own attention implementations (IMPLEMENTATIONS), fed in the input
    style `inputs` (INPUT_STYLES)."""
    if implementation not in IMPLEMENTATIONS:
        raise InputError(f"--attn-implementation: unknown implementation {implementation!r} "
                         f"(known: {', '.join(IMPLEMENTATIONS)})")
    if inputs not in INPUT_STYLES:
        raise InputError(f"--inputs: unknown input style {inputs!r} (known: {', '.join(INPUT_STYLES)}, or all)")
    return Stack(implementation, implementation, emulation=HF_EMULATIONS[implementation], inputs=inputs)


def input_styles(text: str | Sequence[str] | None) -> list[str]:
    """`--inputs`: comma-separated styles, or "all"; None gives the default style."""
    if text is None:
        return [DEFAULT_INPUTS]
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    if items == ["all"]:
        return list(INPUT_STYLES)
    bad = [s for s in items if s not in INPUT_STYLES]
    if bad or not items:
        raise InputError(f"--inputs: unknown input style {bad[0] if bad else ''!r} "
                         f"(known: {', '.join(INPUT_STYLES)}, or all)")
    return list(dict.fromkeys(items))


def user_stack(function: Callable[..., Any] | str, *, rope_in: str = "model", emulation: str | None = None,
               name: str | None = None) -> Stack:
    """A stack of a user's attention function (a callable or "pkg.module:function")."""
    if rope_in not in ROPE_IN:
        raise InputError(f"--rope-in: expected one of {', '.join(ROPE_IN)}, got {rope_in!r}")
    if isinstance(function, str):
        name = name or function
        function = load_function(function)
    if not callable(function):
        raise InputError(f"--attention: {function!r} is not callable")
    name = name or f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"
    check_signature(function, name)
    emulation = emulation or DEFAULT_EMULATION[rope_in]

    jaxref.get_policy(emulation)  # an unknown preset is an InputError here, before any work
    return Stack(name, USER_NAME, function, rope_in, emulation)  # type: ignore[arg-type]


SIGNATURE = "fn(module, query, key, value, attention_mask, **kwargs) -> (out [B,T,N,D], weights or None)"


def check_signature(function: Callable[..., Any], name: str) -> None:
    """Refuse, before anything runs, a function transformers' AttentionInterface cannot call: it is called
    with five positional arguments and keywords (scaling, dropout, position_ids, ... and here doc_ids and
    variant), so it needs five positional parameters (or *args) and **kwargs."""
    import inspect

    try:
        sig = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: it is tried as it is
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_args = any(p.kind == p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    if (len(positional) < 5 and not var_args) or not var_kw:
        raise InputError(f"--attention {name}: takes {sig}; transformers' AttentionInterface calls {SIGNATURE} "
                         "(it also gets doc_ids= and variant=)")


def check_output(name: str, query, result: Any) -> Any:
    """The user's function's result as transformers uses it: a tuple (out [B,T,N,D], weights or None), out
    with the slots before the heads (query arrives [B,N,T,D]); anything else is named with what was expected."""
    B, N, T, D = query.shape
    if not isinstance(result, tuple) or len(result) != 2:
        what = (f"a bare tensor of shape {list(result.shape)}" if hasattr(result, "shape")
                else f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, tuple) else ""))
        raise TypeError(f"{name} returned {what}; expected a tuple (out [B,T,N,D] = {[B, T, N, D]}, weights or None)")
    shape = list(getattr(result[0], "shape", []))
    if shape != [B, T, N, D]:
        hint = (" (heads before slots, as query arrives: transpose(1, 2) it)" if shape == [B, N, T, D] and N != T
                else "")
        raise ValueError(f"{name} returned out of shape {shape}{hint}; expected [B,T,N,D] = {[B, T, N, D]}")
    return result


def load_function(spec: str) -> Callable[..., Any]:
    """`pkg.module:function` -> the function; the working directory is searched first (as `python -m` does)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"--attention: expected pkg.module:function, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any error while importing it is an input error
        raise InputError(f"--attention: cannot import {module_name!r}: {type(e).__name__}: {_first_line(e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InputError(f"--attention: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InputError(f"--attention: {spec} is not callable")
    return obj


def not_run_reason(stack: Stack) -> str | None:
    """None when the stack runs here (the CPU runners), else why not."""
    if stack.implementation == "flash_attention_2":
        import torch

        have = importlib.util.find_spec("flash_attn") is not None
        missing = [w for w, ok in (("CUDA", torch.cuda.is_available()), ("the flash-attn package", have)) if not ok]
        return ("flash_attention_2 runs FlashAttention-2's CUDA kernels"
                + (f"; {' and '.join(missing)} not available here" if missing else "")
                + "; the parity runners run on the CPU")
    return None


# ---------------------------------------------------------------------------------------------
# The model under test


_SUBJECTS = itertools.count()


@dataclass(eq=False)
class Subject:
    """The model under test: its spec and float32 weights (Hugging Face names), the model whose parity
    inputs it is fed (`data`: its tokenizer and documents), and a user's module (run as built) or None
    (the stock class built from the weights)."""

    name: str
    spec: ModelSpec
    state: dict[str, np.ndarray]
    data: str
    module: Any = None
    # what the oracle's cache is keyed by: a named model's is runners.NamedModel's (the suite's cases on the same
    # model and inputs share its runs); a module's a number of its own (ids are reused)
    key: Any = field(default_factory=lambda: next(_SUBJECTS))
    _params: Any = field(default=None, repr=False)

    @property
    def params(self):
        if self._params is None:
            self._params = jaxref.params_from_state(self.spec, self.state)
        return self._params


@functools.lru_cache(maxsize=2)
def named_subject(name: str) -> Subject:
    """A model named as in docs/DESIGN.md §6, fed its own parity inputs; its oracle parameters and cache
    entries are the suite's (runners.oracle_model, NamedModel's key)."""
    spec, state = load_weights(name)
    return Subject(name, spec, dict(state), name, key=("name", name), _params=oracle_model(name)[0])


def module_subject(module: Any, *, data: str = "random:llama") -> Subject:
    """A user's transformers causal LM of a supported family (llama, mistral, qwen2, SmolLM2's llama).

    Its weights are read as they are (bf16 ones widen exactly to float32); `data` names the model whose
    parity inputs it is fed (their token ids must lie within its vocabulary).
    """
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise InputError(f"expected a transformers causal LM (with a .config), got {type(module).__name__}")
    spec = from_hf_config(config.to_dict(), source=f"{type(module).__name__}.config")
    state = {k: v.detach().float().cpu().numpy() for k, v in module.state_dict().items()}
    subject = Subject(f"module:{type(module).__name__}", spec, state, data, module)
    try:
        subject.params  # noqa: B018 (a missing weight is an InputError here, not a KeyError mid-run)
    except KeyError as e:
        raise InputError(f"{type(module).__name__}: no weight {e} (expected Hugging Face names)") from None
    return subject


def subject_inputs(subject: Subject, variant: str, seq_len: int, seed: int = 0) -> CaseInputs:
    """The parity inputs of `subject.data` for the variant (layout plain), checked against the vocabulary."""
    inputs = case_inputs(Case(subject.data, variant, "plain", "fp32", "eager", seq_len, seed=seed))
    if int(inputs.tokens.max()) >= subject.spec.vocab_size:
        raise InputError(f"the inputs of {subject.data} hold token ids up to {int(inputs.tokens.max())}, beyond "
                         f"{subject.name}'s vocabulary of {subject.spec.vocab_size}: name another data model")
    return inputs


def _torch_dtype(dtype: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def stock_model(spec: ModelSpec, state: dict[str, np.ndarray], dtype: str, attn_implementation: str = "eager",
                use_cache: bool | None = False):
    """The family's stock transformers class built from the weights (config by anchor_core.spec.to_hf_config),
    parameters rounded to `dtype`; RoPE's inv_freq stays float32 (built by from_config(dtype=), as
    from_pretrained(dtype=) builds it). In eval mode, with transformers' `attn_implementation` (eager:
    the runners install theirs per call; benchmarks/bench_train_gpu.py trains it with sdpa or flex).

    use_cache: the config's use_cache, the model's default for a call that does not pass it (False: no
    cache, so a packed batch is read as packed; None: the family config's own default, True for the
    families here, as a checkpoint's config.json ships it: the `flattening` input style's model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**to_hf_config(spec))
    if use_cache is not None:
        config.use_cache = use_cache
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=_torch_dtype(dtype))
    tensors = {k: torch.tensor(v) for k, v in state.items() if not (spec.tie_embeddings and k == "lm_head.weight")}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if sorted(missing) != (["lm_head.weight"] if spec.tie_embeddings else []) or unexpected:
        raise InputError(f"weights do not fit the {spec.family} model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


_MODELS: dict[tuple[int, str], Any] = {}


def subject_model(subject: Subject, dtype: str):
    """The torch model of the subject in `dtype` (cached, one subject at a time): the stock class, or a
    copy of the user's module with its parameters cast (buffers kept as built: a bf16 inv_freq stays)."""
    key = (subject.key, dtype)
    if key not in _MODELS:
        for k in [k for k in _MODELS if k[0] != subject.key]:
            del _MODELS[k]
        if subject.module is None:
            model = stock_model(subject.spec, subject.state, dtype, use_cache=None)
        else:
            model = copy.deepcopy(subject.module).eval()
            for p in model.parameters():
                p.data = p.data.to(_torch_dtype(dtype))
        _MODELS[key] = model
    return _MODELS[key]


# ---------------------------------------------------------------------------------------------
# Feeds and taps


def packed_positions(doc_ids: np.ndarray) -> np.ndarray:
    """DataCollatorWithFlattening's position_ids for windows whose sequences are the runs of equal
    doc_ids: 0, 1, … restarting wherever doc_ids changes. int [B, T] -> int64 [B, T]."""
    doc_ids = np.asarray(doc_ids)
    B, T = doc_ids.shape
    out = np.zeros((B, T), dtype=np.int64)
    for b in range(B):
        starts = np.flatnonzero(np.r_[True, doc_ids[b, 1:] != doc_ids[b, :-1]])
        run = np.repeat(starts, np.diff(np.r_[starts, T]))
        out[b] = np.arange(T) - run
    return out


def sequences(doc_ids: np.ndarray, variant: str) -> list[list[tuple[int, int]]]:
    """The sequences a flattening collator is given, per window, as (start, end) slots: `full` has no
    documents to keep apart, so its window is one sequence; the other variants' sequences are the runs of
    equal doc_ids (`anchor`'s anchor slot is a run of its own; padding is one run)."""
    doc_ids = np.asarray(doc_ids)
    B, T = doc_ids.shape
    if variant == "full":
        return [[(0, T)] for _ in range(B)]
    out = []
    for b in range(B):
        starts = np.flatnonzero(np.r_[True, doc_ids[b, 1:] != doc_ids[b, :-1]])
        out.append(list(zip(starts.tolist(), np.r_[starts[1:], T].tolist())))
    return out


def collate(inputs: CaseInputs, variant: str, flash_kwargs: bool) -> dict[str, Any]:
    """The batch transformers' DataCollatorWithFlattening makes of the windows' sequences (`sequences`):
    input_ids and position_ids restarting at 0 per sequence, and with `flash_kwargs` also cu_seq_lens_q/k
    and max_length_q/k. The collator lays every sequence of the batch end to end in one row [1, B*T]; as no
    sequence crosses a window, that row is cut back into the B windows [B, T] (each window's tokens and
    positions unchanged; cu_seq_lens_q/k index the B*T slots laid end to end, as FlashAttention's varlen
    path reads a [B, T] batch). The collator's labels are left out (the forward takes no loss)."""
    import torch
    from transformers import DataCollatorWithFlattening

    B, T = inputs.shape
    features = [{"input_ids": inputs.tokens[b, s:e].tolist()}
                for b, runs in enumerate(sequences(inputs.doc_ids, variant)) for s, e in runs]
    batch = DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=flash_kwargs)(
        features, return_tensors="pt")
    ids = torch.as_tensor(batch["input_ids"])
    if ids.shape != (1, B * T) or not torch.equal(ids.reshape(B, T), torch.from_numpy(inputs.tokens).long()):
        raise AssertionError(f"DataCollatorWithFlattening gave input_ids {tuple(ids.shape)}, not the windows' "
                             f"{B * T} tokens in order")
    out = {"input_ids": ids.reshape(B, T), "position_ids": torch.as_tensor(batch["position_ids"]).reshape(B, T)}
    if flash_kwargs:
        out.update({k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
    return out


def mask4d(doc_ids: np.ndarray, variant: str, kind: Literal["bool", "float"], dtype: str):
    """The variant's mask (§2) as a 4-D attention_mask [B, 1, T, T]: bool (True where a query slot may see
    a key slot), or float in `dtype` (0 where it may, the dtype's most negative number where it may not)."""
    import torch


    allowed = dense_mask(torch.from_numpy(np.asarray(doc_ids)), variant)[:, None]
    if kind == "bool":
        return allowed
    torch_dtype = _torch_dtype(dtype)
    return torch.zeros(allowed.shape, dtype=torch_dtype).masked_fill(~allowed, torch.finfo(torch_dtype).min)


def feed(stack: Stack, inputs: CaseInputs, variant: str, dtype: str = "float32") -> dict[str, Any]:
    """The model's keyword inputs for the variant in the stack's input style (the module docstring);
    `dtype`: the model's, for a float mask."""
    import torch

    tokens = torch.from_numpy(inputs.tokens)
    if stack.user:
        return {"input_ids": tokens, "position_ids": torch.from_numpy(inputs.positions),
                "doc_ids": torch.from_numpy(inputs.doc_ids), "variant": variant, "use_cache": False}
    style = stack.inputs
    if style in ("flattening", "flattening-nocache", "flash-kwargs"):
        out = collate(inputs, variant, flash_kwargs=style == "flash-kwargs")
    elif style == "continuous":
        out = {"input_ids": tokens, "position_ids": torch.arange(inputs.shape[1]).expand(inputs.shape).contiguous()}
    elif style in ("mask4d-bool", "mask4d-float"):
        out = {"input_ids": tokens, "position_ids": torch.from_numpy(inputs.positions),
               "attention_mask": mask4d(inputs.doc_ids, variant, style.removeprefix("mask4d-"), dtype)}
    else:
        raise InputError(f"--inputs: unknown input style {style!r} (known: {', '.join(INPUT_STYLES)})")
    if stack.positions == "variant":
        out["position_ids"] = torch.from_numpy(np.ascontiguousarray(inputs.positions))
    if stack.attention_mask:
        out["attention_mask"] = torch.ones_like(tokens)
    if style not in ("flattening", "flash-kwargs"):  # those two leave use_cache at the model's default
        out["use_cache"] = False
    return out


@contextlib.contextmanager
def _rope_in_attention(model, stack: Stack) -> Iterator[None]:
    """With rope_in="attention": the model's rotary tables made the identity (cos 1, sin 0) for the block,
    so q and k reach the user's function unrotated."""
    if stack.rope_in != "attention":
        yield
        return
    import torch

    handle = model.base_model.rotary_emb.register_forward_hook(
        lambda m, a, out: (torch.ones_like(out[0]), torch.zeros_like(out[1])))
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _registered(stack: Stack) -> Iterator[None]:
    """A user's function registered under USER_NAME for the block (the previous entry put back)."""
    if not stack.user:
        yield
        return
    from transformers import AttentionInterface

    mapping = AttentionInterface._global_mapping
    before = mapping.get(USER_NAME)
    function = stack.function

    def checked(module, query, key, value, attention_mask, *args, **kwargs):
        return check_output(stack.name, query, function(module, query, key, value, attention_mask, *args, **kwargs))

    AttentionInterface.register(USER_NAME, checked)
    try:
        yield
    finally:
        if before is None:
            mapping.pop(USER_NAME, None)
        else:
            mapping[USER_NAME] = before


def run_stack(subject: Subject, stack: Stack, inputs: CaseInputs, variant: str, dtype: str) -> Taps:
    """The stack's taps on the inputs of `variant` (one forward, no gradient) in `dtype`, recorded by
    torchtrain.capture_taps (the recorder of every runner; the attention rows read under the variant asked).

    Compiled code (transformers' `torch.compile(flex_attention)`) is compiled for static shapes: after
    one length, dynamo recompiles the next with dynamic shapes, and the CPU code generator of torch
    2.13 writes flex attention's dynamic-shape kernel with undeclared names (`cur_kvSplitSize0`:
    CppCompileError), so whether the stack erred would hang on what ran before it in the process
    (torchtrain compiles its own flex with `dynamic=False` for the same reason).
    """
    import torch


    model = subject_model(subject, dtype)
    with _registered(stack):
        model.set_attn_implementation(stack.implementation)
        qk = "function" if stack.rope_in == "attention" else "call"
        with (_rope_in_attention(model, stack),
              capture_taps(model, list(inputs.rows), doc_ids=torch.from_numpy(inputs.doc_ids), variant=variant,
                           qk=qk) as taps,
              torch.no_grad(), torch._dynamo.config.patch(automatic_dynamic_shapes=False)):
            model(**feed(stack, inputs, variant, dtype))
    return as_arrays(taps)


# ---------------------------------------------------------------------------------------------
# Where the stack runs: here, or in a child process that may die


Outcome = tuple[str, Any]  # ("ok", taps), ("error", "Type: first line") or ("crash", "crashes (signal N)")
Execute = Callable[["Subject", "Stack", CaseInputs, str, str], Outcome]  # run_here, or an Isolated


def run_here(subject: Subject, stack: Stack, inputs: CaseInputs, variant: str, dtype: str) -> Outcome:
    """`run_stack` in this process; an exception is the outcome "error"."""
    try:
        return "ok", run_stack(subject, stack, inputs, variant, dtype)
    except Exception as e:  # whatever the stack raises is the finding
        return "error", _error(e)


def _child(fd: int) -> None:
    """The child process of `Isolated` (`python -c`, the connection's socket as file descriptor `fd`): the
    subject's model name, then one (stack, inputs, variant, dtype) request at a time, answered with
    run_here's outcome; an end message ends it."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    meta, _ = _unpack(conn.recv_bytes())
    subject = named_subject(meta["subject"])
    while (message := _unpack(conn.recv_bytes()))[0]["kind"] == "request":
        meta, arrays = message
        stack = Stack(**{**meta["stack"], "function": load_function(meta["stack"]["function"])
                         if meta["stack"]["function"] else None})
        inputs = CaseInputs(arrays["tokens"], arrays["doc_ids"], arrays["positions"], arrays["loss_mask"],
                            tuple(meta["rows"]))
        kind, value = run_here(subject, stack, inputs, meta["variant"], meta["dtype"])
        conn.send_bytes(_pack({"kind": kind, "text": None if kind == "ok" else value}, value if kind == "ok" else {}))
    conn.close()


def _pack(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """One message between `Isolated` and its child: a JSON header and numpy arrays (np.savez), nothing
    pickled: both sides read it with json and np.load(allow_pickle=False)."""
    import io
    import json

    buf = io.BytesIO()
    np.savez(buf, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
    head = json.dumps(meta).encode()
    return len(head).to_bytes(8, "little") + head + buf.getvalue()


def _unpack(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    import io
    import json

    n = int.from_bytes(data[:8], "little")
    with np.load(io.BytesIO(data[8 + n:]), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(data[8:8 + n]), arrays


def _function_ref(fn: Callable[..., Any] | None) -> str | None:
    """`module:qualname` of a function the child imports again (load_function); a function it cannot
    import that way (a lambda, a closure) cannot run there."""
    if fn is None:
        return None
    ref = f"{fn.__module__}:{fn.__qualname__}"
    if "<" in ref:
        raise TypeError(f"{ref} cannot be imported by a child process")
    return ref


def crash_text(returncode: int | None) -> str:
    """How a child's end reads in a row: a signal (return code -N) or an exit code."""
    if returncode is not None and returncode < 0:
        return f"crashes (signal {-returncode})"
    return f"crashes (exit code {returncode})"


class Isolated:
    """A runner whose forwards run in a child process: a fresh interpreter (`python -c`, so nothing of this
    process is copied into it and no main module is imported again), spoken to over a socket pair with
    multiprocessing's Connection (`_pack`: JSON and numpy arrays, nothing pickled).

    One child serves every request of a group (an implementation's styles and variants: one start, one
    compilation cache); a request during which the child dies (a segmentation fault in a kernel, an abort)
    gets the outcome ("crash", "crashes (signal N)"), and the next request starts a new child.
    """

    def __init__(self, subject: Subject):
        # the child loads the named model again; a user's module does not travel (the caller runs it here)
        if subject.module is not None:
            raise TypeError("a user's module runs in this process")
        self.ref = subject.name
        self.proc: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        import socket
        import subprocess
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        try:
            proc = subprocess.Popen([sys.executable, "-c", f"from parity_tests.hf_stack import _child; "
                                     f"_child({theirs.fileno()})"], pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()  # the child's end lives in the child only: its death is an EOF here
        self.proc, self.conn = proc, Connection(ours.detach())
        self.conn.send_bytes(_pack({"kind": "subject", "subject": self.ref}, {}))

    def __call__(self, subject: Subject, stack: Stack, inputs: CaseInputs, variant: str, dtype: str) -> Outcome:
        if self.proc is None:
            self._start()
        meta = {"kind": "request", "stack": {**dataclasses.asdict(stack), "function": _function_ref(stack.function)},
                "rows": [int(r) for r in inputs.rows], "variant": variant, "dtype": dtype}
        arrays = {"tokens": inputs.tokens, "doc_ids": inputs.doc_ids, "positions": inputs.positions,
                  "loss_mask": inputs.loss_mask}
        try:
            self.conn.send_bytes(_pack(meta, arrays))
            reply, taps = _unpack(self.conn.recv_bytes())
            return ("ok", taps) if reply["kind"] == "ok" else (reply["kind"], reply["text"])
        except (EOFError, OSError):
            code = self.proc.wait()
            self.conn.close()
            self.proc = self.conn = None
            return "crash", crash_text(code)

    def close(self) -> None:
        import subprocess

        if self.proc is None:
            return
        try:
            self.conn.send_bytes(_pack({"kind": "end"}, {}))
            self.proc.wait(timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self.proc = self.conn = None

    def __enter__(self) -> Isolated:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The stack as a parity runner


RUNNER_PREFIX = "hf:"


class StackFailed(RuntimeError):
    """A stack raised or crashed its process; `kind` is "error" or "crash", the message the row's text."""

    def __init__(self, kind: str, text: str):
        super().__init__(text)
        self.kind = kind


class StackRunner(Runner):
    """A stack (transformers' own implementation in an input style, or a user's function) as a runner of
    parity_tests.runners: registered under `hf:IMPLEMENTATION@STYLE` (or `hf:` + the function's name), run
    by the suite like torchtrain's engines (`anchor parity --engines hf:sdpa@mask4d-float`) and judged by
    the suite's `judge_case` against the one oracle cache.

    subject: the model it runs (None: the case's model by name; a user's module is held against its own
      weights, `oracle_model`). execute: what runs its forwards, `run_here` (the default, this process) or
      an `Isolated` child process (a stack that kills its process is then a "crash").
    """

    def __init__(self, stack: Stack, subject: Subject | None = None, execute: Execute | None = None):
        self.stack, self.subject, self.execute = stack, subject, execute or run_here
        self.name = runner_name(stack)

    @property
    def emulation(self) -> str:  # type: ignore[override]
        return self.stack.emulation

    def available(self) -> str | None:
        return not_run_reason(self.stack)

    def _subject(self, case: Case) -> Subject:
        return self.subject if self.subject is not None else named_subject(case.model)

    def oracle_model(self, case: Case) -> Subject:
        return self._subject(case)

    def case(self, subject: Subject, variant: str, seq_len: int, seed: int = 0, policy: str = "fp32") -> Case:
        """The suite's case of this runner on `subject` (fed the parity inputs of its data model)."""
        return Case(subject.name, variant, "plain", policy, self.name, seq_len, seed=seed,
                    data="" if subject.data == subject.name else subject.data)

    def outcome(self, subject: Subject, inputs: CaseInputs, variant: str, dtype: str) -> Outcome:
        return self.execute(subject, self.stack, inputs, variant, dtype)

    def run(self, case: Case, inputs: CaseInputs, dtype: str) -> Taps:
        kind, value = self.outcome(self._subject(case), inputs, case.variant, dtype)
        if kind != "ok":
            raise StackFailed(kind, f"{self.name}: {value}")
        return value


def runner_name(stack: Stack) -> str:
    """`hf:sdpa@mask4d-float` (transformers' own, in an input style) or `hf:pkg.module:function`."""
    return f"{RUNNER_PREFIX}{stack.name}" if stack.user else f"{RUNNER_PREFIX}{stack.implementation}@{stack.inputs}"


def stack_runner(name: str) -> StackRunner:
    """The runner a registry name `hf:IMPLEMENTATION[@STYLE]` names (runners.get_runner builds it on demand;
    a user's function is registered by whoever holds it, `run_hf_stack`)."""
    implementation, _, style = name.removeprefix(RUNNER_PREFIX).partition("@")
    return StackRunner(stock(implementation, style or DEFAULT_INPUTS))


register_family(RUNNER_PREFIX, stack_runner)


# ---------------------------------------------------------------------------------------------
# Judging (the suite's: parity_tests.core.hold, suite.judge_case, runners.oracle)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {_first_line(e)}"


def only(taps: Taps, names: Sequence[str]) -> Taps:
    """The taps named."""
    return {k: v for k, v in taps.items() if k in names}


def identify(test: Taps, subject: Subject, inputs: CaseInputs, asked: str, rule: Rule = RULE) -> dict[str, Any]:
    """Which variant float32 taps compute: each variant's fp64 truth on the same inputs (at that variant's
    positions), judged by the fp32 rule on the IDENTIFYING taps. Returns {"computes", "closest",
    "candidates": {variant: {"pass", "worst_margin", "first_divergence"}}}."""
    candidates = {}
    for variant in VARIANTS:
        v = judged(only(test, IDENTIFYING), oracle(subject, inputs, variant, TRUTH), inputs, bf16=False, rule=rule)
        candidates[variant] = {"pass": v["pass"], "worst_margin": v["worst_margin"],
                               "first_divergence": v["first_divergence"]}
    within = sorted((c["worst_margin"], v) for v, c in candidates.items() if c["pass"])
    closest = min(candidates, key=lambda v: candidates[v]["worst_margin"])
    computes = asked if candidates[asked]["pass"] else (within[0][1] if within else None)
    return {"computes": computes, "closest": closest, "candidates": candidates}


def bf16_verdict(test: Taps, subject: Subject, inputs: CaseInputs, variant: str, emulation: str,
                 rule: Rule = RULE) -> dict[str, Any]:
    """bfloat16 taps of `subject` against fp64 truth of the variant by the suite's bf16 rule (`judge_case`,
    at the variant's positions, scaled from `emulation`): the black-box check's bf16 verdict."""
    runner = StackRunner(Stack(subject.name, subject.name, emulation=emulation), subject)
    inputs = dataclasses.replace(inputs, positions=jaxref.positions(inputs.doc_ids, variant))
    case = runner.case(subject, variant, inputs.shape[1], policy=BF16)
    return judge_case(case, runner, inputs, test, "bfloat16", rule)


def hold(subject: Subject, stack: Stack, variant: str, *, seq_len: int = 97, seed: int = 0,
         dtypes: Sequence[str] = DTYPES, rule: Rule = RULE, execute: Execute | None = None) -> dict[str, Any]:
    """One row of the report: the stack asked for `variant` (see the module docstring), run as a
    `StackRunner` on the suite's case and judged by the suite's `judge_case`.

    execute: what runs the stack's forwards: `run_here` (default) or an `Isolated` child process (so that a
    stack that crashes its process is a row too).
    Returns {implementation, inputs, variant, status, computes, closest, candidates, fp32 (the suite's case
    entry against the variant asked: pass, first_divergence, worst_margin, layers, ...), bf16 (where it
    computes the variant and bfloat16 is in dtypes: the suite's bf16 case entry, policy the emulation),
    error, reason, runtime_s}; status is "computes", "instead" (computes another variant), "none" (none of
    them within the fp32 rule), "error" (error: the exception's first line), "crash" (error: "crashes
    (signal N)") or "not_run".
    """
    t0 = time.perf_counter()
    runner = StackRunner(stack, subject, execute)
    row: dict[str, Any] = {"implementation": stack.name, "inputs": FUNCTION_INPUTS if stack.user else stack.inputs,
                           "variant": variant, "feed": feed_description(stack, variant), "status": None,
                           "computes": None, "closest": None, "candidates": None, "fp32": None, "bf16": None,
                           "error": None, "reason": None}
    if stack.user:
        row.update(rope_in=stack.rope_in, emulation=stack.emulation)
    reason = runner.available()
    if reason:
        row.update(status="not_run", reason=reason)
        return row
    case = runner.case(subject, variant, seq_len, seed)
    inputs = subject_inputs(subject, variant, seq_len, seed)  # the case's inputs (case_inputs, by its data model)
    row["rows"] = list(inputs.rows)
    kind, test = runner.outcome(subject, inputs, variant, "float32")
    if kind != "ok":  # whatever the stack raises, or its process dying, is the finding
        row.update(status=kind, error=test, runtime_s=round(time.perf_counter() - t0, 2))
        return row
    found = identify(test, subject, inputs, variant, rule)
    row.update(computes=found["computes"], closest=found["closest"], candidates=found["candidates"],
               fp32=judge_case(case, runner, inputs, test, "float32", rule),
               status="computes" if found["computes"] == variant else "instead" if found["computes"] else "none")
    if found["computes"] == variant and "bfloat16" in dtypes:
        kind, test16 = runner.outcome(subject, inputs, variant, "bfloat16")
        if kind != "ok":  # a stack that runs in float32 may still fail in bfloat16
            row.update(status=kind, error=f"bfloat16: {test16}")
        else:
            row["bf16"] = judge_case(dataclasses.replace(case, policy=BF16), runner, inputs, test16, "bfloat16", rule)
    row["runtime_s"] = round(time.perf_counter() - t0, 2)
    return row


def feed_description(stack: Stack, variant: str) -> str:
    """The inputs of a row, in words."""
    if stack.user:
        where = "rotated by the model" if stack.rope_in == "model" else "unrotated (the function applies RoPE)"
        return f"position_ids of the variant (§2), doc_ids and variant as keywords; q/k {where}"
    style = stack.inputs
    cache = "use_cache left at the model's default" if style in ("flattening", "flash-kwargs") else "use_cache=False"
    mask = "an attention_mask of ones" if stack.attention_mask else "no attention_mask"
    if style.startswith("mask4d"):
        mask = f"the variant's mask as a 4-D {style.removeprefix('mask4d-')} attention_mask [B,1,T,T]"
    if stack.positions == "variant" or style.startswith("mask4d"):
        positions = "position_ids of the variant (§2)"
    elif style == "continuous":
        positions = "position_ids 0..T-1"
    elif variant == "full":
        positions = "one sequence: position_ids 0..T-1 (DataCollatorWithFlattening)"
    else:
        positions = "documents flattened: position_ids restart at 0 per document (DataCollatorWithFlattening)"
    flash = ", cu_seq_lens_q/k and max_length_q/k" if style == "flash-kwargs" else ""
    return f"{positions}{flash}, {mask}, {cache}"


def passed(row: dict[str, Any]) -> bool:
    """A row holds: not run (it cannot be judged here), or it computes the variant asked and passes the
    bf16 rule where that was run."""
    if row["status"] == "not_run":
        return True
    return row["status"] == "computes" and (row["bf16"] is None or row["bf16"]["pass"])


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
        _MODELS.clear()
    order = {(s.name, FUNCTION_INPUTS if s.user else s.inputs): i for i, s in enumerate(stacks)}
    rows.sort(key=lambda r: (order[r["implementation"], r["inputs"]], VARIANTS.index(r["variant"])))

    import transformers

    return {"stack": "hf", "model": subject.name, "data": subject.data, "inputs": styles if implementations else [],
            "seq_len": seq_len, "seed": seed,
            "dtypes": list(dtypes), "rows": rows, "pass": all(passed(r) for r in rows), "rule": rule.to_dict(),
            "truth": TRUTH, "transformers": transformers.__version__, "machine": machine(),
            "runtime_s": round(time.perf_counter() - t0, 2)}


def closest_margin(row: dict[str, Any]) -> float:
    """The closest variant's worst error over the fp32 tolerance (> 1 for a row that computes none)."""
    return row["candidates"][row["closest"]]["worst_margin"]


def asked_margin(row: dict[str, Any]) -> float:
    """The variant asked's worst error over the fp32 tolerance (> 1 for a row that computes another)."""
    return row["candidates"][row["variant"]]["worst_margin"]


def describe_row(row: dict[str, Any]) -> str:
    """One line: what the stack computes for the variant asked, and the bf16 rule's verdict."""
    status = row["status"]
    if status == "not_run":
        return f"not run ({row['reason']})"
    if status == "error":
        return f"error: {row['error']}"
    if status == "crash":
        return row["error"]
    fp32 = f"fp32 first divergence from {row['variant']} at {where(row['fp32']['first_divergence'])}"
    if status == "instead":
        return (f"computes {row['computes']} instead of {row['variant']} ({asked_margin(row):.3g} x the fp32 "
                f"tolerance from it; {fp32})")
    if status == "none":
        return (f"computes none of the variants (closest: {row['closest']}, "
                f"{closest_margin(row):.3g} x the fp32 tolerance; {fp32})")
    if row["bf16"] is None:
        return "computes it"
    b = row["bf16"]
    return "computes it; bf16 rule " + ("passes" if b["pass"] else f"FAILS at {where(b['first_divergence'])}")

