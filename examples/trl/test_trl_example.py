"""examples/trl: the script trains with TRL's SFTTrainer (2 steps, CPU), and SFTTrainer's loss on the
collator's windows is transformers' causal-LM loss: it counts exactly the predictions the labels mark."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trl_anchor import build

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("bf16", [False, True])
def test_script_trains(tmp_path, bf16):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(HERE / "trl_anchor.py"), "--out", str(tmp_path), "--steps", "2",
                           *(["--bf16"] if bf16 else [])], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"trained 2 steps, anchor via anchor_varlen: loss (\S+)", done.stdout)
    assert found, done.stdout[-2000:]
    assert abs(float(found[1]) - math.log(331)) < 0.5  # a random model: about ln(vocabulary)


def test_sft_loss_is_the_causal_lm_loss(tmp_path):
    trainer = build(str(tmp_path), variant="anchor")
    batch = next(iter(trainer.get_train_dataloader()))
    assert {"doc_ids", "position_ids", "labels", "variant"} <= set(batch)
    count = (batch["labels"][:, 1:] != -100).sum()
    trainer.model.train()
    sft = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=count)
    plain = trainer.model(**batch, num_items_in_batch=count).loss
    assert abs(float(sft - plain)) <= 1e-6 * float(plain)  # measured: equal
