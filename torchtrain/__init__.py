"""torchtrain: the production PyTorch trainer on stock Hugging Face transformers models.

Public API (docs/DESIGN.md §7):

    model = torchtrain.build_model(name, engine="sdpa", dtype="float32", rope=None)
    out = model(input_ids=..., position_ids=..., doc_ids=..., variant="anchor")   # .logits [B, T, V]
    loss, count = torchtrain.next_token_loss(out.logits, tokens, loss_mask)
    with torchtrain.capture_taps(model, rows=[...]) as taps: model(...)        # {name: [per layer]}

Sequence parallelism and training:

    torchtrain.enable_sequence_parallel(model, group)        # Ulysses; then per rank: shard(x, rank, P)
    from torchtrain.trainer import train; from torchtrain.config import load_train_config

Modules: variants (the mask predicate of docs/DESIGN.md §2), varlen (segments for flash_attn_varlen_func),
varlen_emulation (a pure-torch flash_attn_varlen_func), attention (each engine's math),
engines (selection, availability, per-step metadata, transformers registration), model
(build_model), taps, loss, sequence_parallel (Ulysses), config (the `anchor train` schema),
distributed (processes and groups), run_folder (preparing and checking RUN/), optim (LR schedule,
parameter groups, DeepSpeed config), metrics (metrics.jsonl, gradient norms and dumps), checkpoint
(what a checkpoint holds: saving, resuming, RNG state, manifests), trainer (the launch and the loop).
"""

from torchtrain.engines import ENGINES, Engine, available_engines, check_engine
from torchtrain.loss import next_token_loss
from torchtrain.model import build_model, model_from_weights, set_engine
from torchtrain.sequence_parallel import check_sequence_parallel, enable_sequence_parallel, shard
from torchtrain.taps import TAP_NAMES, capture_taps
from torchtrain.variants import VARIANTS, Variant, dense_mask, mask_predicate

__all__ = [
    "ENGINES", "Engine", "TAP_NAMES", "VARIANTS", "Variant", "available_engines", "build_model", "capture_taps",
    "check_engine", "check_sequence_parallel", "dense_mask", "enable_sequence_parallel", "mask_predicate", "model_from_weights", "next_token_loss", "set_engine", "shard",
]
