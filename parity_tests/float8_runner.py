"""FP8 linear layers as a parity runner: `float8_<recipe>:<engine>` runs a torchtrain engine with the decoder layers'
linears in torchao's float8 training recipe (torchtrain.model.float8, `model.float8`), held against the oracle's
emulation of the engine with the recipe's FP8 stages (`<emulation>+float8_<recipe>`, jaxref.policy.FLOAT8_RECIPES).

On a device without FP8 matmuls (the CPU, a GPU before compute capability 8.9) torchao's emulation runs, as
`model.float8_emulation` trains it. The gradient cases (`anchor parity --grads`) build their model the same way
(`build`).

    anchor parity --model default --engine float8_rowwise:varlen --variant anchor --grads
"""

from __future__ import annotations

import re

import torchtrain
from anchor_core.errors import InputError
from parity_tests.runners import TorchRunner, device, register_family
from torchtrain.model import float8

RUNNER_PREFIX = "float8_"
_NAME = re.compile(r"float8_(\w+):(\w+)$")


class Float8Runner(TorchRunner):
    """A torchtrain engine with its decoder layers' linears in torchao's `recipe` (a fresh model per case: the
    conversion changes the model in place)."""

    def __init__(self, recipe: str, engine: str):
        super().__init__(engine, name=f"float8_{recipe}:{engine}")
        self.recipe = recipe

    @property
    def emulation(self) -> str:  # type: ignore[override]
        return f"{super().emulation}+float8_{self.recipe}"

    def available(self) -> str | None:
        try:
            float8.check(self.recipe, None, True)
        except InputError as e:
            return str(e)
        return super().available()

    def build(self, model: str, dtype: str):
        """The case's model on the parity device with the recipe's FP8 linears (emulated without FP8 matmuls)."""
        built = torchtrain.build_model(model, engine=self.engine, dtype=dtype).to(device())
        return float8.convert(built, self.recipe, emulate=not float8.device_has_fp8(device()))

    def model_for(self, case, dtype: str):
        return self.build(case.model, dtype).eval()


def float8_runner(name: str) -> Float8Runner:
    """`float8_<recipe>:<engine>`: a recipe of torchtrain.model.float8.RECIPES and a torchtrain engine."""
    m = _NAME.match(name)
    if m is None or m.group(1) not in float8.RECIPES or m.group(2) not in torchtrain.ENGINES:
        raise InputError(f"unknown engine {name!r}: an FP8 runner is float8_<recipe>:<engine>, recipe one of "
                         f"{', '.join(float8.RECIPES)}, engine one of {', '.join(torchtrain.ENGINES)} "
                         "(e.g. float8_rowwise:varlen)")
    return Float8Runner(m.group(1), m.group(2))


register_family(RUNNER_PREFIX, float8_runner)
