"""Model specs: one description of a Llama-family decoder for both frameworks.

`ModelSpec` is the toolkit's own config. `to_hf_config` / `from_hf_config` are the
single translation point between it and Hugging Face transformers' config dicts
(`rope_parameters`, head counts, bias and tying flags); nothing else in the project
spells Hugging Face config keys.

Families:
  llama    Llama 2 / Llama 3 (Llama 3 is `llama` with `rope.kind == "llama3"` and GQA)
  mistral  Mistral (GQA, explicit head_dim allowed)
  qwen2    Qwen2 (bias on q/k/v, no BOS token: slot 0 holds EOS)
  qwen3    Qwen3 (RMSNorm of each query and key head over head_dim after the projections and before
           RoPE, no q/k/v bias, head_dim independent of hidden / heads, no BOS token; tied or untied)
  smollm2  SmolLM2 (Llama architecture with tied input/output embeddings)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from anchor_core.errors import InputError

Family = Literal["llama", "mistral", "qwen2", "qwen3", "smollm2"]
RopeKind = Literal["default", "linear", "dynamic", "yarn", "llama3", "ntk"]
RopeLayout = Literal["half", "interleaved"]

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "smollm2")
ROPE_KINDS: tuple[str, ...] = ("default", "linear", "dynamic", "yarn", "llama3", "ntk")
ROPE_LAYOUTS: tuple[str, ...] = ("half", "interleaved")

# The paper's RoPE base per training context length (AnchorAttention, §3.3 / Table 2).
PAPER_ROPE_BASE: dict[int, float] = {32768: 1e6, 65536: 5e6, 131072: 1e7, 262144: 5e7}

_HF_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "smollm2": "llama"}
HF_MODEL_TYPES: tuple[str, ...] = tuple(dict.fromkeys(_HF_MODEL_TYPE.values()))
"""transformers' model types of the families: RoPE decoders, whose positions the variants set (docs/DESIGN.md §2)."""
_HF_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm2": "LlamaForCausalLM",
}
# transformers' Qwen3Config.head_dim default: a Qwen3 config.json without head_dim means 128, not hidden / heads.
_QWEN3_HEAD_DIM = 128


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: `theta_i = base^(-2i/d)` and a scaling kind (docs/DESIGN.md §3).

    Fields a kind does not use are ignored by it. Each kind matches Hugging Face's
    `ROPE_INIT_FUNCTIONS[kind]` for the same parameters; `ntk` is the fixed NTK-aware
    base change `base * factor^(d/(d-2))`.
    """

    base: float = 10000.0
    kind: RopeKind = "default"
    factor: float = 1.0
    original_max_position: int | None = None  # dynamic, yarn, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: overrides 0.1*ln(factor)+1
    layout: RopeLayout = "half"

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise InputError(f"unknown RoPE scaling kind {self.kind!r} (known: {', '.join(ROPE_KINDS)})")
        if self.layout not in ROPE_LAYOUTS:
            raise InputError(f"unknown RoPE layout {self.layout!r} (known: {', '.join(ROPE_LAYOUTS)})")
        if not self.base > 1.0:
            raise InputError(f"RoPE base must be > 1, got {self.base}")
        if self.kind in ("linear", "dynamic", "yarn", "llama3", "ntk") and not self.factor >= 1.0:
            raise InputError(f"RoPE {self.kind} scaling needs factor >= 1, got {self.factor}")
        if self.kind in ("yarn", "llama3") and self.original_max_position is None:
            raise InputError(f"RoPE {self.kind} scaling needs original_max_position")


@dataclass(frozen=True)
class ModelSpec:
    """Sizes and options of a Llama-family decoder. Shapes: H hidden, N heads, K kv heads, D head dim."""

    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    max_position: int = 4096
    rope: RopeSpec = field(default_factory=RopeSpec)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise InputError(f"unsupported model family {self.family!r} (supported: {', '.join(FAMILIES)})")
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise InputError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.qkv_bias and self.family != "qwen2":
            raise InputError(f"q/k/v bias is a Qwen2 feature; family {self.family!r} has none")

    @property
    def qk_norm(self) -> bool:
        """Queries and keys are RMS-normed per head over D (weights q_norm, k_norm [D]) after their
        projections and before RoPE: Qwen3's `Qwen3Attention`, the family's only difference from Llama."""
        return self.family == "qwen3"

    @property
    def first_token_id(self) -> int:
        """The token at slot 0 of every window: BOS, or EOS where the tokenizer has no BOS (Qwen)."""
        return self.eos_token_id if self.bos_token_id is None else self.bos_token_id

    @property
    def groups(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def with_rope(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, rope=dataclasses.replace(self.rope, **changes))


# ---------------------------------------------------------------------------------------------
# Random presets: tiny, odd sizes (RoPE and masking bugs hide at round sizes and near slot 0).

RANDOM_PRESETS: dict[str, ModelSpec] = {
    "llama": ModelSpec(
        family="llama", vocab_size=331, hidden_size=84, num_layers=3, num_heads=6, num_kv_heads=6,
        head_dim=14, intermediate_size=97, rms_norm_eps=1e-5, max_position=4096,
        rope=RopeSpec(base=10000.0), bos_token_id=1, eos_token_id=2,
    ),
    "llama3": ModelSpec(
        family="llama", vocab_size=331, hidden_size=84, num_layers=3, num_heads=6, num_kv_heads=2,
        head_dim=14, intermediate_size=97, rms_norm_eps=1e-5, max_position=8192,
        rope=RopeSpec(base=500000.0, kind="llama3", factor=8.0, original_max_position=256,
                      low_freq_factor=1.0, high_freq_factor=4.0),
        bos_token_id=1, eos_token_id=2,
    ),
    "mistral": ModelSpec(
        family="mistral", vocab_size=331, hidden_size=84, num_layers=3, num_heads=6, num_kv_heads=2,
        head_dim=16, intermediate_size=97, rms_norm_eps=1e-5, max_position=8192,
        rope=RopeSpec(base=1e6), bos_token_id=1, eos_token_id=2,
    ),
    "qwen2": ModelSpec(
        family="qwen2", vocab_size=331, hidden_size=84, num_layers=3, num_heads=6, num_kv_heads=2,
        head_dim=14, intermediate_size=97, rms_norm_eps=1e-6, max_position=8192,
        rope=RopeSpec(base=1e6), tie_embeddings=True, qkv_bias=True, bos_token_id=None, eos_token_id=2,
    ),
    # head_dim 18 is not hidden / heads (14), as in Qwen3 (head_dim 128 throughout; Qwen3-0.6B: hidden
    # 1024 / 16 heads = 64); tied as Qwen3-0.6B to 4B (8B and up untie: tests/jaxref/test_decoder_parity.py
    # reads such a config).
    "qwen3": ModelSpec(
        family="qwen3", vocab_size=331, hidden_size=84, num_layers=3, num_heads=6, num_kv_heads=2,
        head_dim=18, intermediate_size=97, rms_norm_eps=1e-6, max_position=8192,
        rope=RopeSpec(base=1e6), tie_embeddings=True, bos_token_id=None, eos_token_id=2,
    ),
    "smollm2": ModelSpec(
        family="smollm2", vocab_size=331, hidden_size=90, num_layers=3, num_heads=9, num_kv_heads=3,
        head_dim=10, intermediate_size=97, rms_norm_eps=1e-5, max_position=8192,
        rope=RopeSpec(base=100000.0), tie_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
}


def random_preset(name: str) -> ModelSpec:
    """The spec of `random:<name>`; an unknown name is an InputError listing the known ones."""
    try:
        return RANDOM_PRESETS[name]
    except KeyError:
        raise InputError(
            f"unknown random preset {name!r} (known: {', '.join('random:' + k for k in RANDOM_PRESETS)})"
        ) from None


# ---------------------------------------------------------------------------------------------
# The one translation point to and from Hugging Face configs.


def ntk_base(rope: RopeSpec, head_dim: int) -> float:
    """Fixed NTK-aware base: `base * factor^(d/(d-2))` (docs/DESIGN.md §3)."""
    return rope.base * rope.factor ** (head_dim / (head_dim - 2))


def hf_rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    """Our RoPE as transformers' `rope_parameters` dict (transformers >= 5)."""
    rope = spec.rope
    if rope.layout != "half":
        raise InputError("Hugging Face Llama-family models only implement the `half` RoPE layout")
    if rope.kind == "default":
        return {"rope_type": "default", "rope_theta": rope.base}
    if rope.kind == "ntk":
        return {"rope_type": "default", "rope_theta": ntk_base(rope, spec.head_dim)}
    if rope.kind == "linear":
        return {"rope_type": "linear", "rope_theta": rope.base, "factor": rope.factor}
    if rope.kind == "dynamic":
        out = {"rope_type": "dynamic", "rope_theta": rope.base, "factor": rope.factor}
        if rope.original_max_position is not None:
            out["original_max_position_embeddings"] = rope.original_max_position
        return out
    if rope.kind == "yarn":
        out = {
            "rope_type": "yarn", "rope_theta": rope.base, "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position,
            "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow,
        }
        if rope.attention_factor is not None:
            out["attention_factor"] = rope.attention_factor
        return out
    if rope.kind == "llama3":
        return {
            "rope_type": "llama3", "rope_theta": rope.base, "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position,
            "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
        }
    raise AssertionError(rope.kind)


