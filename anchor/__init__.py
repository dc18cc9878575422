"""anchor: precision-aware long-context training (AnchorAttention), the application (the top floor,
docs/DESIGN.md §Architecture).

    import anchor
    report = anchor.run_hf_stack(my_model, attention=my_attention_fn)   # your transformers stack under the oracle
    result = anchor.run_audit("random:llama", quick=True)                # does RoPE stay relative in bf16?
    cfg = anchor.load_train_config("configs/train/tiny.yaml", ["optim.lr=1e-5"])
    anchor.train(cfg, "runs/tiny")

The `anchor` command line (`cli`, one module per verb in `commands`), `python -m anchor`, the demo,
evaluation (perplexity, RULER, lm-eval's harness), the benchmark and the pytest plugin. It stands on
everything below it: the shared core (`anchor_core`), the oracle (`jaxref`), the trainer (`torchtrain`)
and what compares them (`parity_tests`); nothing below imports it.

The names below are loaded on first use (PEP 562), so `import anchor` and `anchor --help` import no JAX
or torch. `import anchor` also registers the attention functions (`anchor_sdpa`, `anchor_varlen`, ...:
torchtrain.hf) in transformers' AttentionInterface, once transformers' models are imported
(anchor.registration), so `attn_implementation="anchor_varlen"` works after it.

    import anchor
    model = AutoModelForCausalLM.from_config(config, attn_implementation="anchor_varlen")
    collator = anchor.PackingCollator("anchor", seq_len=4096, tokenizer=tok)
    report = anchor.check_step(model, collator(features))               # which variant the step computes
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from anchor import registration
from anchor_core import __version__  # noqa: F401
from anchor_core import extras

# name: (module, attribute); what a user of the toolkit reaches from `import anchor`
API: dict[str, tuple[str, str]] = {
    "load_model": ("jaxref", "load_model"),                        # the oracle's model: params, spec
    "forward": ("jaxref", "forward"),                              # the oracle's forward under a dtype policy
    "run_audit": ("parity_tests.audit", "run_audit"),              # the precision audit (paper §2)
    "write_audit": ("parity_tests.audit", "write_audit"),
    "audit_torch_stack": ("parity_tests.audit.torch_stack", "audit_torch_stack"),
    "run_parity": ("parity_tests.suite", "run_parity"),            # the trainer held against the oracle
    "run_hf_stack": ("parity_tests.hf_stack", "run_hf_stack"),     # stock transformers / your attention
    "load_train_config": ("torchtrain.config", "load_train_config"),
    "train": ("torchtrain.training.trainer", "train"),                      # `anchor train` as a function
    "build_model": ("torchtrain", "build_model"),                  # a stock transformers LM with our engines
    "PackingCollator": ("torchtrain.hf", "PackingCollator"),       # AnchorAttention in HF Trainer / TRL
    "check_step": ("parity_tests.blackbox", "check_step"),         # which variant your step computes
}

__all__ = ["__version__", *API]

registration.install()


def __getattr__(name: str) -> Any:
    if name not in API:
        raise AttributeError(f"module 'anchor' has no attribute {name!r}")
    module, attribute = API[name]
    try:
        loaded = import_module(module)
    except ModuleNotFoundError as e:  # a module of an extra not installed here: name the extra
        line = extras.missing_extra(e, f"anchor.{name}")
        if line is None:
            raise
        raise ModuleNotFoundError(line, name=e.name) from e
    value = getattr(loaded, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *API])
