"""anchor: precision-aware long-context training (AnchorAttention).

The shared core, the ground floor (docs/DESIGN.md §Architecture): framework-free pieces used by the
oracle (`jaxref`) and the trainer (`torchtrain`): errors, model specs and the translation to Hugging Face
configs, weight readers, the tokenizer, the data pipeline, the run folder. It imports nothing of the
project above it; the `anchor` command line lives on the top floor (`anchor_app`).
"""

__version__ = "0.1.0"

from anchor import machine as _machine  # noqa: E402,F401  (stdlib only: records the load at start)
