"""What every job of the demo reads, and the job folder that holds several anchor outputs.

`JobContext` carries the demo folder, the settings, how to report and the records of earlier jobs;
`_container` makes a job folder that holds several runs or evaluations and marks it as the demo's. The jobs
(`anchor.demo.jobs`, `anchor.demo.train_job`, `anchor.demo.eval_job`) each take a context and return a
small JSON summary; what they share is here, so that none of them imports another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from anchor.demo.settings import DemoSettings
from anchor_core.outdir import read_marker, write_marker


@dataclass
class JobContext:
    """What a job reads: the demo folder, the settings, how to report, and the records of earlier jobs."""

    out: Path
    settings: DemoSettings
    progress: bool
    say: Callable[[str], None]
    records: dict[str, Any] = field(default_factory=dict)

    def folder(self, name: str) -> Path:
        """The folder of the job `name` in the demo folder."""
        return self.out / name


def _container(path: Path) -> None:
    """A job folder holding several anchor outputs (runs, evaluations): made and marked as the demo's."""
    path.mkdir(parents=True, exist_ok=True)
    if read_marker(path) is None:
        write_marker(path, "demo")
