"""Runners: whatever produces taps for a case. The comparison code only ever sees their output.

Legend: L layers, B windows, T slots, H hidden, N/K query/kv heads, D head dim, R tapped rows,
V vocabulary.

`Taps` maps a tap name to a numpy array with a leading layer axis (CONTRACT-level names shared
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
`logits` is required). The oracle side is `oracle_taps`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from anchor.errors import InputError
from parity_tests.cases import Case, CaseInputs

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


def get_runner(name: str) -> Runner:
    """The runner registered as `name`; an InputError listing the registered ones otherwise."""
    if name not in RUNNERS:
        raise InputError(f"unknown engine {name!r} (registered: {', '.join(RUNNERS)})")
    return RUNNERS[name]


# ---------------------------------------------------------------------------------------------
# The trainer


@functools.lru_cache(maxsize=4)
def torch_model(model: str, dtype: str):
    """A torchtrain model (cached per name and dtype; engines are switched in place)."""
    import torchtrain

    return torchtrain.build_model(model, engine="eager", dtype=dtype).eval()


Setup = Callable[[Any], contextlib.AbstractContextManager]

# The oracle policy whose bf16 arithmetic each engine follows on the CPU (where the runners run):
#   eager                  Hugging Face eager: bf16 logits, softmax in fp32 rounded to bf16, then p·v
#   sdpa                   torch's fused CPU kernel: fp32 logits, online softmax over key blocks of
#                          512, unnormalised probabilities rounded to bf16, division at the end
#   flash_varlen_emulated  the same FA-2 arithmetic with a segment's keys in one block
#   varlen                 the fused CPU kernel per segment (sdpa's arithmetic; a segment's keys
#                          start a block of 512)
#   flash_varlen, flex     FlashAttention-2 over key blocks of 128
# Holding sdpa against hf_bf16 (as before 2026-11-22) made SmolLM2's anchor cases fail at one
# document-start token whose layer-11 MLP amplifies attention roundings; see tests/parity_tests notes
# in parity_tests/test_matrix.py.
EMULATIONS: dict[str, str] = {
    "eager": "hf_bf16",
    "sdpa": "sdpa_cpu_bf16",
    "flash_varlen_emulated": "fa2_bf16_1pass",
    "varlen": "sdpa_cpu_bf16",
    "flash_varlen": "fa2_bf16",
    "flex": "fa2_bf16",
}


class TorchRunner(Runner):
    """A torchtrain engine: `torchtrain.build_model` + `capture_taps`, one forward without grad.

    setup: optional `f(model) -> context manager` entered around the forward (hooks and patches
    of a test that injects a defect); the shared cached model is restored when it exits.
    """

    def __init__(self, engine: str, *, name: str | None = None, emulation: str | None = None,
                 setup: Setup | None = None):
        self.engine = engine
        self.name = name or engine
        self.emulation = emulation or EMULATIONS.get(engine, "fa2_bf16")
        self.setup = setup

    def available(self) -> str | None:
        import torchtrain

        try:
            torchtrain.check_engine(self.engine)
        except InputError as e:
            return str(e)
        if self.engine == "flash_varlen":
            return "engine 'flash_varlen' runs on CUDA; the parity runners run on the CPU (use flash_varlen_emulated)"
        return None

    def run(self, case: Case, inputs: CaseInputs, dtype: str) -> Taps:
        import torch

        import torchtrain

        model = torchtrain.set_engine(torch_model(case.model, dtype), self.engine)
        feed = {
            "input_ids": torch.from_numpy(inputs.tokens),
            "position_ids": torch.from_numpy(inputs.positions),
            "doc_ids": torch.from_numpy(inputs.doc_ids),
            "variant": case.variant,
        }
        ctx = self.setup(model) if self.setup is not None else contextlib.nullcontext()
        with ctx, torch.no_grad(), torchtrain.capture_taps(model, rows=list(inputs.rows)) as taps:
            model(**feed, use_cache=False)
        return {name: np.stack([t.numpy() for t in taps[name]]) for name in TAP_ORDER if name in taps}


def _register_torchtrain() -> None:
    import torchtrain

    for engine in torchtrain.ENGINES:
        register(TorchRunner(engine))


_register_torchtrain()


# ---------------------------------------------------------------------------------------------
# The oracle


@functools.lru_cache(maxsize=2)
def oracle_model(model: str):
    """(params, spec) of the oracle; the same float32 weights torchtrain loads."""
    import jaxref

    return jaxref.load_model(model)


_ORACLE_CACHE: dict[tuple, Taps] = {}
_ORACLE_CACHE_SIZE = 4


def oracle_taps(case: Case, inputs: CaseInputs, policy: str) -> Taps:
    """The oracle's taps under a dtype policy preset (cached for the last few (inputs, policy))."""
    key = (case.data_key, policy)
    if key in _ORACLE_CACHE:
        _ORACLE_CACHE[key] = _ORACLE_CACHE.pop(key)  # most recently used last
        return _ORACLE_CACHE[key]
    import jaxref

    params, spec = oracle_model(case.model)
    logits, per_layer = jaxref.forward(
        params, spec, inputs.tokens, positions=inputs.positions, doc_ids=inputs.doc_ids,
        variant=case.variant, policy=policy, taps=True, tap_rows=inputs.rows,
    )
    out: Taps = {}
    for name in TAP_ORDER:
        x = np.asarray(per_layer[name])
        if x.dtype.itemsize < 4:  # bf16 → float32 exactly
            x = x.astype(np.float32)
        out[name] = x[None] if name in ("embed", "logits") else x
    while len(_ORACLE_CACHE) >= _ORACLE_CACHE_SIZE:
        _ORACLE_CACHE.pop(next(iter(_ORACLE_CACHE)))
    _ORACLE_CACHE[key] = out
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
