"""torchtrain: the production PyTorch trainer on stock Hugging Face transformers models.

Public API (docs/DESIGN.md §7):

    model = torchtrain.build_model(name, engine="sdpa", dtype="float32", rope=None)
    out = model(input_ids=..., position_ids=..., doc_ids=..., variant="anchor")   # .logits [B, T, V]
    loss, count = torchtrain.next_token_loss(out.logits, tokens, loss_mask)
    with torchtrain.capture_taps(model, rows=[...]) as taps: model(...)        # {name: [per layer]}

Sequence parallelism and training:

    torchtrain.enable_sequence_parallel(model, group)        # Ulysses; then per rank: shard(x, rank, P)
    from torchtrain.training.trainer import train; from torchtrain.config import load_train_config

Parts (each folder's docstring says what it owns and what it may import; a part imports only parts of a lower
layer):

    layer 1  config      the `anchor train` schema: keys, defaults, overrides, validation
             attention   masks, varlen segments, the kernels and the engine registry
    layer 2  model       building a transformers model with an engine; the loss, taps and the tiled MLP
             hf          transformers' Trainer and TRL: the packing collator, the anchor_* functions, SP
    layer 3  parallel    processes and groups, Ulysses, the ZeRO-3 build
    layer 4  training    the run folder, the plan, checkpoints, metrics, trackers, the loop

The modules' old flat paths (`torchtrain.trainer`, `torchtrain.engines`, ...) and old names
(`torchtrain.training.stages`, now `torchtrain.training.phases`) import the moved modules with a DeprecationWarning
for one release (MOVED).
"""

import importlib.abc
import importlib.util
import sys
import warnings

from torchtrain.attention.engines import ENGINES, Engine, available_engines, check_engine
from torchtrain.attention.variants import VARIANTS, Variant, dense_mask, mask_predicate
from torchtrain.model import build_model, model_from_weights, set_engine
from torchtrain.model.loss import next_token_loss
from torchtrain.model.taps import TAP_NAMES, capture_taps
from torchtrain.parallel.ulysses import check_sequence_parallel, enable_sequence_parallel, shard

__all__ = [
    "ENGINES", "Engine", "TAP_NAMES", "VARIANTS", "Variant", "available_engines", "build_model", "capture_taps",
    "check_engine", "check_sequence_parallel", "dense_mask", "enable_sequence_parallel", "mask_predicate", "model_from_weights", "next_token_loss", "set_engine", "shard",
]


# The flat module paths of earlier releases: importing one gives the moved module (the same object) and warns.
MOVED = {
    "torchtrain.engines": "torchtrain.attention.engines",
    "torchtrain.variants": "torchtrain.attention.variants",
    "torchtrain.varlen": "torchtrain.attention.varlen",
    "torchtrain.varlen_sdpa": "torchtrain.attention.varlen_sdpa",
    "torchtrain.varlen_emulation": "torchtrain.attention.varlen_emulation",
    "torchtrain.loss": "torchtrain.model.loss",
    "torchtrain.taps": "torchtrain.model.taps",
    "torchtrain.tiling": "torchtrain.model.tiling",
    "torchtrain.hf_ulysses": "torchtrain.hf.trainer_sp",
    "torchtrain.distributed": "torchtrain.parallel.distributed",
    "torchtrain.sequence_parallel": "torchtrain.parallel.ulysses",
    "torchtrain.sharded_build": "torchtrain.parallel.sharded_build",
    **{f"torchtrain.{name}": f"torchtrain.training.{name}" for name in (
        "checkpoint", "heldout", "memory", "metrics", "optim", "run_folder", "throughput", "trackers", "trainer",
        "universal")},
    # the length schedule's module of earlier releases (its old names: torchtrain.training.phases.OLD_NAMES)
    "torchtrain.stages": "torchtrain.training.phases",
    "torchtrain.training.stages": "torchtrain.training.phases",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of MOVED; its module is the new path's module, imported (and named in sys.modules under
    both paths), with a DeprecationWarning naming the new path."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass  # the moved module ran when it was imported


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
