"""The stack as a parity runner: `run_stack` (one forward, its taps recorded by torchtrain.capture_taps),
`run_here` (that in this process, an exception its outcome "error") and `StackRunner`, the runner of
parity_tests.runners registered under `hf:IMPLEMENTATION@STYLE` (or `hf:` + a user's function's name),
built on demand by `stack_runner` (the family `hf:`, registered when this module is imported).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from parity_tests.cases import Case, CaseInputs
from parity_tests.hf_stack.inputs import feed
from parity_tests.hf_stack.stacks import (DEFAULT_INPUTS, USER_NAME, Stack, check_output, error_line, not_run_reason,
                                          stock)
from parity_tests.hf_stack.subjects import Subject, named_subject, subject_model
from parity_tests.runners import Runner, Taps, as_arrays, register_family
from torchtrain.model.taps import capture_taps


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


Outcome = tuple[str, Any]  # ("ok", taps), ("error", "Type: first line") or ("crash", "crashes (signal N)")
Execute = Callable[["Subject", "Stack", CaseInputs, str, str], Outcome]  # run_here, or an Isolated


def run_here(subject: Subject, stack: Stack, inputs: CaseInputs, variant: str, dtype: str) -> Outcome:
    """`run_stack` in this process; an exception is the outcome "error"."""
    try:
        return "ok", run_stack(subject, stack, inputs, variant, dtype)
    except Exception as e:  # whatever the stack raises is the finding
        return "error", error_line(e)


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
