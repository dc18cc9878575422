"""examples/hf_trainer: the script trains (2 steps, CPU), and the Trainer's batches are the collator's windows
with doc_ids and variant: its remove_unused_columns drops the dataset's other columns, not those."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_trainer_anchor import build

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("bf16", [False, True])
def test_script_trains(tmp_path, bf16):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(HERE / "hf_trainer_anchor.py"), "--out", str(tmp_path), "--steps", "2",
                           *(["--bf16"] if bf16 else [])], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"trained 2 steps, anchor via anchor_varlen: loss (\S+)", done.stdout)
    assert found, done.stdout[-2000:]
    assert abs(float(found[1]) - math.log(331)) < 0.5  # a random model: about ln(vocabulary)


def test_batches_carry_the_variant(tmp_path):
    trainer = build(str(tmp_path), variant="anchor")
    batch = next(iter(trainer.get_train_dataloader()))
    assert set(batch) == {"input_ids", "position_ids", "doc_ids", "labels", "variant"}
    assert bool((batch["doc_ids"][:, 0] == 0).all()) and bool((batch["labels"][:, 1] == -100).all())
    loss = trainer.model(**batch).loss
    batch["variant"] = torch.zeros_like(batch["variant"])  # the same windows read as `full`: another attention
    doc = batch["doc_ids"].clone()
    doc[:, 0] = 1
    assert abs(float(trainer.model(**{**batch, "doc_ids": doc}).loss - loss)) > 1e-4
