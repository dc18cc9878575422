"""What every stage of the demo reads, and the stage folder that holds several anchor outputs.

`StageContext` carries the demo folder, the settings, how to report and the records of earlier stages;
`_container` makes a stage folder that holds several runs or evaluations and marks it as the demo's. The stages
(`anchor.demo.stages`, `anchor.demo.train_stage`, `anchor.demo.eval_stage`) each take a context and return a
small JSON summary; what they share is here, so that none of them imports another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from anchor.demo.settings import DemoSettings
from anchor_core.outdir import read_marker, write_marker


@dataclass
class StageContext:
    """What a stage reads: the demo folder, the settings, how to report, and the records of earlier stages."""

    out: Path
    settings: DemoSettings
    progress: bool
    say: Callable[[str], None]
    records: dict[str, Any] = field(default_factory=dict)

    def stage(self, name: str) -> Path:
        return self.out / name


def _container(path: Path) -> None:
    """A stage folder holding several anchor outputs (runs, evaluations): made and marked as the demo's."""
    path.mkdir(parents=True, exist_ok=True)
    if read_marker(path) is None:
        write_marker(path, "demo")
