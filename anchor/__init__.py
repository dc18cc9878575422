"""anchor: precision-aware long-context training (AnchorAttention).

Framework-free pieces shared by the oracle (`jaxref`) and the trainer (`torchtrain`):
errors, model specs and the translation to Hugging Face configs, weight readers,
the data pipeline, and the `anchor` command line.
"""

__version__ = "0.1.0"

from anchor import machine as _machine  # noqa: E402,F401  (stdlib only: records the load at start)
