"""The README's code runs as written: the Python API block (the public API, as the README shows it), and the first
page's Trainer snippet on a tiny model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from anchor_core.export import export_hf
from anchor_core.spec import random_preset
from anchor_core.weights import random_state
from tests.test_readme import README, trainer_snippet
from torchtrain.parallel.distributed import environ_for_child

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def readme_python_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: no ```python block under ## Python API"
    return match.group(1)


@pytest.mark.model
@pytest.mark.skipif(not MODEL.exists(), reason="the embedded SmolLM2 GGUF is fetched by `make install`")
def test_readme_python_block_runs(tmp_path, monkeypatch):
    """Run in a scratch folder holding the repository's configs, so `runs/tiny` lands there."""
    os.symlink(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_python_block(), "README.md:Python API", "exec"), namespace)
    assert namespace["logits"].shape[:2] == namespace["tokens"].shape
    assert set(namespace["taps"]) >= {"q", "k", "attn_out", "mlp_out", "hidden"}
    assert namespace["out"].logits.shape[:2] == namespace["tokens"].shape
    assert namespace["train"] and (tmp_path / "runs/tiny/config.yaml").exists()
    assert namespace["result"] and namespace["grads"]
    assert namespace["report"]["rows"][0]["status"] == "computes"


HUB_MODEL = '"HuggingFaceTB/SmolLM2-135M"'  # the snippet's one model name, replaced by a local tiny model here


def test_readme_trainer_snippet_runs(tmp_path):
    """The snippet as written, in a process of its own, with one change: its hub model name becomes a folder
    holding a tiny random Llama and its byte tokenizer (the tests reach no hub). It trains two steps in Trainer
    with anchor_varlen and check_step says the step computes the anchor variant."""
    snippet = trainer_snippet(README.read_text(encoding="utf-8"))
    assert snippet.count(HUB_MODEL) == 1, f"the snippet names {HUB_MODEL} once"
    spec = random_preset("llama")
    export_hf(spec, random_state(spec, seed=0), tmp_path / "tiny", tokenizer_of="random:llama")
    (tmp_path / "snippet.py").write_text(snippet.replace(HUB_MODEL, repr(str(tmp_path / "tiny"))))
    # not the world of a run this pytest worker trained in-process (tests/test_extras.py)
    done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**environ_for_child(), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    message = done.stdout.strip().splitlines()[-1]
    assert message.startswith("anchor check_step: LlamaForCausalLM (anchor_varlen") and "it computes anchor." in message
    assert (tmp_path / "out").is_dir()  # Trainer's output_dir: it trained
