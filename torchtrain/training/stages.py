"""A length schedule (`schedule.stages`, docs/DESIGN.md §8): one run trains stage after stage, each on windows of
its own length packed for it, with its own RoPE base and peak learning rate, as ProLong (64K, then 512K) and
EasyContext (rising windows with a rising RoPE base) do, in one command that resumes anywhere.

    stages = run_stages(cfg)                 # [Stage(index=1, first=1, last=300, seq_len=65536, cfg=...), ...]
    stage_at(stages, step)                   # the stage optimizer step `step` (from 1) trains in
    loader = StagedLoader(stages, open_loader)   # each step's batch from its stage's Loader

A stage's config (`Stage.cfg`) is the run's with the stage's length as `data.seq_len`, its `rope_theta` as
`model.rope.theta` and its `lr` as `optim.lr`, and no stages: every check made of a run of one length (the
model's positions, sequence parallelism, one step's memory, the held-out windows) runs on it unchanged, stage by
stage. A run without stages is one stage of all its steps, its config the run's own.

What changes at a stage's first step, and again after a resume inside a stage:
  data      the stage's windows: RUN/data-<seq_len>/, packed from `data.path` for that length before training
            starts (torchtrain.training.run_folder); its `eval.heldout_windows` held out of its batches
  RoPE      the rotary embeddings' frequencies and scaling set to the stage's (torchtrain.model.set_rope); hf/
            of a checkpoint carries the RoPE and length of the stage it was written in
  lr        optim.lr replaced by the stage's: the schedule's shape (warmup, then constant, cosine or linear decay
            over the whole run's steps) times the stage's peak (torchtrain.training.optim.lr_factor)
The loader's position in a checkpoint names its stage (`StagedLoader.state_dict`): a run killed inside a stage
resumes at the same window of the same stage; one whose checkpoint ends a stage starts the next at its first.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from anchor_core.errors import InputError
from torchtrain.config import TrainConfig, with_changes

if TYPE_CHECKING:
    from anchor_core.data.batch import Batch
    from anchor_core.data.packed import Loader


@dataclass(frozen=True)
class Stage:
    """Stage `index` (from 1) trains optimizer steps `first` to `last` (inclusive) on windows of `seq_len`
    (None: a run without stages whose length its packed data gives); `cfg` is its config (module docstring)."""

    index: int
    first: int
    last: int
    seq_len: int | None
    cfg: TrainConfig

    def describe(self, of: int, rope_base: float) -> str:
        """`stage 2 of 2 (steps 5-8): 1024 slots, RoPE base 1e+06, lr 0.0005` (`rope_base`: the stage's model's)."""
        return (f"stage {self.index} of {of} (steps {self.first}-{self.last}): {self.seq_len} slots, RoPE base "
                f"{rope_base:g}, lr {self.cfg.optim.lr:g}")


def run_stages(cfg: TrainConfig) -> list[Stage]:
    """The stages of a run, in order (one without `schedule.stages`)."""
    if not cfg.schedule.stages:
        return [Stage(1, 1, cfg.schedule.steps, cfg.data.seq_len, cfg)]
    out, first = [], 1
    for i, s in enumerate(cfg.schedule.stages, start=1):
        changes: dict[str, Any] = {"data.seq_len": s.seq_len, "schedule.stages": []}
        if s.rope_theta is not None:
            changes["model.rope.theta"] = s.rope_theta
        if s.lr is not None:
            changes["optim.lr"] = s.lr
        out.append(Stage(i, first, first + s.steps - 1, s.seq_len, with_changes(cfg, changes)))
        first += s.steps
    return out


def stage_at(stages: list[Stage], step: int) -> Stage:
    """The stage of optimizer step `step` (from 1; a step past the last is the last stage's)."""
    return stages[stage_index([s.last - s.first + 1 for s in stages], step)]


def stage_index(steps: Sequence[int], step: int) -> int:
    """The index (from 0) of the stage that trains optimizer step `step` (from 1), stages of `steps` steps each
    following each other; a step past the last is the last stage's."""
    last = 0
    for i, n in enumerate(steps):
        last += n
        if step <= last:
            return i
    return len(steps) - 1


@contextlib.contextmanager
def named_stage(stage: Stage, run_cfg: TrainConfig) -> Iterator[None]:
    """A check of one stage's config that fails is the same line naming the stage, at `schedule.stages` in the
    run's config (or at the data folder it names); a run without stages' errors pass unchanged."""
    try:
        yield
    except InputError as e:
        if not run_cfg.schedule.stages:
            raise
        where = e.path if e.path and Path(e.path).is_dir() else run_cfg.where("schedule.stages")
        raise type(e)(f"schedule.stages[{stage.index}] ({stage.seq_len} slots): {e.message}", path=where) from None


class StagedLoader:
    """The batches of a run of stages: step k's from the Loader of the stage step k trains in (`open_loader(stage)`
    makes one, at its first window), so that every stage starts at its first window and a resume continues at
    the window it stopped at. Holds one stage's Loader at a time."""

    def __init__(self, stages: list[Stage], open_loader: Callable[[Stage], Loader]):
        self.stages, self._open = stages, open_loader
        self.done = 0  # optimizer steps whose batches were given
        self.stage: Stage | None = None
        self.loader: Loader | None = None

    def __iter__(self) -> "StagedLoader":
        return self

    def __next__(self) -> Batch:
        stage = stage_at(self.stages, self.done + 1)
        if stage is not self.stage:
            self.stage, self.loader = stage, self._open(stage)
        batch = next(self.loader)
        self.done += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position of the current stage's Loader, and the stage (from 1): taken after a step."""
        return {**self.loader.state_dict(), "stage": self.stage.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` was taken; a state without a stage (a run from before stages) is of the first."""
        index = state.get("stage", 1)
        if not isinstance(index, int) or isinstance(index, bool) or not 1 <= index <= len(self.stages):
            raise InputError(f"loader state of stage {index!r}, the run has {len(self.stages)} stage(s)")
        stage = self.stages[index - 1]
        loader = self._open(stage)
        loader.load_state_dict(state)
        self.stage, self.loader = stage, loader
        self.done = stage.first - 1 + loader.epoch * loader.steps_per_epoch + loader.step