def to_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A `config.json`-style dict that transformers' `AutoConfig.for_model(**d)` accepts."""
    d: dict[str, Any] = {
        "model_type": _HF_MODEL_TYPE[spec.family],
        "architectures": [_HF_ARCH[spec.family]],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings,
        "rope_parameters": hf_rope_parameters(spec),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_id,
    }
    if spec.rope.kind == "dynamic" and spec.rope.original_max_position is not None:
        # transformers' dynamic scaling reads the pretraining length from max_position_embeddings.
        d["max_position_embeddings"] = spec.rope.original_max_position
    if spec.family in ("llama", "smollm2"):
        d["attention_bias"] = False
        d["mlp_bias"] = False
    elif spec.family == "mistral":
        d["sliding_window"] = None
    elif spec.family == "qwen2":
        d["use_sliding_window"] = False
        d["sliding_window"] = None
    elif spec.family == "qwen3":
        d["attention_bias"] = False
        d["use_sliding_window"] = False
        d["sliding_window"] = None
    return d


class _HFReader:
    """Typed reads of a transformers config dict, the way transformers' strict config classes read it:
    integers must be JSON integers, floats JSON numbers, flags booleans; RoPE parameters may be numbers
    or numeric strings (transformers stores them unvalidated). Anything else is an InputError naming
    the file and the key."""

    def __init__(self, d: dict[str, Any], source: str):
        self.d, self.source = d, source

    def fail(self, key: str, what: str, value: Any) -> InputError:
        return InputError(f"{key}: expected {what}, got {value!r}", path=self.source)

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def int(self, key: str, default: Any = KeyError, *, lo: int | None = 1, d: dict | None = None,
            prefix: str = "") -> Any:
        d = self.d if d is None else d
        v = d.get(key)
        if v is None:
            if default is KeyError:
                raise InputError(f"model config lacks the key {prefix + key!r}", path=self.source)
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(prefix + key, "an integer", v)
        if lo is not None and v < lo:
            raise self.fail(prefix + key, f"an integer >= {lo}", v)
        return v

    def float(self, key: str, default: float, *, d: dict | None = None, prefix: str = "",
              strings: bool = False, positive: bool = True) -> float:
        d = self.d if d is None else d
        v = d.get(key)
        if v is None:
            return default
        if isinstance(v, str) and strings:
            try:
                x = float(v)
            except ValueError:
                raise self.fail(prefix + key, "a number", v) from None
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(prefix + key, "a number", v)
        else:
            x = float(v)
        if x != x or x in (float("inf"), float("-inf")) or (positive and not x > 0):
            raise self.fail(prefix + key, "a finite positive number" if positive else "a finite number", v)
        return x

    def bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, "true or false", v)
        return v

    def token_id(self, key: str, vocab: int, *, lists: bool) -> int | None:
        """A token id: null or an integer; with `lists` (transformers' `eos_token_id`) also a list of
        integers, of which the first counts ([] is null)."""
        v = self.d.get(key)
        if isinstance(v, list) and not lists:
            raise self.fail(key, "null or an integer", v)
        if isinstance(v, list):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise self.fail(key, "null, an integer or a list of integers", v)
            v = v[0] if v else None
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, "null, an integer or a list of integers" if lists else "null or an integer", v)
        if not 0 <= v < vocab:
            raise InputError(f"{key}: {v} is outside the vocabulary (0 to {vocab - 1})", path=self.source)
        return v


