"""A length schedule (`schedule.phases`, docs/DESIGN.md §8): one run trains phase after phase, each on windows of
its own length packed for it, with its own RoPE base and peak learning rate, as ProLong (64K, then 512K) and
EasyContext (rising windows with a rising RoPE base) do, in one command that resumes anywhere.

    phases = run_phases(cfg)                 # [Phase(index=1, first=1, last=300, seq_len=65536, cfg=...), ...]
    phase_at(phases, step)                   # the phase optimizer step `step` (from 1) trains in
    loader = PhasedLoader(phases, open_loader)   # each step's batch from its phase's Loader

A phase's config (`Phase.cfg`) is the run's with the phase's length as `data.seq_len`, its `rope_theta` as
`model.rope.theta` and its `lr` as `optim.lr`, and no phases: every check made of a run of one length (the
model's positions, sequence parallelism, one step's memory, the held-out windows) runs on it unchanged, phase by
phase. A run without phases is one phase of all its steps, its config the run's own.

What changes at a phase's first step, and again after a resume inside a phase:
  data      the phase's windows: RUN/data-<seq_len>/, packed from `data.path` for that length before training
            starts (torchtrain.training.run_folder); its `eval.heldout_windows` held out of its batches
  RoPE      the rotary embeddings' frequencies and scaling set to the phase's (torchtrain.model.set_rope); hf/
            of a checkpoint carries the RoPE and length of the phase it was written in
  lr        optim.lr replaced by the phase's: the schedule's shape (warmup, then constant, cosine or linear decay
            over the whole run's steps) times the phase's peak (torchtrain.training.optim.lr_factor)
The loader's position in a checkpoint names its phase (`PhasedLoader.state_dict`): a run killed inside a phase
resumes at the same window of the same phase; one whose checkpoint ends a phase starts the next at its first.

Earlier releases called a phase a stage: their module path (torchtrain.training.stages, torchtrain.MOVED) and names
(`OLD_NAMES`, with a DeprecationWarning) import for one release, and a checkpoint's loader position of then
(`"stage"`) resumes.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from anchor_core.errors import InputError
from torchtrain.config import TrainConfig, with_changes

if TYPE_CHECKING:
    from anchor_core.data.batch import Batch
    from anchor_core.data.packed import Loader

# The loader position's key naming its phase; checkpoints of earlier releases wrote OLD_STATE_KEY.
STATE_KEY, OLD_STATE_KEY = "phase", "stage"


@dataclass(frozen=True)
class Phase:
    """Phase `index` (from 1) trains optimizer steps `first` to `last` (inclusive) on windows of `seq_len`
    (None: a run without phases whose length its packed data gives); `cfg` is its config (module docstring)."""

    index: int
    first: int
    last: int
    seq_len: int | None
    cfg: TrainConfig

    def describe(self, of: int, rope_base: float) -> str:
        """`phase 2 of 2 (steps 5-8): 1024 slots, RoPE base 1e+06, lr 0.0005` (`rope_base`: the phase's model's)."""
        return (f"phase {self.index} of {of} (steps {self.first}-{self.last}): {self.seq_len} slots, RoPE base "
                f"{rope_base:g}, lr {self.cfg.optim.lr:g}")


def run_phases(cfg: TrainConfig) -> list[Phase]:
    """The phases of a run, in order (one without `schedule.phases`)."""
    if not cfg.schedule.phases:
        return [Phase(1, 1, cfg.schedule.steps, cfg.data.seq_len, cfg)]
    out, first = [], 1
    for i, p in enumerate(cfg.schedule.phases, start=1):
        changes: dict[str, Any] = {"data.seq_len": p.seq_len, "schedule.phases": []}
        if p.rope_theta is not None:
            changes["model.rope.theta"] = p.rope_theta
        if p.lr is not None:
            changes["optim.lr"] = p.lr
        out.append(Phase(i, first, first + p.steps - 1, p.seq_len, with_changes(cfg, changes)))
        first += p.steps
    return out


def phase_at(phases: list[Phase], step: int) -> Phase:
    """The phase of optimizer step `step` (from 1; a step past the last is the last phase's)."""
    return phases[phase_index([p.last - p.first + 1 for p in phases], step)]


def phase_index(steps: Sequence[int], step: int) -> int:
    """The index (from 0) of the phase that trains optimizer step `step` (from 1), phases of `steps` steps each
    following each other; a step past the last is the last phase's."""
    last = 0
    for i, n in enumerate(steps):
        last += n
        if step <= last:
            return i
    return len(steps) - 1


@contextlib.contextmanager
def named_phase(phase: Phase, run_cfg: TrainConfig) -> Iterator[None]:
    """A check of one phase's config that fails is the same line naming the phase, at `schedule.phases` in the
    run's config (or at the data folder it names); a run without phases' errors pass unchanged."""
    try:
        yield
    except InputError as e:
        if not run_cfg.schedule.phases:
            raise
        where = e.path if e.path and Path(e.path).is_dir() else run_cfg.where("schedule.phases")
        raise type(e)(f"schedule.phases[{phase.index}] ({phase.seq_len} slots): {e.message}", path=where) from None


class PhasedLoader:
    """The batches of a run of phases: step k's from the Loader of the phase step k trains in (`open_loader(phase)`
    makes one, at its first window), so that every phase starts at its first window and a resume continues at
    the window it stopped at. Holds one phase's Loader at a time."""

    def __init__(self, phases: list[Phase], open_loader: Callable[[Phase], Loader]):
        self.phases, self._open = phases, open_loader
        self.done = 0  # optimizer steps whose batches were given
        self.phase: Phase | None = None
        self.loader: Loader | None = None

    def __iter__(self) -> "PhasedLoader":
        return self

    def __next__(self) -> Batch:
        phase = phase_at(self.phases, self.done + 1)
        if phase is not self.phase:
            self.phase, self.loader = phase, self._open(phase)
        batch = next(self.loader)
        self.done += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position of the current phase's Loader, and the phase (from 1): taken after a step."""
        return {**self.loader.state_dict(), STATE_KEY: self.phase.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` was taken; a state without a phase (a run from before length schedules) is of the
        first; one of an earlier release names it under OLD_STATE_KEY."""
        index = state.get(STATE_KEY, state.get(OLD_STATE_KEY, 1))
        if not isinstance(index, int) or isinstance(index, bool) or not 1 <= index <= len(self.phases):
            raise InputError(f"loader state of phase {index!r}, the run has {len(self.phases)} phase(s)")
        phase = self.phases[index - 1]
        loader = self._open(phase)
        loader.load_state_dict(state)
        self.phase, self.loader = phase, loader
        self.done = phase.first - 1 + loader.epoch * loader.steps_per_epoch + loader.step


# The names of earlier releases (torchtrain.training.stages), for one release: each the new name's object, with a
# DeprecationWarning naming it.
OLD_NAMES = {"Stage": "Phase", "run_stages": "run_phases", "stage_at": "phase_at", "stage_index": "phase_index",
             "named_stage": "named_phase", "StagedLoader": "PhasedLoader"}


def __getattr__(name: str) -> Any:
    if name not in OLD_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{name} is now {__name__}.{OLD_NAMES[name]}; the old name goes in the next release",
                  DeprecationWarning, stacklevel=2)
    return globals()[OLD_NAMES[name]]
