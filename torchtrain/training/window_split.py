"""The smallest split of one window over ranks that fits a device: Ulysses x context parallelism, planned.

    proposal = propose_split(spec, seq_len, budget=..., **step)   # step: step_memory's keywords (step_of)

For each number of ranks d = 1, 2, ... a window may be split over, every (Ulysses U, context parallel C) with
U C = d is judged: U must divide the query heads (`torchtrain.parallel.ulysses.check_sequence_parallel`) and the
C-share of the window, C must divide the window (`torchtrain.parallel.context.check_context_parallel`); a split
that may run is planned (`torchtrain.training.memory.step_memory` at U and C) and fits when its step's total is
within the budget. The first d with a split that fits is proposed, the one of its splits with the largest U (the
all-to-all moves 1/U of each rank's activations, where the all-gather moves the whole window's keys and values);
every smaller d is kept with why none of its splits serves. Nothing is built or allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from anchor_core.errors import InputError
from anchor_core.spec import ModelSpec
from torchtrain.parallel.context import check_context_parallel
from torchtrain.parallel.ulysses import check_sequence_parallel
from torchtrain.training.memory import StepMemory, largest_term, step_memory

MAX_RANKS = 4096  # the search stops here: no split of a window over more ranks is planned


@dataclass(frozen=True)
class Split:
    """One (Ulysses, context parallel) split of the window: why it cannot run (`refused`), or its step's memory."""

    ulysses: int
    context: int
    refused: str = ""
    need: StepMemory | None = None
    fits: bool = False

    @property
    def ranks(self) -> int:
        return self.ulysses * self.context

    def why(self, budget: int) -> str:
        """A short reason this split does not serve (empty when it fits)."""
        if self.refused:
            return self.refused
        if self.fits:
            return ""
        name, size = largest_term(self.need)  # type: ignore[arg-type]
        return (f"{self.need.total / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB ({name} the largest term, "  # type: ignore[union-attr]
                f"{size / 2**30:.1f} GiB)")


@dataclass
class SplitPlan:
    """The splits judged, by number of ranks, and the proposal (None: nothing up to MAX_RANKS fits)."""

    seq_len: int
    budget: int
    by_ranks: dict[int, list[Split]] = field(default_factory=dict)
    proposal: Split | None = None


def judge_split(spec: ModelSpec, seq_len: int, ulysses: int, context: int, *, budget: int, **step: Any) -> Split:
    """One split: refused in the words `anchor train` uses, else planned against `budget`."""
    try:
        check_context_parallel(seq_len, context)
        check_sequence_parallel(spec, seq_len // context, ulysses)
    except InputError as e:
        return Split(ulysses, context, refused=str(e))
    procs = step.pop("procs", 1)
    world = max(int(step.pop("world", 1) or 1), ulysses * context)
    on_cpu = step.get("device", "cpu") == "cpu"
    need = step_memory(spec, seq_len=seq_len, sequence_parallel=ulysses, context_parallel=context,
                       procs=ulysses * context if on_cpu else procs, world=world, **step)
    return Split(ulysses, context, need=need, fits=need.total <= budget)


def propose_split(spec: ModelSpec, seq_len: int, *, budget: int, max_ranks: int = MAX_RANKS, **step: Any) -> SplitPlan:
    """The smallest number of ranks whose best split fits (module docstring). `step`: step_memory's keywords
    but `seq_len`, `sequence_parallel` and `context_parallel` (`step_of`'s, without those)."""
    plan = SplitPlan(seq_len, budget)
    for d in range(1, max_ranks + 1):
        splits = [judge_split(spec, seq_len, u, d // u, budget=budget, **dict(step))
                  for u in range(d, 0, -1) if d % u == 0]
        plan.by_ranks[d] = splits
        fitting = [s for s in splits if s.fits]
        if fitting:
            plan.proposal = fitting[0]  # the largest Ulysses degree first
            break
    return plan