def _rope_from_hf(d: dict[str, Any], head_dim: int, *, source: str = "config.json") -> RopeSpec:
    r = _HFReader(d, source)
    params = d.get("rope_parameters")
    legacy = d.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise r.fail(key, "an object (or null)", value)
    params = dict(params or {})
    key = "rope_parameters"
    if not params:
        params = dict(legacy or {})
        key = "rope_scaling"
        if "rope_theta" not in params and d.get("rope_theta") is not None:
            params["rope_theta"] = d["rope_theta"]
    if isinstance(params.get("rope_parameters"), dict):  # nested per-layer-type parameters are not supported
        raise InputError(f"{key}: per-layer-type RoPE parameters are not supported", path=source)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "dynamic", "yarn", "llama3"):
        raise InputError(f"{key}.rope_type: unsupported RoPE scaling type {kind!r} "
                         "(supported: default, linear, dynamic, yarn, llama3)", path=source)
    p = key + "."

    def num(name: str, default: float, positive: bool = True) -> float:
        return r.float(name, default, d=params, prefix=p, strings=True, positive=positive)

    original = params.get("original_max_position_embeddings")
    if isinstance(original, str) and original.strip().isdigit():
        original = int(original)
    if original is not None:
        original = r.int("original_max_position_embeddings", d=params, prefix=p)
    if kind == "dynamic" and original is None:
        original = r.int("max_position_embeddings", None)  # transformers' own reading for dynamic
    base = num("rope_theta", r.float("rope_theta", 10000.0, strings=True))
    attention = params.get("attention_factor")
    return RopeSpec(
        base=base,
        kind=kind,
        factor=num("factor", 1.0),
        original_max_position=original,
        low_freq_factor=num("low_freq_factor", 1.0),
        high_freq_factor=num("high_freq_factor", 4.0),
        beta_fast=num("beta_fast", 32.0),
        beta_slow=num("beta_slow", 1.0),
        attention_factor=None if attention is None else num("attention_factor", 1.0),
    )


