"""Oracle params: orbax save/restore round trip, and a damaged checkpoint is an InputError."""

from __future__ import annotations

import numpy as np
import pytest

import jaxref
from anchor_core.errors import InputError


def test_orbax_round_trip_gives_identical_logits(tmp_path):
    params, spec = jaxref.load_model("random:qwen2")
    jaxref.save_params(params, spec, tmp_path / "ckpt")
    params2, spec2 = jaxref.restore_params(tmp_path / "ckpt")
    assert spec2 == spec
    tokens = np.random.default_rng(0).integers(3, spec.vocab_size, (1, 97))
    a = np.asarray(jaxref.forward(params, spec, tokens, policy="fp64"))
    b = np.asarray(jaxref.forward(params2, spec2, tokens, policy="fp64"))
    np.testing.assert_array_equal(a, b)


def test_restore_of_a_damaged_checkpoint_is_an_input_error(tmp_path):
    params, spec = jaxref.load_model("random:llama")
    path = jaxref.save_params(params, spec, tmp_path / "ckpt")
    (path / "spec.json").write_text("{not json")
    with pytest.raises(InputError, match="not an oracle checkpoint"):
        jaxref.restore_params(path)
