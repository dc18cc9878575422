"""Runners: whatever produces taps for a case. The comparison code only ever sees their output.

Legend: L layers, B windows, T slots, H hidden, N/K query/kv heads, D head dim, R tapped rows,
V vocabulary.

`Taps` maps a tap name to a numpy array with a leading layer axis (names shared
by jaxref and torchtrain):

  embed     [1,B,T,H]        q [L,B,T,N,D]   k [L,B,T,K,D]   (after RoPE)
  scores    [L,B,N,R,T]      probs [L,B,N,R,T]              (rows R = CaseInputs.rows)
  attn_out  [L,B,T,H]        mlp_out [L,B,T,H]   hidden [L,B,T,H]
  logits    [1,B,T,V]

A runner is registered under a name, which is what a case's `engine` field names:

    @register
    class MyRunner(Runner):
        name = "ulysses_sp2"
        emulation = "fa2_bf16"          # the oracle preset that models its bf16 arithmetic
        def run(self, case, inputs, dtype): ... return taps

Every torchtrain engine is registered here as a `TorchRunner`; a sequence-parallel layout or a new
kernel is one more runner (a subset of taps is fine: only the taps a runner returns are compared,
`logits` is required). The oracle side is `oracle` (one cache for every comparison); `oracle_taps` is a
case's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import jaxref
import torchtrain
from anchor_core.errors import InputError
from jaxref.reference import LAYER_NAMES
from parity_tests.cases import BF16, Case, CaseInputs
from parity_tests.emulations import EMULATIONS  # engine -> the oracle policy emulating it
from parity_tests.emulations import emulation as emulation_of

Taps = dict[str, np.ndarray]
TAP_ORDER: tuple[str, ...] = ("embed", "q", "k", "scores", "probs", "attn_out", "mlp_out", "hidden", "logits")
PER_LAYER: tuple[str, ...] = ("q", "k", "scores", "probs", "attn_out", "mlp_out", "hidden")


class Runner:
    """Produces taps for a case. Subclasses set `name`, `emulation` and implement `run`.

    name: the registry key (a case's `engine`).
    emulation: the oracle bf16 preset whose arithmetic this runner's bf16 mode follows; a bf16
      case with policy "bf16" is held against it.
    """

    name: str = ""
    emulation: str = "hf_bf16"

    def run(self, case: Case, inputs: CaseInputs, dtype: str) -> Taps:
        """Taps of `case` on `inputs` with parameters/activations in `dtype` ("float32"/"bfloat16")."""
        raise NotImplementedError

    def available(self) -> str | None:
        """None when the runner can run here, else the reason it cannot."""
        return None

    def oracle_model(self, case: Case) -> Any:
        """The model the oracle holds this runner's taps against (`oracle`): the case's model, by name."""
        return NamedModel(case.model)


RUNNERS: dict[str, Runner] = {}


def register(runner: Runner | type[Runner]) -> Runner | type[Runner]:
    """Add a runner (instance or class, instantiated without arguments) to the registry; usable as
    a class decorator. A name registered twice is replaced (tests re-register)."""
    inst = runner() if isinstance(runner, type) else runner
    if not inst.name:
        raise ValueError("a runner needs a name")
    RUNNERS[inst.name] = inst
    return runner


def unregister(name: str) -> None:
    RUNNERS.pop(name, None)


# Families of runners built on demand from a name's prefix (`hf:IMPLEMENTATION@STYLE`: transformers' own
# implementations, parity_tests.hf_stack.runner.StackRunner; `cp<C>:ENGINE`: a torchtrain engine at context-parallel
# degree C, parity_tests.context_runner). The module of a family registers its builder when it is
# imported (`register_family`); the registry loads it by name on the first use of its prefix, as plug-ins are
# loaded, so the registry depends on none of the families it serves.
FAMILIES: dict[str, str] = {"hf:": "parity_tests.hf_stack.runner", "cp": "parity_tests.context_runner",
                             "float8_": "parity_tests.float8_runner"}
_BUILDERS: dict[str, Callable[[str], Runner]] = {}


def register_family(prefix: str, build: Callable[[str], Runner]) -> None:
    """Build the runners whose names start with `prefix` with `build(name)` (an InputError for a bad name)."""
    _BUILDERS[prefix] = build


def get_runner(name: str) -> Runner:
    """The runner registered as `name`, or one of a family's built on demand (FAMILIES: transformers' own
    attention implementations as `hf:IMPLEMENTATION[@INPUT_STYLE]`: eager, sdpa, flex_attention,
    flash_attention_2 in each input style; a torchtrain engine at context-parallel degree C as `cp<C>:ENGINE`; one
    with FP8 linears as `float8_<RECIPE>:ENGINE`); an InputError listing them otherwise."""
    if name in RUNNERS:
        return RUNNERS[name]
    for prefix, module in FAMILIES.items():
        if name.startswith(prefix):
            if prefix not in _BUILDERS:
                importlib.import_module(module)  # registers its builder
            return _BUILDERS[prefix](name)
    raise InputError(f"unknown engine {name!r} (registered: {', '.join(RUNNERS)}; transformers' own: "
                     "hf:IMPLEMENTATION[@INPUT_STYLE], e.g. hf:sdpa@mask4d-float; context-parallel: cp<C>:ENGINE, "
                     "e.g. cp2:varlen; FP8 linears: float8_<RECIPE>:ENGINE, e.g. float8_rowwise:varlen)")


# ---------------------------------------------------------------------------------------------
# The trainer


_DEVICE = ["cpu"]  # where the trainer's side runs: `use_device`


def use_device(name: str) -> str:
    """Run the trainer's side of the parity cases on `name` ("cpu" or "cuda"; the oracle runs where
    jaxref.device.use_device put it, `anchor parity --oracle-device`): one line where the device is not here.
    Returns the name."""
    import torch

    if name not in ("cpu", "cuda"):
        raise InputError(f"--device: expected cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    _DEVICE[0] = name
    return name


def device() -> str:
    return _DEVICE[0]


@functools.lru_cache(maxsize=4)
def _torch_model(model: str, dtype: str, where: str):
    return torchtrain.build_model(model, engine="eager", dtype=dtype).eval().to(where)


def torch_model(model: str, dtype: str):
    """A torchtrain model on the parity device (cached per name, dtype and device; engines are switched in
    place)."""
    return _torch_model(model, dtype, device())


Setup = Callable[[Any], contextlib.AbstractContextManager]


class TorchRunner(Runner):
    """A torchtrain engine: `torchtrain.build_model` + `capture_taps`, one forward without grad.

    setup: optional `f(model) -> context manager` entered around the forward (hooks and patches
    of a test that injects a defect); the shared cached model is restored when it exits.
    """

    def __init__(self, engine: str, *, name: str | None = None, emulation: str | None = None,
                 setup: Setup | None = None):
        self.engine = engine
        self.name = name or engine
        self._emulation = emulation
        self.setup = setup

    @property
    def emulation(self) -> str:
        """The oracle policy the engine is held against: the one given, else the engine's on the parity
        device (parity_tests.emulations: varlen and sdpa run other kernels on CUDA)."""
        return self._emulation or emulation_of(self.engine, device())

    def available(self) -> str | None:
        try:
            torchtrain.check_engine(self.engine)
        except InputError as e:
            return str(e)
        if self.engine == "flash_varlen" and device() != "cuda":
            return "engine 'flash_varlen' runs on CUDA: run the parity cases with --device cuda (or use flash_varlen_emulated)"
        return None

    def model_for(self, case: Case, dtype: str):
        """The model the forward runs: the shared cached one, its engine switched to this runner's."""
        return torchtrain.set_engine(torch_model(case.model, dtype), self.engine)

    def run(self, case: Case, inputs: CaseInputs, dtype: str) -> Taps:
        import torch

        model = self.model_for(case, dtype)
        on = device()
        feed = {
            "input_ids": torch.from_numpy(inputs.tokens).to(on),
            "position_ids": torch.from_numpy(inputs.positions).to(on),
            "doc_ids": torch.from_numpy(inputs.doc_ids).to(on),
            "variant": case.variant,
        }
        ctx = self.setup(model) if self.setup is not None else contextlib.nullcontext()
        with ctx, torch.no_grad(), torchtrain.capture_taps(model, rows=list(inputs.rows)) as taps:
            model(**feed, use_cache=False)
        return as_arrays(taps)


