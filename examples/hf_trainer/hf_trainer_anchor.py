"""AnchorAttention in transformers' Trainer: a tiny random Llama trained on packed documents (CPU, seconds).

    python examples/hf_trainer/hf_trainer_anchor.py --out runs/hf_trainer_example [--variant anchor] [--attention anchor_varlen] [--bf16]
"""

import argparse

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

import anchor  # registers anchor_varlen, anchor_sdpa, ... in transformers
import torchtrain.hf as anchor_hf

VARIANTS = ["full", "intra_doc", "intra_doc_reset", "anchor"]


def build(out: str, steps: int = 3, variant: str = "anchor", attention: str = "anchor_varlen", bf16: bool = False) -> Trainer:
    config = LlamaConfig(vocab_size=331, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    rng = np.random.default_rng(0)  # a tokenized dataset: one row of input_ids per document
    docs = Dataset.from_dict({"input_ids": [rng.integers(3, 331, n).tolist() for n in rng.integers(5, 150, 64)],
                              "text": ["dropped by the Trainer: the model's forward does not name it"] * 64})
    collator = anchor.PackingCollator(variant, seq_len=127, first_token_id=1, eos_token_id=2)  # BOS, EOS
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
                             adam_beta2=0.95, weight_decay=0.1, logging_steps=1, save_strategy="no", report_to="none",
                             bf16=bf16, use_cpu=not torch.cuda.is_available())
    return Trainer(model=model, args=args, data_collator=collator, train_dataset=docs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--variant", default="anchor", choices=VARIANTS)
    p.add_argument("--attention", default="anchor_varlen", choices=sorted(anchor_hf.FUNCTIONS))
    p.add_argument("--bf16", action="store_true", help="bf16 autocast, as on a GPU (fp32 weights and optimizer)")
    a = p.parse_args(argv)
    result = build(a.out, a.steps, a.variant, a.attention, a.bf16).train()
    print(f"trained {result.global_step} steps, {a.variant} via {a.attention}: loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
