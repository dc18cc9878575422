"""The held-out loss during training (torchtrain.training.heldout): the held-out windows are never in a training batch, and
every eval.every steps the run logs their loss, overall and by slot range, equal to the loss the exported
weights of that step give on those windows through transformers (full logits, anchor_sdpa) within the fp32 rule
(1e-6; measured: within 1e-7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.train.conftest import heldout_reference, metrics, run_train

HELD, BUCKETS = 5, 4
COMMON = ("data.global_batch=4", "data.micro_batch=2", "eval.every=2", "eval.window=0", f"eval.heldout_buckets={BUCKETS}",
          "checkpoint.save_every=2", "checkpoint.keep_last=0", "logging.report_to=[]")
RUN = (*COMMON, "schedule.steps=4", f"eval.heldout_windows={HELD}")


def test_the_loader_never_yields_a_heldout_window(packed):
    from anchor_core.data.packed import Loader, PackedData, heldout_windows

    data = PackedData.open(packed)
    held = set(heldout_windows(data.num_windows, HELD, 0).tolist())
    assert len(held) == HELD
    trained = set(range(data.num_windows)) - held
    for world in (1, 2):
        loaders = [Loader(data, 2, "anchor", seed=0, rank=r, world_size=world, held_out=HELD) for r in range(world)]
        per_epoch = loaders[0].steps_per_epoch
        assert per_epoch == (data.num_windows - HELD) // (2 * world)
        for _ in range(3):  # three epochs: distinct windows within one, none held out
            seen: list[int] = []
            for _ in range(per_epoch):
                for loader in loaders:
                    seen += loader.indices().tolist()
                    next(loader)
            assert len(seen) == len(set(seen)) == per_epoch * 2 * world and set(seen) <= trained
    plain = Loader(data, 2, "anchor", seed=0)
    assert plain.indices().tolist() == Loader(data, 2, "anchor", seed=0, held_out=0).indices().tolist()


def test_the_heldout_loss_is_logged_every_eval_every_steps(packed, tmp_path):
    run = tmp_path / "run"
    run_train(run, *RUN, f"data.path={packed}")
    rows = metrics(run)
    assert [("heldout_loss" in r) for r in rows] == [False, True, False, True]
    T = 128
    edges = np.linspace(0, T, BUCKETS + 1).round().astype(np.int64)
    for r in rows[1::2]:
        loss, by, tokens = heldout_reference(run / "checkpoints" / f"step-{r['step']}" / "hf", packed, HELD, edges)
        print(f"step {r['step']}: logged {r['heldout_loss']:.8f}, transformers {loss:.8f}; by position {r['heldout_loss_by_position']}")
        assert r["heldout_tokens"] == tokens
        assert abs(r["heldout_loss"] - loss) <= 1e-6 * loss
        np.testing.assert_allclose(r["heldout_loss_by_position"], by, rtol=1e-6)
        assert r["heldout_s"] > 0
    assert rows[1]["heldout_loss"] != rows[3]["heldout_loss"]


def test_heldout_settings_are_refused_in_one_line_before_training(packed, tmp_path):
    from anchor_core.data.packed import PackedData
    from anchor_core.errors import InputError
    from tests.train.conftest import TINY
    from torchtrain.config import load_train_config
    from torchtrain.training.trainer import train

    n = PackedData.open(packed).num_windows
    for override, words in [(f"eval.heldout_windows={n - 3}", f"3 windows left once eval.heldout_windows={n - 3} are "
                                                               "held out are fewer than one global batch of 4"),
                            (f"eval.heldout_data={tmp_path}", "is not an `anchor pack` output folder")]:
        cfg = load_train_config(TINY, [*COMMON, "schedule.steps=4", f"data.path={packed}", override])
        with pytest.raises(InputError, match=words):
            train(cfg, tmp_path / "run", progress=False)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_heldout_data_from_another_folder(packed, tmp_path):
    """eval.heldout_data: the first eval.heldout_windows windows of another pack folder (here the same corpus,
    packed again), none held out of the training data."""
    from anchor_core.data.packed import PackedData
    from torchtrain.parallel.ulysses import counted_predictions

    run = tmp_path / "run"
    run_train(run, *COMMON, "schedule.steps=2", f"data.path={packed}", f"eval.heldout_data={packed}",
              "eval.heldout_windows=3")
    row = metrics(run)[1]
    mask = PackedData.open(packed).batch(np.arange(3), "anchor").loss_mask
    assert row["heldout_tokens"] == int(counted_predictions(torch.as_tensor(mask)).sum())
