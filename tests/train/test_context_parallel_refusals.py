"""What parallel.context_parallel refuses, each in one line naming the keys, exit 2, before any work (no run
folder made, nothing packed): a degree that does not split the window into equal shares (naming degrees that
do), a Ulysses degree that does not split a share (naming one that does), a process count the window's ranks do
not divide; and a model fed a share of a window split by something else (accelerate's context parallelism, which
drops the document and anchor masks) is refused rather than attending within the share."""

from __future__ import annotations

import pytest
import torch

from anchor_core.errors import InputError
from tests.train.test_hostile_keys import _refused_fresh

REFUSED = {
    "window": (["parallel.nproc=4", "parallel.context_parallel=4", "data.seq_len=130"],
               "parallel.context_parallel 4 does not split seq_len 130 into equal shares (use 2 or 5)"),
    "share": (["parallel.nproc=6", "parallel.context_parallel=2", "parallel.sequence_parallel=3"],
              "parallel.sequence_parallel 3 does not divide the 64 slots of a context-parallel share (data.seq_len 128 / "
              "parallel.context_parallel 2); parallel.sequence_parallel 2 fits"),
    "processes": (["parallel.nproc=3", "parallel.context_parallel=2"], "3 processes do not split into groups of 2"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_context_parallel_run_that_cannot_split_is_refused_before_any_work(tmp_path, capsys, case):
    overrides, needle = REFUSED[case]
    line = _refused_fresh(tmp_path, capsys, *overrides, needle=needle)
    print(line)
    assert "context_parallel" in line


def test_a_share_of_a_window_split_elsewhere_is_refused():
    from torchtrain import build_model

    model = build_model("random:llama", engine="sdpa", dtype="float32")
    ids = torch.arange(1, 65)[None]
    doc_ids = torch.ones(1, 128, dtype=torch.long)
    with pytest.raises(InputError, match="split by something other than torchtrain"):
        model(input_ids=ids, position_ids=torch.arange(64)[None], doc_ids=doc_ids, variant="intra_doc")
