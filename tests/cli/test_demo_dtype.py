"""The demo's dtype: bf16 where the machine has bf16 units, fp32 elsewhere, for training and evaluation;
the choice is part of the training's fingerprint and of the page."""

from __future__ import annotations

from dataclasses import replace

import pytest

from anchor.demo import PROFILES, DemoSettings, fingerprints
from anchor.demo.page import index_page
from anchor.demo.pipeline import choose_dtype, resolve_dtype


@pytest.fixture
def cpu(monkeypatch):
    """Fake the machine: no CUDA, and a CPU whose bf16 instruction sets are the ones given."""
    import torch

    from anchor_core import machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def have(*units: str) -> None:
        monkeypatch.setattr(machine, "cpu_bf16", lambda: list(units))

    return have


@pytest.mark.parametrize("units", [("avx512_bf16",), ("amx_bf16",), ("avx512_bf16", "amx_bf16")])
def test_a_cpu_with_bf16_units_trains_and_evaluates_in_bf16(cpu, units):
    cpu(*units)
    choice = choose_dtype()
    assert choice["dtype"] == "bfloat16" and choice["bf16_units"] == list(units)
    assert all(u in choice["reason"] for u in units), choice
    s, got = resolve_dtype(PROFILES["demo"])
    assert got == choice
    assert (s.train_dtype, s.eval_dtype) == ("bfloat16", "bfloat16")
    assert s.zero_stage == 1  # the trainer's bf16 needs ZeRO >= 1


def test_a_cpu_without_bf16_units_trains_and_evaluates_in_fp32(cpu):
    cpu()
    choice = choose_dtype()
    assert choice["dtype"] == "float32" and choice["bf16_units"] == []
    assert "no bf16 units" in choice["reason"]
    s, _ = resolve_dtype(PROFILES["demo"])
    assert (s.train_dtype, s.eval_dtype, s.zero_stage) == ("float32", "float32", 0)


def test_the_dtype_is_in_the_training_fingerprint(cpu):
    cpu("avx512_bf16")
    bf16, _ = resolve_dtype(PROFILES["demo"])
    cpu()
    fp32, _ = resolve_dtype(PROFILES["demo"])
    a, b = fingerprints(bf16), fingerprints(fp32)
    assert a["pack"] == b["pack"] and a["train"] != b["train"] and a["eval"] != b["eval"]


def test_a_given_dtype_is_kept(cpu):
    cpu("avx512_bf16")
    s = DemoSettings(train_dtype="float32", eval_dtype="auto")
    assert resolve_dtype(s) == (s, None)
    paper = PROFILES["paper-gpu"]
    assert resolve_dtype(paper) == (paper, None)
    assert resolve_dtype(replace(s, train_dtype="auto", eval_dtype="float32"))[0].eval_dtype == "float32"


@pytest.mark.parametrize("units,dtype", [(("avx512_bf16",), "bfloat16"), ((), "float32")])
def test_the_page_says_which_dtype_and_why(tmp_path, cpu, units, dtype):
    cpu(*units)
    choice = choose_dtype()
    record = {"model": "m", "jobs": {}, "dtype_choice": choice}
    index_page(tmp_path, record)
    html = (tmp_path / "index.html").read_text()
    assert f"Training and evaluation in {dtype}: " in html
    assert ("has bf16 units (avx512_bf16)" in html) == bool(units) and ("no bf16 units" in html) == (not units)
