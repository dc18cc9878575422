"""run_eval(group_by_budget=True): the tasks that share a length and an answer budget generate in the same
batches; on a tiny model in float32 the answers, scores and per-sample scores are those of one call per task,
and every row carries its standard error over samples."""

from __future__ import annotations

import torch

from anchor.eval.runner import run_eval

torch.set_num_threads(1)  # shared cores


def test_grouped_generation_gives_the_same_answers():
    kw = dict(tasks=["niah_single_1", "niah_multikey_1"], lengths=[768], samples=3, seed=0, dtype="float32",
              engine="varlen", perplexity_windows=0)
    apart = run_eval([("m", "random:llama")], batch_size=3, **kw)
    together = run_eval([("m", "random:llama")], batch_size=6, group_by_budget=True, **kw)
    assert together["settings"]["group_by_budget"] and not apart["settings"]["group_by_budget"]
    assert [s["prediction"] for s in together["samples"]] == [s["prediction"] for s in apart["samples"]]
    assert together["rows"] == apart["rows"]
    for r in together["rows"]:
        assert len(r["sample_scores"]) == 3 and r["se"] is not None
        assert abs(sum(r["sample_scores"]) / 3 - r["score"]) < 0.01