def as_arrays(taps: dict[str, list[Any]]) -> Taps:
    """torchtrain.capture_taps' lists of per-layer tensors as the comparison's numpy arrays (layer axis first)."""
    return {name: np.stack([t.numpy() for t in taps[name]]) for name in TAP_ORDER if name in taps}


def _register_torchtrain() -> None:
    for engine in torchtrain.ENGINES:
        register(TorchRunner(engine))


_register_torchtrain()


# ---------------------------------------------------------------------------------------------
# The oracle


@functools.lru_cache(maxsize=2)
def oracle_model(model: str):
    """(params, spec) of the oracle; the same float32 weights torchtrain loads."""
    return jaxref.load_model(model)


@dataclasses.dataclass(frozen=True, eq=False)
class NamedModel:
    """A model the oracle runs, named as in docs/DESIGN.md §6. What `oracle` needs of a model: `key` (what
    its cache entries are keyed by), `params` (jaxref's) and `spec`; parity_tests.hf_stack.Subject (a user's
    module) is one too."""

    name: str

    @property
    def key(self) -> tuple[str, str]:
        return ("name", self.name)

    @property
    def params(self):
        return oracle_model(self.name)[0]

    @property
    def spec(self):
        return oracle_model(self.name)[1]


_ORACLE_CACHE: dict[tuple, Taps] = {}
# One set of inputs: the truths of the four variants (a stack is identified against each), the fp32
# policy's run, and the summation orders of one bf16 emulation.
_ORACLE_CACHE_SIZE = 10


