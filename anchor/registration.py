"""`import anchor` puts the attention functions (anchor_sdpa, anchor_varlen, ...: torchtrain.hf) in transformers'
AttentionInterface, without importing torch or transformers itself.

Registering needs transformers' modeling code (and torch), which `import anchor` must not load: the `anchor`
command starts in a third of a second and most verbs never touch transformers. So the registration waits for
the module that holds AttentionInterface, `transformers.modeling_utils`:

  - already imported (the user imported transformers' models first): register now;
  - else a finder on `sys.meta_path` wraps that one module's loader and registers right after it has run,
    before `from_config(..., attn_implementation="anchor_varlen")` or `from_pretrained` can look the name up.

The finder answers for no other module and removes itself once it has fired.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from importlib import import_module
from typing import Any

TARGET = "transformers.modeling_utils"


def register_now() -> tuple[str, ...]:
    """Register the attention functions (idempotent); returns their names."""
    return import_module("torchtrain.hf").register()  # torch and transformers: loaded once transformers' models are


class _Loader(importlib.abc.Loader):
    """The real loader of TARGET, then the registration."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        try:
            register_now()
        except ImportError as e:  # transformers' own import goes on; only the names are missing
            warnings.warn(f"anchor: the attention functions (anchor_sdpa, anchor_varlen, ...) are not registered in "
                          f"transformers: {e}", stacklevel=2)


class _AfterTransformersModels(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # fires once; the lookup below must not find this finder again
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Register now where transformers' models are loaded, else when they are (module docstring)."""
    if TARGET in sys.modules:
        register_now()
    elif not any(isinstance(f, _AfterTransformersModels) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformersModels())
