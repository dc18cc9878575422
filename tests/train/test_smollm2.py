"""The embedded SmolLM2 at T=2048 on the embedded corpus, with `anchor` and with `full`: a short run
lowers the loss, and its `hf/` export reloads in transformers and passes `anchor parity`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.conftest import ROOT, metrics, run_train

pytestmark = [pytest.mark.slow, pytest.mark.model]
CONFIG = ROOT / "configs" / "train" / "smollm2_2k.yaml"
STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    out = {}
    for variant in ("anchor", "full"):
        data = [] if not out else [f"data.path={out['anchor'] / 'data'}"]
        out[variant] = root / variant
        run_train(out[variant], f"model.variant={variant}", f"schedule.steps={STEPS}", "data.global_batch=1", "checkpoint.save_every=0",
                  "eval.window=0", *data, config=CONFIG)
    return out


def _loss(model_name: str, data_dir: Path, variant: str) -> float:
    """Mean masked next-token loss of a model on the windows of the run's first step."""
    from anchor_core.data.packed import Loader, PackedData
    from torchtrain import build_model, next_token_loss

    data = PackedData.open(data_dir)
    batch = next(Loader(data, batch_size=1, variant=variant, seed=0))
    model = build_model(model_name, engine="sdpa", dtype="float32")
    with torch.no_grad():
        out = model(input_ids=batch.tokens, position_ids=batch.positions, doc_ids=batch.doc_ids, variant=variant)
        loss, _ = next_token_loss(out.logits, torch.as_tensor(batch.tokens), torch.as_tensor(batch.loss_mask))
    return float(loss)


@pytest.mark.parametrize("variant", ["anchor", "full"])
def test_short_run_lowers_the_loss(runs, variant):
    run = runs[variant]
    rows = metrics(run)
    print(variant, [round(r["loss"], 4) for r in rows])
    hf = run / "checkpoints" / f"step-{STEPS}" / "hf"
    data_dir = runs["anchor"] / "data"
    before, after = _loss("default", data_dir, variant), _loss(str(hf), data_dir, variant)
    print(f"{variant}: loss on the first step's window {before:.4f} -> {after:.4f}")
    assert after < before - 0.01


@pytest.mark.parametrize("variant", ["anchor", "full"])
def test_hf_export_reloads_in_transformers(runs, variant):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anchor_core.tokenizer import load_tokenizer
    from torchtrain import build_model

    hf = runs[variant] / "checkpoints" / f"step-{STEPS}" / "hf"
    text = "The capital of France is Paris. def f(x):\n    return x + 1"
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == load_tokenizer("default").encode_batch([text])[0]
    ids = torch.tensor([[1, *ids]])
    stock = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ours = build_model(str(hf), engine="sdpa", dtype="float32")
    with torch.no_grad():
        a = stock(ids, use_cache=False).logits
        b = ours(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
    err = float((a - b).abs().max() / a.abs().max())
    print(f"{variant}: transformers' own load vs torchtrain on the export: max rel {err:.2e}")
    assert err <= 1e-5


@pytest.mark.parametrize("variant", ["anchor", "full"])
def test_hf_export_passes_anchor_parity(runs, variant, tmp_path, capsys):
    from anchor.cli import main

    hf = runs[variant] / "checkpoints" / f"step-{STEPS}" / "hf"
    with pytest.raises(SystemExit) as e:
        main(["parity", "--model", str(hf), "--out", str(tmp_path / "parity"), "--policies", "fp32",
              "--variants", variant, "--no-progress"])
    result = json.loads((tmp_path / "parity" / "parity.json").read_text())
    print([(c["variant"], c["policy"], c["engine"], c["pass"]) for c in result["cases"]])
    assert e.value.code == 0 and result["pass"] and len(result["cases"]) == 3
