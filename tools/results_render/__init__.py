"""The results pages, rendered from the raw samples of the JSON records they cite, so prose cannot drift from them.

    python tools/results_pages.py            # write docs/results/*.md and README.md's results table
    python tools/results_pages.py --check    # exit 1 naming every stale page and every unlabelled duration

Every statistic on a page is computed here from a record's raw samples (per-step times, per-window times,
per-checkpoint scores, per-tap and per-parameter verdicts), with the warm-up left out as the record states
it: mean, median and range side by side, each ratio named by what it divides and given by mean and by
median. A summary a record also stores (a median, a ratio, a pass flag, a finding's verdict) is checked
against the samples it summarises; where the two disagree the render stops with one line naming the
record and the field (`Refused`). A figure whose samples a record does not keep is not shown, and the page
says so.

Every table names the record it is read from, with the machine, the date and the commit recorded in it
(`anchor_core.machine.machine()` writes `date_utc` and `commit` with every result; records older than that
carry a `record` entry with the date and commit of the change that added them). `tests/test_results_pages.py`
fails when a page is stale; `unlabelled_durations` finds a duration in prose that neither comes from a
record nor is labelled an estimate or a limit.

The pages are plain Markdown (the MkDocs site shows them under Results); README.md's table sits between
two marker lines and is replaced in place.

One module per page (precision, speed, memory, gpu, evaluation, index with README.md's table) over
`stats` (the statistics and how numbers are written) and `records` (where each record lives and the checks
its stored summaries are held to); `prose` checks the hand-written pages, `render` writes or checks them all.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the project's own tables: the default model's name, each engine's emulation
