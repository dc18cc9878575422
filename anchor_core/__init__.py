"""anchor_core: the shared core of the toolkit, the ground floor (docs/DESIGN.md §Architecture).

Framework-free pieces used by every floor above: errors, model specs and the translation to Hugging Face
configs, weight readers, the tokenizer, the data pipeline, output and run folders. It imports nothing of
the project above it; the application (`import anchor`, the `anchor` command) is the top floor.
"""

__version__ = "0.1.0"

from anchor_core import machine as _machine  # noqa: E402,F401  (stdlib only: records the load at start)
