"""The model under test (`Subject`): a model named as in docs/DESIGN.md §6 (`named_subject`) or a user's
transformers causal LM (`module_subject`), its parity inputs (`subject_inputs`), and its torch model in a
dtype (`subject_model`: the family's stock class, `stock_model`, or a copy of the user's module).
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import jaxref
from anchor_core.errors import InputError
from anchor_core.spec import ModelSpec, from_hf_config, to_hf_config
from anchor_core.weights import load_weights
from parity_tests.cases import Case, CaseInputs, case_inputs
from parity_tests.runners import oracle_model


_SUBJECTS = itertools.count()


@dataclass(eq=False)
class Subject:
    """The model under test: its spec and float32 weights (Hugging Face names), the model whose parity
    inputs it is fed (`data`: its tokenizer and documents), and a user's module (run as built) or None
    (the stock class built from the weights)."""

    name: str
    spec: ModelSpec
    state: dict[str, np.ndarray]
    data: str
    module: Any = None
    # what the oracle's cache is keyed by: a named model's is runners.NamedModel's (the suite's cases on the same
    # model and inputs share its runs); a module's a number of its own (ids are reused)
    key: Any = field(default_factory=lambda: next(_SUBJECTS))
    _params: Any = field(default=None, repr=False)

    @property
    def params(self):
        if self._params is None:
            self._params = jaxref.params_from_state(self.spec, self.state)
        return self._params


@functools.lru_cache(maxsize=2)
def named_subject(name: str) -> Subject:
    """A model named as in docs/DESIGN.md §6, fed its own parity inputs; its oracle parameters and cache
    entries are the suite's (runners.oracle_model, NamedModel's key)."""
    spec, state = load_weights(name)
    return Subject(name, spec, dict(state), name, key=("name", name), _params=oracle_model(name)[0])


def module_subject(module: Any, *, data: str = "random:llama") -> Subject:
    """A user's transformers causal LM of a supported family (llama, mistral, qwen2, SmolLM2's llama).

    Its weights are read as they are (bf16 ones widen exactly to float32); `data` names the model whose
    parity inputs it is fed (their token ids must lie within its vocabulary).
    """
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise InputError(f"expected a transformers causal LM (with a .config), got {type(module).__name__}")
    spec = from_hf_config(config.to_dict(), source=f"{type(module).__name__}.config")
    state = {k: v.detach().float().cpu().numpy() for k, v in module.state_dict().items()}
    subject = Subject(f"module:{type(module).__name__}", spec, state, data, module)
    try:
        subject.params  # noqa: B018 (a missing weight is an InputError here, not a KeyError mid-run)
    except KeyError as e:
        raise InputError(f"{type(module).__name__}: no weight {e} (expected Hugging Face names)") from None
    return subject


def subject_inputs(subject: Subject, variant: str, seq_len: int, seed: int = 0) -> CaseInputs:
    """The parity inputs of `subject.data` for the variant (layout plain), checked against the vocabulary."""
    inputs = case_inputs(Case(subject.data, variant, "plain", "fp32", "eager", seq_len, seed=seed))
    if int(inputs.tokens.max()) >= subject.spec.vocab_size:
        raise InputError(f"the inputs of {subject.data} hold token ids up to {int(inputs.tokens.max())}, beyond "
                         f"{subject.name}'s vocabulary of {subject.spec.vocab_size}: name another data model")
    return inputs


def torch_dtype(dtype: str):
    """The torch dtype of "float32" or "bfloat16"."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def stock_model(spec: ModelSpec, state: dict[str, np.ndarray], dtype: str, attn_implementation: str = "eager",
                use_cache: bool | None = False):
    """The family's stock transformers class built from the weights (config by anchor_core.spec.to_hf_config),
    parameters rounded to `dtype`; RoPE's inv_freq stays float32 (built by from_config(dtype=), as
    from_pretrained(dtype=) builds it). In eval mode, with transformers' `attn_implementation` (eager:
    the runners install theirs per call; benchmarks/bench_train_gpu.py trains it with sdpa or flex).

    use_cache: the config's use_cache, the model's default for a call that does not pass it (False: no
    cache, so a packed batch is read as packed; None: the family config's own default, True for the
    families here, as a checkpoint's config.json ships it: the `flattening` input style's model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**to_hf_config(spec))
    if use_cache is not None:
        config.use_cache = use_cache
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch_dtype(dtype))
    tensors = {k: torch.tensor(v) for k, v in state.items() if not (spec.tie_embeddings and k == "lm_head.weight")}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if sorted(missing) != (["lm_head.weight"] if spec.tie_embeddings else []) or unexpected:
        raise InputError(f"weights do not fit the {spec.family} model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


_MODELS: dict[tuple[int, str], Any] = {}


def subject_model(subject: Subject, dtype: str):
    """The torch model of the subject in `dtype` (cached, one subject at a time): the stock class, or a
    copy of the user's module with its parameters cast (buffers kept as built: a bf16 inv_freq stays)."""
    key = (subject.key, dtype)
    if key not in _MODELS:
        for k in [k for k in _MODELS if k[0] != subject.key]:
            del _MODELS[k]
        if subject.module is None:
            model = stock_model(subject.spec, subject.state, dtype, use_cache=None)
        else:
            model = copy.deepcopy(subject.module).eval()
            for p in model.parameters():
                p.data = p.data.to(torch_dtype(dtype))
        _MODELS[key] = model
    return _MODELS[key]


def clear_models() -> None:
    """Drop the cached torch models (`subject_model`'s): a finished report keeps none alive."""
    _MODELS.clear()
