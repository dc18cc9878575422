"""torchtrain.training.memory: the parameter count its estimates rest on is the built model's, for every family."""

from __future__ import annotations

import pytest

from anchor_core.spec import RANDOM_PRESETS
from anchor_core.weights import load_spec
from torchtrain.training.memory import parameters
from torchtrain.model import build_model


@pytest.mark.parametrize("preset", sorted(RANDOM_PRESETS))
def test_parameters_count_the_built_model(preset):
    model = build_model(f"random:{preset}")
    assert parameters(load_spec(f"random:{preset}")) == sum(p.numel() for p in model.parameters())
