"""`generate`: a RULER task's samples, each fitted to the length (upstream's scripts/data/prepare.py, which
runs a task's family script): the family's plan of one sample's draws, then its haystack size searched so
the prompt and its answer budget fill the length."""

from __future__ import annotations

import numbers
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from anchor_core.errors import InputError
from anchor_core.tokenizer import Tok
from anchor.eval.ruler.common import Plan, fit, load_haystack
from anchor.eval.ruler.common_words_extraction import cwe_planner
from anchor.eval.ruler.freq_words_extraction import fwe_plan
from anchor.eval.ruler.niah import niah_plan
from anchor.eval.ruler.qa import load_qa, qa_plan
from anchor.eval.ruler.tasks import CweArgs, FweArgs, NiahArgs, TaskConfig, VtArgs, task_config
from anchor.eval.ruler.variable_tracking import vt_icl_example, vt_plan


@dataclass(frozen=True)
class Sample:
    """One RULER prompt: the model reads `input + answer_prefix` and may write `tokens_to_generate`.

    `prompt_tokens` counts the tokens of `input + answer_prefix` (no special tokens);
    `haystack_size` is the number of haystack units the prompt holds (see `anchor.eval.ruler`).
    """

    task: str
    length: int
    index: int
    input: str
    answer_prefix: str
    answers: list[str]
    tokens_to_generate: int
    prompt_tokens: int
    haystack_size: int

    @property
    def prompt(self) -> str:
        return self.input + self.answer_prefix

    def record(self) -> dict:
        """The sample as a JSON-able dict (the fields `samples.jsonl` holds, docs/DESIGN.md §9, and more)."""
        return asdict(self)


def generate(task: str, length: int, tokenizer: Tok, n_samples: int, seed: int = 42,
             haystack: str | Path | None = None, qa_data: str | Path | None = None) -> list[Sample]:
    """`n_samples` prompts of a RULER task that fill `length` tokens, answer budget included.

    Args:
      task: one of `TASK_NAMES`.
      length: the target length in tokens (prompt + answer budget).
      tokenizer: the model's tokenizer (`anchor_core.tokenizer.load_tokenizer`).
      n_samples: how many samples.
      seed: the random seed; the same arguments give the same samples.
      haystack: the essay tasks' prose: a text file or JSONL with a "text" field; None: the embedded
        corpus' prose. cwe adds its words when it needs more than `anchor.eval.words` holds.
      qa_data: qa_1: SQuAD v2.0 dev JSON; qa_2: HotpotQA dev distractor JSON.

    Returns one `Sample` per index, each with `prompt_tokens + tokens_to_generate <= length` and as
    large as its haystack allows (within one haystack unit of `length`).
    """
    cfg = task_config(task)
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length <= 0:
        raise InputError(f"a RULER length must be a positive integer, got {length!r}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 0:
        raise InputError(f"the number of samples must be a non-negative integer, got {n_samples!r}")
    length, n_samples = int(length), int(n_samples)
    budget = cfg.template.tokens_to_generate
    limit = length - budget

    def count(text: str) -> int:
        return len(tokenizer.encode_batch([text])[0])

    planner = _planner(task, cfg, length, seed, count, haystack, qa_data, n_samples)
    samples: list[Sample] = []
    start: int | None = None
    for i in range(n_samples):
        plan = planner(random.Random(f"ruler/{task}/{seed}/{i}"), i)
        memo: dict[int, int] = {}

        def tokens(n: int, plan: Plan = plan, memo: dict[int, int] = memo) -> int:
            if n not in memo:
                r = plan.render(n)
                memo[n] = count(r.input + r.answer_prefix)
            return memo[n]

        n = fit(tokens, limit, plan.lo, plan.hi, start)
        if n is None:
            raise InputError(f"RULER task {task} does not fit in {length} tokens: its prompt with the "
                             f"least haystack takes {tokens(plan.lo)} tokens and its answer {budget}")
        start = n
        r = plan.render(n)
        samples.append(Sample(task=task, length=length, index=i, input=r.input,
                              answer_prefix=r.answer_prefix, answers=list(plan.answers),
                              tokens_to_generate=budget, prompt_tokens=tokens(n), haystack_size=n))
    return samples


def _planner(task: str, cfg: TaskConfig, length: int, seed: int, count: Callable[[str], int],
             haystack: str | Path | None, qa_data: str | Path | None,
             n_samples: int) -> Callable[[random.Random, int], Plan]:
    """`plan(rng, index)` for a task: the family's draws for one sample."""
    a = cfg.args
    if isinstance(a, NiahArgs):
        hay = load_haystack(haystack) if a.type_haystack == "essay" else None
        return lambda rng, i: niah_plan(a, rng, seed, hay)
    if isinstance(a, VtArgs):
        icl = vt_icl_example(a, random.Random(f"ruler/{task}/{seed}/icl"), count)
        return lambda rng, i: vt_plan(a, rng, icl)
    if isinstance(a, CweArgs):
        return cwe_planner(a, length, seed, count, haystack)
    if isinstance(a, FweArgs):
        vocab_size = (length - cfg.template.tokens_to_generate) // 50 if a.vocab_size == -1 else a.vocab_size
        return lambda rng, i: fwe_plan(a, rng, seed, vocab_size)
    qas, docs = load_qa(task, qa_data)
    if n_samples > len(qas):
        raise InputError(f"{task}: the file holds {len(qas)} answerable questions, {n_samples} samples "
                         "were asked for", path=qa_data)
    return lambda rng, i: qa_plan(qas[i], docs, rng, seed)
