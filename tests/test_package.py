"""`import anchor`, `python -m anchor` and the `anchor` command reach the application (docs/DESIGN.md
§Architecture): its functions resolve, and importing it loads neither JAX nor torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import anchor

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(anchor.API))
def test_each_name_of_the_api_resolves(name):
    assert callable(getattr(anchor, name)) and name in dir(anchor)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        anchor.nothing_here  # noqa: B018


def test_import_anchor_loads_no_framework():
    code = ("import sys, anchor, anchor_core; heavy = [m for m in ('jax', 'torch', 'transformers') if m in sys.modules];"
            " print(anchor.__version__ == anchor_core.__version__, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.split() == ["True", "[]"]


def test_python_m_anchor_is_the_command():
    out = subprocess.run([sys.executable, "-m", "anchor", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "Usage: anchor" in out.stdout and "train" in out.stdout


_CONFIG = ("from transformers import LlamaConfig; cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, "
           "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)")


@pytest.mark.parametrize("order", ["anchor first", pytest.param("transformers' models first", marks=pytest.mark.slow)])
def test_import_anchor_registers_the_attention_functions(order):
    """`import anchor` then `from_config(..., attn_implementation="anchor_varlen")` works, whichever of anchor and
    transformers' models is imported first; anchor.check_step and anchor.PackingCollator are offered beside."""
    first = "import anchor" if order == "anchor first" else "import transformers.modeling_utils; import anchor"
    code = (f"{first}; {_CONFIG}; from transformers import AutoModelForCausalLM, AttentionInterface; "
            "m = AutoModelForCausalLM.from_config(cfg, attn_implementation='anchor_varlen'); "
            "import torchtrain.hf as hf; "
            "print(m.config._attn_implementation, all(AttentionInterface._global_mapping[n] is hf.FUNCTIONS[n] "
            "for n in hf.FUNCTIONS), anchor.check_step.__name__, anchor.PackingCollator.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["anchor_varlen", "True", "check_step", "PackingCollator"]


def test_without_anchor_the_names_are_unknown_to_transformers():
    """The registration above is anchor's doing: a process that never imports it does not have the names."""
    code = (f"{_CONFIG}; from transformers import AutoModelForCausalLM; "
            "AutoModelForCausalLM.from_config(cfg, attn_implementation='anchor_varlen')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "anchor_varlen" in done.stderr
