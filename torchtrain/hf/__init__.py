"""The Hugging Face part: AnchorAttention inside transformers' Trainer and TRL's SFTTrainer.

Owns the packing collator and the `anchor_*` attention functions (`integration`, whose names this package
exports: `torchtrain.hf.PackingCollator`, `torchtrain.hf.ulysses`, ...) and sequence parallelism inside the
Trainer (`trainer_sp`: DeepSpeed's Ulysses adapter, its checks and the gradients it shares).

May import: the attention part, anchor_core, torch, transformers, accelerate, DeepSpeed.
"""

from torchtrain.hf.integration import *  # noqa: F403  (the names of integration.__all__)
from torchtrain.hf.integration import __all__  # noqa: F401
