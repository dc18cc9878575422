"""Dtype policies: the dtype of every numerical stage of the decoder (docs/DESIGN.md §4).

A `DtypePolicy` is a frozen value passed explicitly to every jaxref function; there is no global
default. Presets emulate the stacks the paper compares (fp64 truth, fp32, Hugging Face bf16,
FlashAttention-2 bf16 and the paper's bf16 recipe). A policy can also be written as YAML:

    base: hf_bf16          # optional: a preset the keys below override
    name: hf_bf16_rope32   # optional
    rope_apply: float32    # any stage of STAGES
    attention: dense       # dense | online
    kv_block: 128          # key/value block of the online softmax
    exp: exact             # exact | fexp_u20 (the online softmax's exponential, see jaxref.attention)
    lanes: 8               # fexp_u20's vector lanes: a key block's keys past its last whole vector take exp
    backward: autodiff     # autodiff | fa2 | flex | cpu (the online attention's backward, see jaxref.attention)
    linear_in: float8_e4m3fn    # optional: FP8 operands of the decoder layers' linear products (not the lm-head)
    linear_grad: float8_e5m2    # optional, with linear_in: their backward's gradient operand (the recipe's backward)
    probs: float8_e4m3fn        # optional: the probabilities before p·v, when they differ from pv_in
    scaling: rowwise            # tensorwise | rowwise: how FP8 stages are scaled (jaxref.fp8)
    rope_phase: mod2pi          # plain | mod2pi: RoPE's angle reduced mod 2π in fp64 before rope_angle (jaxref.rope)

Stages, in docs/DESIGN.md §4 order:
  param       weights as stored
  act         residual stream and layer inputs/outputs
  norm        RMSNorm arithmetic (the layers' and the final norm, Qwen3's per-head q/k norms)
  rope_angle  position * inv_freq
  rope_table  cos/sin as used
  rope_apply  x*cos + rotate(x)*sin
  qk_in       operands of q·kᵀ
  qk_acc      its accumulator
  logits      the stored logits
  softmax     softmax arithmetic
  pv_in       operands of p·v (the probabilities are rounded to this)
  pv_acc      its accumulator
  head        final norm and lm-head

FP8 (`float8_e4m3fn`, `float8_e5m2`; jaxref.fp8) goes on the stages FP8 recipes put it on: `qk_in`, `pv_in`
and the optional `linear_in`, `linear_grad`, `probs`, each rounded through a scale (`scaling`); the arithmetic
after such a stage holds the dequantized values in float32 (`DtypePolicy.dtype` gives float32 for it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from anchor_core.errors import InputError
from anchor_core.machine import cpu_capability
from anchor_core import shipped
from anchor_core.yamlfile import read_yaml_mapping
from jaxref.fp8 import CARRIER, FP8_DTYPES, SCALINGS

STAGES: tuple[str, ...] = (
    "param", "act", "norm", "rope_angle", "rope_table", "rope_apply",
    "qk_in", "qk_acc", "logits", "softmax", "pv_in", "pv_acc", "head",
)
DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16", "float16")
OPTIONAL_STAGES: tuple[str, ...] = ("linear_in", "linear_grad", "probs")
"""Stages a policy may leave unset: FP8 only (unset: the linear products' operands in `act`/`param` with
autodiff's backward; the probabilities rounded to `pv_in`)."""
FP8_STAGES: tuple[str, ...] = ("linear_in", "linear_grad", "qk_in", "pv_in", "probs")
"""The stages that may hold an FP8 dtype: where FP8 training and attention recipes use it."""
ATTENTIONS: tuple[str, ...] = ("dense", "online")
# Spellings accepted on input; a policy always stores the canonical name.
_ALIASES: dict[str, str] = {
    "fp64": "float64", "f64": "float64", "double": "float64",
    "fp32": "float32", "f32": "float32", "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
}
_EXTRA_KEYS: tuple[str, ...] = ("name", "attention", "kv_block", "exp", "lanes", "backward", *OPTIONAL_STAGES,
                                "scaling", "rope_phase")
ROPE_PHASES: tuple[str, ...] = ("plain", "mod2pi")
EXPS: tuple[str, ...] = ("exact", "fexp_u20")
BACKWARDS: tuple[str, ...] = ("autodiff", "fa2", "flex", "cpu")


def _dtype_name(value: object, *, what: str, path: object | None = None, stage: str | None = None) -> str:
    """Canonical dtype name of `value` (a name, an alias or a numpy/JAX dtype) for `stage`; InputError
    otherwise (an FP8 dtype only on FP8_STAGES, and only an FP8 dtype on OPTIONAL_STAGES)."""
    if isinstance(value, (np.dtype, type)):
        try:
            value = jnp.dtype(value).name
        except TypeError:
            value = repr(value)
    elif not isinstance(value, str):  # None (an empty YAML value), numbers, lists: never a dtype
        value = repr(value)
    name = _ALIASES.get(str(value).lower(), str(value).lower())
    valid = FP8_DTYPES if stage in OPTIONAL_STAGES else DTYPES + FP8_DTYPES if stage in FP8_STAGES else DTYPES
    if name not in valid:
        if name in FP8_DTYPES:
            raise InputError(f"{what} cannot be {name}: FP8 goes on the stages {', '.join(FP8_STAGES)}", path=path)
        raise InputError(f"unknown dtype {value!r} for {what} (valid: {', '.join(valid)})", path=path)
    return name


@dataclass(frozen=True)
class DtypePolicy:
    """The dtype of each numerical stage (docs/DESIGN.md §4) and the attention arithmetic.

    Stage fields hold canonical dtype names ("float64", "float32", "bfloat16", "float16").
    `attention`: "dense" (materialised logits, one softmax) or "online" (FlashAttention-2-style
    blockwise online softmax over key/value blocks of `kv_block` slots). `exp`: the exponential of
    the online softmax's probabilities: "exact" (the softmax dtype's exp) or "fexp_u20" (the fast
    float32 exponential torch's CPU flash kernel uses for bf16/fp16 inputs; `jaxref.attention.fexp_u20`).
    `lanes`: the float32 lanes of the vectors that exponential runs on (8 under AVX2, 16 under AVX512):
    the keys of a key block past its last whole vector go through the kernel's scalar loop, whose
    exponential is exp. `backward` (online attention only): "autodiff" (the VJP of the forward's
    arithmetic), or a kernel's own backward written out (`jaxref.attention.kernel_backward`): "fa2"
    (FlashAttention-2: dS rounded to the `qk_in` dtype before dQ and dK, D = rowsum(dO·O) from the
    output rounded to `qk_in`, each query head's dK and dV rounded before its GQA group's sum) or
    "flex" (FlexAttention: the same with the group's sum in the accumulator; D in fp32 as FA-2's) or
    "cpu" (torch's fused CPU kernel: FA-2's arithmetic with dQ, dK and dV added into `qk_in` gradients per
    block of queries and keys and per query head).
    """

    param: str
    act: str
    norm: str
    rope_angle: str
    rope_table: str
    rope_apply: str
    qk_in: str
    qk_acc: str
    logits: str
    softmax: str
    pv_in: str
    pv_acc: str
    head: str
    name: str
    attention: Literal["dense", "online"] = "dense"
    kv_block: int = 128
    exp: Literal["exact", "fexp_u20"] = "exact"
    lanes: int = 8
    backward: Literal["autodiff", "fa2", "flex", "cpu"] = "autodiff"
    linear_in: str | None = None
    linear_grad: str | None = None
    probs: str | None = None
    scaling: Literal["tensorwise", "rowwise"] = "tensorwise"
    rope_phase: Literal["plain", "mod2pi"] = "plain"

    def __post_init__(self) -> None:
        for stage in STAGES:
            object.__setattr__(self, stage, _dtype_name(getattr(self, stage), what=f"stage {stage!r}", stage=stage))
        for stage in OPTIONAL_STAGES:
            if getattr(self, stage) is not None:
                object.__setattr__(self, stage, _dtype_name(getattr(self, stage), what=f"stage {stage!r}",
                                                            stage=stage))
        if self.linear_grad is not None and self.linear_in is None:
            raise InputError("linear_grad (the FP8 backward of the linear products) needs linear_in")
        if self.rope_phase not in ROPE_PHASES:
            raise InputError(f"unknown rope_phase {self.rope_phase!r} (valid: {', '.join(ROPE_PHASES)})")
        if self.scaling not in SCALINGS:
            raise InputError(f"unknown scaling {self.scaling!r} (valid: {', '.join(SCALINGS)})")
        if self.backward != "autodiff" and self.fp8_attention:
            raise InputError(f"backward {self.backward!r} is a bf16 kernel's; FP8 attention stages "
                             f"({', '.join(s for s in ('qk_in', 'pv_in', 'probs') if getattr(self, s) in FP8_DTYPES)})"
                             " take backward: autodiff")
        if self.attention not in ATTENTIONS:
            raise InputError(f"unknown attention {self.attention!r} (valid: {', '.join(ATTENTIONS)})")
        if isinstance(self.kv_block, bool) or not isinstance(self.kv_block, int) or self.kv_block < 1:
            raise InputError(f"kv_block must be a positive integer, got {self.kv_block!r}")
        if self.exp not in EXPS:
            raise InputError(f"unknown exp {self.exp!r} (valid: {', '.join(EXPS)})")
        if isinstance(self.lanes, bool) or not isinstance(self.lanes, int) or self.lanes < 1:
            raise InputError(f"lanes must be a positive integer, got {self.lanes!r}")
        if self.backward not in BACKWARDS:
            raise InputError(f"unknown backward {self.backward!r} (valid: {', '.join(BACKWARDS)})")
        if self.backward != "autodiff" and self.attention != "online":
            raise InputError(f"backward {self.backward!r} is an online attention's (attention: online), "
                             f"not {self.attention!r}'s")

    @property
    def fp8_attention(self) -> bool:
        """Whether q·kᵀ's or p·v's operands or the probabilities are FP8."""
        return any(getattr(self, s) in FP8_DTYPES for s in ("qk_in", "pv_in", "probs"))

    @property
    def fp8(self) -> bool:
        """Whether any stage is FP8."""
        return any(getattr(self, s) in FP8_DTYPES for s in FP8_STAGES)

    def dtype(self, stage: str) -> jnp.dtype:
        """The JAX dtype the arithmetic holds `stage` (one of STAGES) in: its dtype, float32 for an FP8 stage
        (the dequantized values, `jaxref.fp8`)."""
        if stage not in STAGES:
            raise InputError(f"unknown policy stage {stage!r} (valid: {', '.join(STAGES)})")
        name = getattr(self, stage)
        return CARRIER if name in FP8_DTYPES else jnp.dtype(name)

    def forward_key(self) -> tuple:
        """What makes two policies' forwards compute the same numbers: every field but the name and the ones only
        the backward reads (`backward`, `linear_grad`). Programs that run forwards are shared by this key."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                     if f.name not in ("name", "backward", "linear_grad"))

    def probs_dtype(self) -> str:
        """The dtype name the probabilities are rounded to before p·v: `probs` where set, else `pv_in`."""
        return self.probs or self.pv_in

    def with_stages(self, **stages: object) -> DtypePolicy:
        """A copy with some stages changed; the name records the change, e.g. "hf_bf16[softmax=float64]"."""
        if not stages:
            return self
        changes = {}
        for stage, value in stages.items():
            if stage not in STAGES + OPTIONAL_STAGES:
                raise InputError(f"unknown policy stage {stage!r} (valid: {', '.join(STAGES + OPTIONAL_STAGES)})")
            changes[stage] = _dtype_name(value, what=f"stage {stage!r}", stage=stage)
        note = ",".join(f"{k}={v}" for k, v in changes.items())
        return dataclasses.replace(self, name=f"{self.name}[{note}]", **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (name, every stage, attention, kv_block, exp, lanes, backward; the optional stages set
        and, with an FP8 stage, scaling) that `get_policy` reads back."""
        fp8 = {s: getattr(self, s) for s in OPTIONAL_STAGES if getattr(self, s) is not None}
        if self.fp8:
            fp8["scaling"] = self.scaling
        if self.rope_phase != "plain":
            fp8["rope_phase"] = self.rope_phase
        return {"name": self.name, **{s: getattr(self, s) for s in STAGES},
                "attention": self.attention, "kv_block": self.kv_block, "exp": self.exp, "lanes": self.lanes,
                "backward": self.backward, **fp8}


def _preset(name: str, attention: Literal["dense", "online"] = "dense", kv_block: int = 128, exp: str = "exact",
            lanes: int = 8, backward: str = "autodiff", scaling: str = "tensorwise", **stages: str) -> DtypePolicy:
    return DtypePolicy(name=name, attention=attention, kv_block=kv_block, exp=exp, lanes=lanes,  # type: ignore[arg-type]
                       backward=backward, scaling=scaling, **stages)  # type: ignore[arg-type]


ONE_BLOCK = 1 << 30
"""A `kv_block` no window reaches: the online softmax sees every key of a row in one block."""


def _uniform(dtype: str) -> dict[str, str]:
    return {s: dtype for s in STAGES}


# Hugging Face eager/sdpa in bf16 (TOOLCHAIN-FACTS: "bf16 numerics of Llama"): fp32 angles, cos/sin
# cast to bf16, rotation in bf16, bf16 logits, fp32 softmax cast back to bf16.
_HF_BF16 = dict(
    param="bfloat16", act="bfloat16", norm="float32",
    rope_angle="float32", rope_table="bfloat16", rope_apply="bfloat16",
    qk_in="bfloat16", qk_acc="float32", logits="bfloat16", softmax="float32",
    pv_in="bfloat16", pv_acc="float32", head="bfloat16",
)

FLOAT8_RECIPES: dict[str, dict[str, str]] = {
    "rowwise": {"linear_in": "float8_e4m3fn", "linear_grad": "float8_e4m3fn", "scaling": "rowwise"},
    "tensorwise": {"linear_in": "float8_e4m3fn", "linear_grad": "float8_e5m2", "scaling": "tensorwise"},
}
"""torchao's float8 training recipes (`Float8LinearRecipeName`) as a policy's keys: `<policy>+float8_<recipe>` (a
name `get_policy` reads) is that policy with its linear products in the recipe's FP8 (torchtrain's `model.float8`)."""

PRESETS: dict[str, DtypePolicy] = {
    "fp64": _preset("fp64", **_uniform("float64")),
    "fp32": _preset("fp32", **_uniform("float32")),
    "hf_bf16": _preset("hf_bf16", **_HF_BF16),
    # FlashAttention-2: same RoPE as HF, fp32 logits in registers, online softmax, p rounded to bf16; its
    # backward (flash_bwd_kernel.h) with dS rounded to bf16 before dQ/dK and the per-head dK/dV of GQA.
    "fa2_bf16": _preset("fa2_bf16", "online", backward="fa2", **{**_HF_BF16, "logits": "float32"}),
    # FlexAttention (torch's Triton templates): FA-2's forward arithmetic; its backward rounds dS to bf16
    # too, takes D = rowsum(dO·O) as a bf16 sum and sums a GQA group's dK/dV inside the kernel.
    "flex_bf16": _preset("flex_bf16", "online", backward="flex", **{**_HF_BF16, "logits": "float32"}),
    # torch's fused CPU attention (F.scaled_dot_product_attention in bf16 on the CPU, any mask:
    # ATen/native/cpu/FlashAttentionKernel.cpp), one preset per capability of torch's CPU kernels
    # (CPU_KERNEL_POLICIES; the name `sdpa_cpu_bf16` resolves to this process's): the FA-2 arithmetic
    # above over key blocks of 512, the probabilities' exponential its fast `fexp_u20` (exp(0) =
    # 0.99994659) on whole float32 vectors of 8 lanes (AVX2) or 16 (AVX512), exp on the rest of a block;
    # DEFAULT has no vector exponential (`Vectorized<float>::fexp_u20` is std::exp there). Its backward
    # (`cpu_flash_attention_backward`) rounds dS to bf16 and adds dQ, dK, dV into bf16 gradients per block.
    **{name: _preset(name, "online", kv_block=512, exp=exp, lanes=lanes, backward="cpu",
                     **{**_HF_BF16, "logits": "float32"})
       for name, exp, lanes in (("sdpa_cpu_bf16_avx2", "fexp_u20", 8), ("sdpa_cpu_bf16_avx512", "fexp_u20", 16),
                                ("sdpa_cpu_bf16_default", "exact", 8))},
    # FA-2 arithmetic with each row's keys in one block (one max, one sum): torchtrain's pure-torch
    # `flash_attn_varlen_func` (torchtrain/attention/varlen_emulation.py), per segment.
    "fa2_bf16_1pass": _preset("fa2_bf16_1pass", "online", kv_block=ONE_BLOCK, **{**_HF_BF16, "logits": "float32"}),
    # The paper's recipe: RoPE entirely in fp32, rotated q/k cast to bf16, then FA-2 arithmetic.
    "paper_bf16": _preset(
        "paper_bf16", "online", backward="fa2", **{**_HF_BF16, "rope_table": "float32", "rope_apply": "float32",
                                                    "logits": "float32"},
    ),
    # torchao's float8 training (torchao.float8, Float8LinearRecipeName) on every linear of the decoder layers,
    # the lm-head and the attention (FlashAttention-2) in bf16 as fa2_bf16. rowwise: e4m3 operands and
    # gradients, one power-of-two scale per row; tensorwise: e4m3 operands, e5m2 gradients, one scale per tensor.
    "torchao_rowwise_bf16": _preset("torchao_rowwise_bf16", "online", backward="fa2",
                                    **FLOAT8_RECIPES["rowwise"], **{**_HF_BF16, "logits": "float32"}),
    "torchao_tensorwise_bf16": _preset("torchao_tensorwise_bf16", "online", backward="fa2",
                                       **FLOAT8_RECIPES["tensorwise"], **{**_HF_BF16, "logits": "float32"}),
    # TransformerEngine's FP8 with FP8 attention (Float8CurrentScaling, HYBRID format): e4m3 operands of the
    # linears, of q·kᵀ and of p·v (the probabilities scaled by their bound 1), e5m2 gradients of the linears,
    # one scale per tensor; fp32 logits, softmax and accumulators in an online softmax over key blocks.
    "te_fp8": _preset("te_fp8", "online", linear_in="float8_e4m3fn", linear_grad="float8_e5m2",
                      **{**_HF_BF16, "logits": "float32", "qk_in": "float8_e4m3fn", "pv_in": "float8_e4m3fn"}),
}


CPU_KERNEL_POLICIES: dict[str, str] = {
    "AVX2": "sdpa_cpu_bf16_avx2",
    "AVX512": "sdpa_cpu_bf16_avx512",
    "DEFAULT": "sdpa_cpu_bf16_default",
}
"""torch's CPU kernel capability (`torch.backends.cpu.get_cpu_capability()`) -> the preset that emulates
its bf16 flash attention. Capabilities not listed (NEON, SVE, VSX, ZVECTOR) have none known."""

CPU_KERNEL_ALIAS = "sdpa_cpu_bf16"
"""The name that resolves to `cpu_kernel_policy()` of this process."""


class NoEmulation(InputError):
    """No emulation of a stack is known (e.g. torch's CPU kernel under a capability not studied)."""


def cpu_kernel_policy(capability: str | None = None) -> DtypePolicy:
    """The emulation of torch's bf16 CPU flash-attention kernel under `capability` (default: the one torch
    dispatches to in this process, `anchor_core.machine.cpu_capability()`). NoEmulation where none is known."""
    if capability is None:
        capability = cpu_capability()
    name = CPU_KERNEL_POLICIES.get(str(capability).upper())
    if name is None:
        raise NoEmulation(f"no emulation of torch's CPU attention kernel is known for capability {capability!r} "
                          f"(known: {', '.join(CPU_KERNEL_POLICIES)})")
    return PRESETS[name]


def _from_mapping(d: Mapping[str, Any], *, path: object | None = None, default_name: str | None = None) -> DtypePolicy:
    unknown = [k for k in d if k != "base" and k not in STAGES and k not in _EXTRA_KEYS]
    if unknown:
        raise InputError(
            f"unknown policy key {unknown[0]!r} (valid: base, {', '.join(STAGES + _EXTRA_KEYS)})", path=path
        )
    stages = {s: _dtype_name(d[s], what=f"stage {s!r}", path=path, stage=s) for s in STAGES + OPTIONAL_STAGES
              if s in d}
    extras = {k: d[k] for k in ("attention", "kv_block", "exp", "lanes", "backward", "scaling", "rope_phase") if k in d}
    if "name" in d:
        extras["name"] = str(d["name"])
    elif default_name is not None:
        extras["name"] = default_name
    try:
        if "base" not in d:
            missing = [s for s in STAGES if s not in stages]
            if missing:
                raise InputError(f"policy without `base` must give every stage; missing: {', '.join(missing)}")
            return DtypePolicy(**{"name": "custom", **stages, **extras})
        base = d["base"]
        if base == CPU_KERNEL_ALIAS:
            policy = cpu_kernel_policy()
        elif not isinstance(base, str) or base not in PRESETS:
            raise InputError(f"unknown base preset {base!r} (valid: {', '.join(PRESETS)})")
        else:
            policy = PRESETS[base]
        # every change at once: a base's backward and the FP8 stages that refuse it may change together
        note = ",".join(f"{k}={v}" for k, v in stages.items())
        name = f"{policy.name}[{note}]" if note else policy.name
        return dataclasses.replace(policy, **{"name": name, **stages, **extras})
    except InputError as e:
        raise InputError(str(e), path=path) from None


def load_policy(path: str | Path) -> DtypePolicy:
    """Read a YAML policy file (see the module docstring); its name defaults to the file's stem."""
    path = Path(path)
    d = read_yaml_mapping(path, what="policy file", empty_ok=False)
    return _from_mapping(d, path=path, default_name=path.stem)


def get_policy(x: DtypePolicy | str | Path | Mapping[str, Any]) -> DtypePolicy:
    """A policy from a DtypePolicy, a preset name, a path to a YAML file, the name of a shipped policy file
    (`hf_bf16_rope_fp32`: anchor_core.shipped), or a mapping (YAML form). `sdpa_cpu_bf16` names the emulation
    of torch's CPU kernel of this process's capability; `<name>+float8_rowwise` (or `_tensorwise`) is that policy with
    torchao's recipe on its linear products (FLOAT8_RECIPES). A value ending in .yaml/.yml or holding a `/` is a path."""
    if isinstance(x, DtypePolicy):
        return x
    if isinstance(x, Mapping):
        return _from_mapping(x)
    if isinstance(x, Path) or (isinstance(x, str) and (x.endswith((".yaml", ".yml")) or "/" in x)):
        return load_policy(x)
    if isinstance(x, str):
        if x in PRESETS:
            return PRESETS[x]
        base, plus, recipe = x.rpartition("+float8_")
        if plus:
            if recipe not in FLOAT8_RECIPES:
                raise InputError(f"unknown float8 recipe {recipe!r} in {x!r} (valid: "
                                 f"{', '.join('float8_' + r for r in FLOAT8_RECIPES)})")
            policy = get_policy(base)
            return dataclasses.replace(policy, name=f"{policy.name}+float8_{recipe}", **FLOAT8_RECIPES[recipe])
        if x == CPU_KERNEL_ALIAS:
            return cpu_kernel_policy()
        if (path := shipped.find("policies", x)) is not None:
            return load_policy(path)
        raise InputError(f"unknown dtype policy {x!r} (presets: {', '.join(PRESETS)}, {CPU_KERNEL_ALIAS}; "
                         f"shipped: {', '.join(shipped.names('policies'))}; or a .yaml file)")
    raise InputError(f"a dtype policy is a preset name, a YAML path or a mapping, got {type(x).__name__}")


def parse_policies(text: str) -> list[DtypePolicy]:
    """`"fp32,hf_bf16_rope_fp32,configs/policies/x.yaml"` -> policies, in order (the `--policies` option)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise InputError(f"--policies: no policy given (presets: {', '.join(PRESETS)}; "
                         f"shipped: {', '.join(shipped.names('policies'))}; or a .yaml file)")
    return [get_policy(n) for n in names]
