"""MFU per step (torchtrain.training.throughput): every step of a run logs its model FLOPs, FLOP/s and MFU, and the FLOPs are
anchor bench's FLOP model (anchor_core.flops) over the very windows of that step's global batch: the ranks' shares
summed (an SP group's ranks share their windows), equal to the whole batch's count exactly (integer pairs and
tokens, sums of exact float64 products)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.train.conftest import TINY, metrics, run_train

STEPS = 3
COMMON = (f"schedule.steps={STEPS}", "data.global_batch=4", "data.micro_batch=1", "eval.window=0",
          "checkpoint.save_every=0", "logging.report_to=[]")


def _expected(packed, overrides) -> list[float]:
    from anchor_core.data.packed import Loader, PackedData
    from anchor_core.flops import pairs, step_flops
    from torchtrain.config import load_train_config
    from torchtrain.training.fit import model_spec
    cfg = load_train_config(TINY, [*overrides, f"data.path={packed}"])
    data = PackedData.open(packed)
    loader = Loader(data, batch_size=cfg.data.global_batch, variant=cfg.model.variant, seed=cfg.data.seed)
    spec, out = model_spec(cfg), []
    for _ in range(STEPS):
        doc = data.batch(np.asarray(loader.indices()), cfg.model.variant).doc_ids
        out.append(step_flops(spec, int(pairs(doc, cfg.model.variant).sum()), doc.size)["total"])
        next(loader)
    return out


# make test: one process; two processes (their shares summed) and an SP group in make test-all
@pytest.mark.parametrize("nproc,sp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow),
                                      pytest.param(2, 2, marks=pytest.mark.slow)])
def test_every_step_logs_its_flops_and_mfu(packed, tmp_path, nproc, sp):
    overrides = (*COMMON, f"parallel.nproc={nproc}", f"parallel.sequence_parallel={sp}")
    done = run_train(tmp_path / "run", *overrides, f"data.path={packed}")
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["flops"] for r in rows] == _expected(packed, overrides)
    for r in rows:
        assert 0 < r["mfu"] < 1 and r["flops_per_s"] > 0
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / (rows[0]["peak_flops_per_s"] * nproc), rel=1e-12)
    assert f"mfu: model FLOPs per second over {nproc} x the peak of one process's device" in done.stderr
    assert "measured here: a 512^3 float32 matmul" in done.stderr
