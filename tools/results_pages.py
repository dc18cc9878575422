"""The results pages, rendered from the records they cite (the code is the package tools/results_render/).

    python tools/results_pages.py            # write docs/results/*.md and README.md's results table
    python tools/results_pages.py --check    # exit 1 naming every stale page and every unlabelled duration

This file is the entry point and the one name the tests load: it re-exports the package's public names.

A page quotes a record's commit as a hash of the repository's history (`quoted_commit`): a run from a working tree
with uncommitted changes (`+dirty` in the record) is said so in words beside the hash, and a commit filled in later
from git history is marked "(from git)". README.md's table holds current claims only (`current_parity`: a GPU
parity report that did not finish, or was judged under another rule or emulation, stays on docs/results/gpu.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: the package beside this file

from results_render import ROOT  # noqa: E402,F401
from results_render.evaluation import evaluation_page, hf_rows, ruler_scores  # noqa: E402,F401
from results_render.gpu import current_rule, gpu_page, not_todays, parity_counts, parity_verdicts  # noqa: E402,F401
from results_render.index import all_records, index_page  # noqa: E402,F401
from results_render.readme import attention_rows, current_parity, readme_table, step_rows  # noqa: E402,F401
from results_render.memory import memory_page  # noqa: E402,F401
from results_render.precision import audit_findings, precision_page, shift_curves  # noqa: E402,F401
from results_render.prose import DURATION, LABELLED, prose, unlabelled_durations  # noqa: E402,F401
from results_render.records import *  # noqa: E402,F401,F403
from results_render.render import PAGES, cited, main, render_all, render_readme, stale, write_all  # noqa: E402,F401
from results_render.speed import bench_attention, bench_steps, speed_page, train_gpu_ratios, train_gpu_rows  # noqa: E402,F401
from results_render.stats import *  # noqa: E402,F401,F403

if __name__ == "__main__":
    sys.exit(main())
