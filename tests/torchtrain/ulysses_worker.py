"""One process of transformers' Trainer with PackingCollator("anchor") and anchor_varlen, under DeepSpeed's
Ulysses when launched by torchrun with SP > 1 (torchtrain.hf.ulysses), else alone. Used by test_hf_ulysses.py.

    python ulysses_worker.py SP OUT_JSON [PLANT]

The TrainingArguments are the guide's (docs/guides/hf-trainer.md) on a CPU: use_cpu=True, DeepSpeed ZeRO-2 with
"auto" keys. Trainer's defaults (AdamW, max_grad_norm 1.0) at the paper's lr 2e-5 and weight decay 0.1. Writes
{"losses": [the loss of each step as the Trainer computes it], "grad_norms": [as the Trainer logs them]}
from rank 0. PLANT:
  first_slice    rank 1's slice of doc_ids is rank 0's (the collator's doc_ids changed before Ulysses' loader
                 cuts the batch)
  swapped        the two slices of doc_ids in the other order
  moved_boundary a document boundary inside rank 1's slice of doc_ids one slot later (labels unchanged)
  unshared       no UlyssesGradients callback, the check that asks for it satisfied by hand
  no_callback    no UlyssesGradients callback
  batch2         per_device_train_batch_size 2 (with SP 1 too)
  no_use_cpu     without use_cpu=True (accelerate on a CPU then counts one process on every rank)
  duplicated     every rank fed the same batches: a train data loader not sharded by accelerate
  heads3         a model with 3 attention heads (and 3 key/value heads), which sp_size 2 does not divide
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

import torchtrain.hf as hf
from torchtrain.hf import trainer_sp as hf_ulysses

T = 98  # even for sp_size 2; documents of odd lengths
STEPS = 3
VARIANT = "anchor"


def windows() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    docs = [{"input_ids": rng.integers(3, 250, size=int(n)).tolist()} for n in rng.integers(5, 61, size=40)]
    tok, seg, tag = hf.PackingCollator(VARIANT, T, first_token_id=1, eos_token_id=2).windows(docs)
    return [{"input_ids": tok[i], "seg": seg[i], "tag": tag[i]} for i in range(len(tok))]


class InOrder(torch.utils.data.IterableDataset):  # Trainer shuffles map-style datasets
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


class Planted(hf.PackingCollator):
    def __init__(self, plant: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plant = plant

    def __call__(self, features):
        out = super().__call__(features)
        doc, half = out["doc_ids"], T // 2
        if self.plant == "first_slice":
            doc[:, half:] = doc[:, :half].clone()
        elif self.plant == "swapped":
            out["doc_ids"] = torch.cat([doc[:, half:], doc[:, :half]], dim=1)
        elif self.plant == "moved_boundary":
            row = doc[0]
            t = next(t for t in range(half + 1, T) if row[t] != row[t - 1] and row[t] > 0)
            row[t] = row[t - 1]
        return out


class GradNorms(TrainerCallback):
    def __init__(self):
        self.norms: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm" in logs:
            self.norms.append(float(logs["grad_norm"]))


class LossTrainer(Trainer):
    losses: list[float] = []
    duplicated = False

    def get_train_dataloader(self):
        if not self.duplicated:
            return super().get_train_dataloader()
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size,
                                           collate_fn=self.data_collator)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append(float((loss[0] if return_outputs else loss).item()))
        return loss


def main(sp: int, out: str, plant: str = "") -> None:
    extra = {}
    if sp > 1:
        extra = {"parallelism_config": hf.ulysses(sp, T, "anchor_varlen"),
                 "deepspeed": {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                               "train_batch_size": "auto", "gradient_clipping": "auto",
                               "zero_optimization": {"stage": 2}}}
    torch.manual_seed(0)
    heads = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3} if plant == "heads3" else \
        {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = LlamaConfig(vocab_size=256, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=4 * T,
                         **heads)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="anchor_varlen", dtype=torch.float32)
    args = TrainingArguments(output_dir=os.path.join(os.path.dirname(out), f"trainer-sp{sp}{plant}"),
                             per_device_train_batch_size=2 if plant == "batch2" else 1,
                             max_steps=STEPS, learning_rate=2e-5, weight_decay=0.1, lr_scheduler_type="constant",
                             report_to="none", save_strategy="no", logging_steps=1,
                             use_cpu=plant != "no_use_cpu", dataloader_num_workers=0, remove_unused_columns=False,
                             seed=0, disable_tqdm=True, **extra)
    collator = (Planted(plant, VARIANT, T, windows=True, sp_size=sp)
                if plant in ("first_slice", "swapped", "moved_boundary")
                else hf.PackingCollator(VARIANT, T, windows=True, sp_size=sp))
    norms = GradNorms()
    callbacks = [norms] + ([hf.UlyssesGradients()] if sp > 1 and plant not in ("unshared", "no_callback") else [])
    if plant == "unshared":
        hf_ulysses._SHARED.add(-1)  # as if another model were shared: this one trains with sp_size x gradients
    LossTrainer.duplicated = plant == "duplicated"
    trainer = LossTrainer(model=model, args=args, train_dataset=InOrder(windows()), data_collator=collator,
                          callbacks=callbacks)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump({"losses": trainer.losses, "grad_norms": norms.norms}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])
