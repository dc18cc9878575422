"""One progress bar for long work: a live rich bar on a terminal, one line per step in a log."""

from __future__ import annotations


class ProgressBar:
    """A rich progress bar on stderr labelled `label`, or nothing when `enabled` is false.

    `describe(text, log=True)` names the current phase; `advance(n, note=None)` counts work done.
    When stderr is not a terminal (CI logs, `make demo > log`), the phase descriptions and notes
    are printed as plain lines with the count so far, so a log shows progress too.
    """

    def __init__(self, label: str, total: int, enabled: bool, *, unit: str = ""):
        self.label, self.unit, self.bar = label, unit, None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn(f"[bold]{label}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True))
            self.task = self.bar.add_task("", total=total)
            self.live = self.bar.console.is_terminal
            self.bar.start()

    def _log(self, text: str) -> None:
        t = self.bar.tasks[0]
        unit = f" {self.unit}" if self.unit else ""
        self.bar.console.print(f"{self.label}: {text} [{int(t.completed)}/{int(t.total)}{unit}, {t.elapsed or 0:.0f} s]",
                               highlight=False)

    def describe(self, text: str, *, log: bool = True) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)
            if log and not self.live:
                self._log(text)

    def advance(self, n: int = 1, note: str | None = None) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)
            if note and not self.live:
                self._log(note)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