# Taps whose last axis is the hidden size (the axis a summation order permutes; see `oracle`).
HIDDEN_TAPS: tuple[str, ...] = ("embed", "attn_out", "mlp_out", "hidden")


def _digest(*arrays: Any) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def oracle(model: Any, inputs: CaseInputs, variant: str, policy: str, order: int = 0, *,
           positions: np.ndarray | None = None) -> Taps:
    """The oracle's taps of `variant` on the inputs' tokens and doc_ids under a dtype policy preset: the one
    oracle run of every parity comparison (the suite's cases, transformers' stacks, the black-box check).

    model: a `NamedModel` or anything with `key`, `params`, `spec` (a user's module's Subject).
    positions: int [B,T]; default the variant's own (§2: jaxref.positions of the doc_ids), which is what a
      case's inputs carry; the black-box check reads a stack at the batch's own positions.
    order: 0 computes the model as stored. order k > 0 computes the same model with its hidden units
      and MLP units listed in another order (permutation seeded by k, `permute_units`): the same
      function, term for term, whose every matmul and norm sums its terms in another order. The
      hidden-axis taps come back in the stored order. In fp64 the orders agree to ~1e-15; in bf16
      they are independent draws of the same arithmetic's rounding (the rule's baseline).
    Cached: the last `_ORACLE_CACHE_SIZE` runs, keyed by the model, the inputs' contents, the variant, the
    positions, the policy and the order.
    """
    if positions is None:
        positions = jaxref.positions(inputs.doc_ids, variant)
    key = (model.key, _digest(inputs.tokens, inputs.doc_ids, positions, np.asarray(inputs.rows, dtype=np.int64)),
           variant, policy, order)
    if key in _ORACLE_CACHE:
        _ORACLE_CACHE[key] = _ORACLE_CACHE.pop(key)  # most recently used last
        return _ORACLE_CACHE[key]
    params, hidden_perm = (model.params, None) if not order else permute_units(model.params, order)
    _, per_layer = jaxref.forward(params, model.spec, inputs.tokens, positions=positions, doc_ids=inputs.doc_ids,
                                  variant=variant, policy=policy, taps=True, tap_rows=inputs.rows)
    out: Taps = {}
    for name in TAP_ORDER:
        x = np.asarray(per_layer[name])
        if x.dtype.itemsize < 4:  # bf16 → float32 exactly
            x = x.astype(np.float32)
        if hidden_perm is not None and name in HIDDEN_TAPS:
            x = x[..., np.argsort(hidden_perm)]
        out[name] = x[None] if name in ("embed", "logits") else x
    while len(_ORACLE_CACHE) >= _ORACLE_CACHE_SIZE:
        _ORACLE_CACHE.pop(next(iter(_ORACLE_CACHE)))
    _ORACLE_CACHE[key] = out
    return out


def clear_oracle_cache() -> None:
    """Drop every cached oracle run (a report's models are done with)."""
    _ORACLE_CACHE.clear()


