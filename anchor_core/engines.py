"""The closed set of attention engines, named in one place (docs/DESIGN.md §8).

The engines themselves are torch code (`torchtrain.attention.engines`); this torch-free module holds only their
names, so the train config's schema (`torchtrain.config`), the trainer and the parity suite's
emulation table (`parity_tests.emulations`) spell them from one list.

  ENGINES  what a model runs: eager, sdpa, flex, flash_varlen, flash_varlen_emulated, varlen
  AUTO     not an engine: a train config's name for the linear-memory one of its device
           (`torchtrain.attention.engines.resolve_engine`)
"""

from __future__ import annotations

from typing import Literal, get_args

Engine = Literal["eager", "sdpa", "flex", "flash_varlen", "flash_varlen_emulated", "varlen"]
ENGINES: tuple[str, ...] = get_args(Engine)
AUTO = "auto"
TRAIN_ENGINES: tuple[str, ...] = (AUTO, *ENGINES)  # what a train config's `model.engine:` accepts
