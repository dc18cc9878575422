# The names docs/guides/hf-trainer.md's fragments use and leave to the reader: `path` (a model folder: a tiny
# random Llama with its tokenizer, in place of the reader's model), `tokenizer`, `tokenized_docs` (documents
# tokenized by it), `features` (the same as a collator's input), `model` (loaded from `path`, without a KV cache
# as a training loop runs it) and `train_loader` (batches of `features` flattened by transformers' collator), and
# the transformers classes the fragments call.
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, Trainer,
                          TrainingArguments)

path = "tiny-hf"
if not Path(path).exists():
    from anchor_core.export import export_hf
    from anchor_core.spec import random_preset
    from anchor_core.weights import random_state

    _spec = random_preset("llama")
    export_hf(_spec, random_state(_spec, seed=0), path, tokenizer_of="random:llama")
tokenizer = AutoTokenizer.from_pretrained(path)
tokenized_docs = [tokenizer(text) for text in ["The first document.", "A second, longer one.", "And a third."] * 2]
features = [{"input_ids": d["input_ids"]} for d in tokenized_docs[:4]]
model = AutoModelForCausalLM.from_pretrained(path)
model.config.use_cache = False
train_loader = torch.utils.data.DataLoader(features, batch_size=4,
                                           collate_fn=DataCollatorWithFlattening(return_tensors="pt"))
# ---- the block