def oracle_taps(case: Case, inputs: CaseInputs, policy: str, order: int = 0) -> Taps:
    """`oracle` of a case's model (by name) and variant, at its inputs' positions."""
    return oracle(NamedModel(case.model), inputs, case.variant, policy, order, positions=inputs.positions)


# How each oracle parameter's axes index hidden units (H) and MLP units (I), leading layer axis
# included: the permutation of `permute_units` is applied along these axes.
_UNIT_AXES: dict[str, dict[str, int]] = {
    "embed": {"H": 1}, "final_norm": {"H": 0}, "lm_head": {"H": 1},
    "attn_norm": {"H": 1}, "mlp_norm": {"H": 1},
    "wq": {"H": 2}, "wk": {"H": 2}, "wv": {"H": 2}, "wo": {"H": 1},
    "bq": {}, "bk": {}, "bv": {}, "q_norm": {}, "k_norm": {},
    "w_gate": {"I": 1, "H": 2}, "w_up": {"I": 1, "H": 2}, "w_down": {"H": 1, "I": 2},
}


def unit_permutations(params: dict, order: int) -> dict[str, np.ndarray]:
    """{"H": hidden units' permutation, "I": MLP units'} of summation order `order` (seeded by it)."""
    rng = np.random.default_rng(order)
    H = params["embed"].shape[1]
    I = params["layers"]["w_gate"].shape[1]
    return {"H": rng.permutation(H), "I": rng.permutation(I)}


def permute_units(params: dict, order: int) -> tuple[dict, np.ndarray]:
    """The oracle's params with hidden units and MLP units reordered (a seeded permutation each):
    the same model, whose matmuls and norms sum in another order. Returns (params, hidden perm)."""
    perms = unit_permutations(params, order)

    def apply(name: str, x):
        if name not in _UNIT_AXES:
            raise KeyError(f"permute_units: no unit axes known for parameter {name!r}")
        for unit, axis in _UNIT_AXES[name].items():
            x = np.take(np.asarray(x), perms[unit], axis=axis)
        return x

    out = {k: apply(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = {k: apply(k, v) for k, v in params["layers"].items()}
    return out, perms["H"]


def unpermute_state(state: dict[str, np.ndarray], perms: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A Hugging Face state (`jaxref.hf_state` names and layout: a gradient computed under
    `permute_units`) back in the stored order of units: the inverse of `perms` along each name's unit axes."""
    top = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
    inverse = {u: np.argsort(p) for u, p in perms.items()}
    out = {}
    for name, x in state.items():
        if name in top:
            axes = _UNIT_AXES[top[name]]
        else:
            hf = name.split(".", 3)[3] if name.startswith("model.layers.") else None
            if hf not in LAYER_NAMES:
                raise KeyError(f"unpermute_state: no unit axes known for parameter {name!r}")
            axes = {u: a - 1 for u, a in _UNIT_AXES[LAYER_NAMES[hf]].items()}  # one layer: no layer axis
        for unit, axis in axes.items():
            x = np.take(np.asarray(x), inverse[unit], axis=axis)
        out[name] = x
    return out


@contextlib.contextmanager
def registered(*runners: Runner) -> Iterator[None]:
    """Register runners for the duration of a block (tests)."""
    try:
        for r in runners:
            register(r)
        yield
    finally:
        for r in runners:
            unregister(r.name)


def resolve_policy(policy: str, runner: Runner) -> tuple[str, str]:
    """(oracle policy the trainer is held against, trainer dtype) for a case's policy.

    "fp32" -> ("fp32", "float32"); "bf16" -> (the runner's emulation, "bfloat16"); a bf16 preset
    or policy file of jaxref (activations in bfloat16) -> (it, "bfloat16"). An emulation that depends
    on the machine (`sdpa_cpu_bf16`: torch's CPU kernel differs by capability) is named as resolved
    here, e.g. "sdpa_cpu_bf16_avx512"; where none is known for this machine, jaxref.policy.NoEmulation
    (an InputError) says so, and the case is not judged against a wrong one.
    """
    if policy == BF16:
        return jaxref.get_policy(runner.emulation).name, "bfloat16"
    p = jaxref.get_policy(policy)
    if p.act == "float32" and p.param == "float32":
        return policy, "float32"
    if p.act == "bfloat16":
        return policy, "bfloat16"
    raise InputError(f"policy {policy!r}: the trainer runs float32 or bfloat16 (activations {p.act})")
