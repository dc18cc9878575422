"""What runs: a stack (one of transformers' own attention implementations in an input style, or a user's
attention function), and the rules a user's function is held to before and while it runs.

`stock` and `user_stack` build a `Stack` (an unknown implementation, style, rope_in or emulation is an
InputError before any work); `check_signature` refuses a function transformers cannot call, `check_output`
names a result transformers cannot use, `load_function` imports `pkg.module:function`, `not_run_reason`
says why a stack cannot run here. The package docstring (parity_tests.hf_stack) says what each input style
feeds and how a row is judged.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jaxref
from anchor_core.errors import InputError
from parity_tests.emulations import HF_EMULATIONS


IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa", "flex_attention", "flash_attention_2")
# How a batch reaches a stock model (`--inputs`; the package docstring says what each style feeds).
INPUT_STYLES: tuple[str, ...] = ("flattening", "flattening-nocache", "flash-kwargs", "continuous", "mask4d-bool",
                                 "mask4d-float")
DEFAULT_INPUTS = "flattening-nocache"
FUNCTION_INPUTS = "function"  # a user's function's row: its own feed (position_ids of the variant, keywords)
RopeIn = Literal["model", "attention"]
ROPE_IN: tuple[str, ...] = ("model", "attention")
# The name a user's function is registered under: without "flash" in it, which transformers would take
# for a request of a FlashAttention kernel (and try to import one).
USER_NAME = "anchor_user_attention"
DEFAULT_EMULATION: dict[str, str] = {"model": "fa2_bf16", "attention": "paper_bf16"}


@dataclass(frozen=True)
class Stack:
    """One attention implementation under test.

    name: the report's name (an implementation, or `pkg.module:function`).
    implementation: what the model's attn_implementation is set to (USER_NAME for a function).
    function: a user's attention function (None: transformers' own).
    rope_in: for a function, who applies RoPE ("model" or "attention", see the package docstring).
    emulation: the oracle bf16 preset the bf16 rule scales from.
    positions: for transformers' own implementations, "packed" (the style's position_ids) or "variant"
      (position_ids as the variant defines them, §2: what torchtrain's engines get), replacing the style's.
    attention_mask: also pass a 2-D attention_mask of ones (what a tokenizer's batch carries).
    inputs: for transformers' own implementations, the input style (INPUT_STYLES, the package docstring).
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def error_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (a row's or a report's error)."""
    return f"{type(e).__name__}: {_first_line(e)}"