def from_hf_config(d: dict[str, Any], *, source: str = "config.json") -> ModelSpec:
    """Read a transformers config dict (a `config.json`) as transformers reads it; unsupported
    architectures, missing keys and values of the wrong type are InputErrors naming `source` and the key.

    `bos_token_id` may be null or an integer, `eos_token_id` also a list (the first id counts; [] is
    null), as in transformers; a null EOS falls back to 2 (ModelSpec's default; the tokenizer names the
    EOS the data pipeline uses).
    """
    if not isinstance(d, dict):
        raise InputError(f"a model config must be a JSON object, got {type(d).__name__}", path=source)
    model_type = d.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise InputError(
            f"unsupported architecture {model_type!r} (supported: {', '.join(HF_MODEL_TYPES)})", path=source
        )
    r = _HFReader(d, source)
    hidden = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    if model_type == "qwen3":  # transformers' Qwen3Config: 128 when absent, an error when null
        head_dim = r.int("head_dim", None) if "head_dim" in d else _QWEN3_HEAD_DIM
        if head_dim is None:
            raise r.fail("head_dim", "an integer", None)
        if r.bool("attention_bias", False):
            raise InputError("Qwen3 configs with attention_bias are not supported", path=source)
        if r.bool("use_sliding_window", False):
            raise InputError("Qwen3 configs with use_sliding_window are not supported (sliding-window "
                             "attention layers)", path=source)
    else:
        head_dim = r.int("head_dim", None) or hidden // heads
    tie = r.bool("tie_word_embeddings", False)
    family: str = model_type
    if model_type == "llama" and tie:
        family = "smollm2"
    if model_type == "llama" and (r.bool("attention_bias", False) or r.bool("mlp_bias", False)):
        raise InputError("Llama configs with attention_bias/mlp_bias are not supported", path=source)
    vocab = r.int("vocab_size")
    bos = r.token_id("bos_token_id", vocab, lists=False)
    eos = r.token_id("eos_token_id", vocab, lists=True)
    try:
        return ModelSpec(
            family=family,  # type: ignore[arg-type]
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=r.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=r.int("num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=r.int("intermediate_size"),
            rms_norm_eps=r.float("rms_norm_eps", 1e-6),
            max_position=r.int("max_position_embeddings", 4096),
            rope=_rope_from_hf(d, head_dim, source=source),
            tie_embeddings=tie,
            qkv_bias=model_type == "qwen2",
            bos_token_id=None if model_type in ("qwen2", "qwen3") else bos,
            eos_token_id=min(2, vocab - 1) if eos is None else eos,
        )
    except InputError as e:
        if e.path is None:  # ModelSpec / RopeSpec checks: name the file
            raise InputError(str(e), path=source) from None
        raise
